"""What the GPU's clock and power did during a benchmark's timed steps, read through NVML (nvidia-ml-py) by a thread.

A GEMM-bound step on an H100/H200 runs at its power limit, where the SM clock follows the power the kernels draw:
the same kernel on the same shapes then takes longer when the clock is lower. Sampling the SM clock, the power, the
temperature and NVML's throttle reasons every few milliseconds during the timed steps says whether two systems ran
at the same clock. Without NVML (CPU runs, a machine without the library) it reports nothing.
"""

from __future__ import annotations

import threading
import time

import numpy as np

# NVML's clocks-event (throttle) reason bits, by the names nvml.h gives them.
REASONS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
           0x40: "hw_thermal", 0x80: "hw_power_brake"}


class ClockSampler:
    """``start()``/``stop()`` around the timed region (may repeat); ``result()``: medians and throttle shares."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.01) -> None:
        self.interval_s, self.samples, self._on = interval_s, [], threading.Event()
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception:  # noqa: BLE001 - no NVML here: report nothing
            self._nvml = None
            return
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        nvml, handle = self._nvml, self._handle
        while not self._stop.is_set():
            if self._on.wait(0.1):
                try:
                    self.samples.append((nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                                         nvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                                         nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                                         nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)))
                except Exception:  # noqa: BLE001 - a field this driver does not give
                    self._stop.set()
                time.sleep(self.interval_s)

    def start(self) -> None:
        self._on.set()

    def stop(self) -> None:
        self._on.clear()

    def result(self) -> dict | None:
        self._stop.set()
        if not self.samples:
            return None
        clock, power, temp, reasons = (np.asarray(c) for c in zip(*self.samples))
        return {"n": len(self.samples), "sm_mhz_median": float(np.median(clock)),
                "sm_mhz_p10_p90": np.percentile(clock, [10, 90]).tolist(), "power_w_median": float(np.median(power)),
                "power_w_max": float(power.max()), "temp_c_median": float(np.median(temp)),
                "throttle_share": {name: float(np.mean((reasons & bit) != 0)) for bit, name in REASONS.items()
                                   if np.any(reasons & bit)}}
