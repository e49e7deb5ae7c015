"""The profiler's lead (planner.timing, utils/compat.device_busy_for) with the CUDA calls replaced, so that the CPU
runs the GPU path: the spin's rate is the fastest of its probes, and a timed pass whose lead ran out before the host
had issued it is run again with a longer lead, the last run's spans kept."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import lightning_3d.planner.timing as timing
import lightning_3d.utils.compat as compat


class FakeEvent:
    """A CUDA event: ``elapsed_time`` from the script's list of milliseconds; ``query`` (has the GPU passed it) from
    the script's list of answers (True: the lead had run out when the host finished issuing)."""

    script: dict = {}

    def __init__(self, enable_timing: bool = True) -> None:
        self.index = None

    def record(self) -> None:
        FakeEvent.script["recorded"] = FakeEvent.script.get("recorded", 0) + 1
        self.index = FakeEvent.script["recorded"]

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        answers = FakeEvent.script["query"]
        return answers.pop(0) if answers else False

    def elapsed_time(self, end: FakeEvent) -> float:
        return FakeEvent.script["elapsed_ms"].pop(0)


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.script = {"query": [], "elapsed_ms": []}
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    return FakeEvent.script


def test_the_spin_rate_is_the_fastest_probe_after_a_spin_that_raises_the_clock(fake_cuda, monkeypatch) -> None:
    slept = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: slept.append(cycles))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(compat, "_CYCLES_PER_SECOND", {})
    # Three probes of 10M cycles: 10 ms (a clock still rising), 5 ms (2 GHz), 8 ms.
    fake_cuda["elapsed_ms"] = [10.0, 5.0, 8.0]
    compat.device_busy_for(0.003, torch.device("cuda", 0))
    assert slept[0] == 200_000_000 and slept[1:4] == [10_000_000] * 3  # the ramp, then the probes
    assert slept[4] == 6_000_000  # 3 ms at the fastest probe's 2e9 cycles per second, not at the first's 1e9
    compat.device_busy_for(0.001, torch.device("cuda", 0))  # calibrated once per device
    assert slept[5:] == [2_000_000]


def _measure(fake_cuda, monkeypatch, ran_out: list[bool]):
    leads = []
    monkeypatch.setattr(timing, "device_busy_for", lambda seconds, device: leads.append(seconds))
    monkeypatch.setattr(timing, "LEAD_RERUNS", timing.Counter())
    # Per span, in order: the idle pass's two spans (no lead, not asked), then each device pass's forward and backward.
    fake_cuda["query"] = list(ran_out)
    # Every span's elapsed milliseconds: idle pass 7 / 7, then the device passes 1 / 2, 3 / 4, ... in order.
    fake_cuda["elapsed_ms"] = [7.0, 7.0] + [float(i) for i in range(1, 20)]
    layer = nn.Linear(4, 4)
    out = timing.measure(layer, (torch.randn(2, 4),), lambda m, x: m(x), recompute=False,
                         device=torch.device("cuda"), dtype=None, warmup=0, repeats=1)
    return out, leads


def test_a_pass_whose_lead_held_is_timed_once(fake_cuda, monkeypatch) -> None:
    out, leads = _measure(fake_cuda, monkeypatch, [False, False])
    assert (out["forward"], out["backward"]) == (1e-3, 2e-3)
    assert len(leads) == 2 and timing.LEAD_RERUNS == {"passes": 1}


def test_a_pass_whose_lead_ran_out_runs_again_with_a_longer_lead(fake_cuda, monkeypatch) -> None:
    # The first device pass's backward ran out; the second held: its spans (3 and 4 ms) are the measurement.
    out, leads = _measure(fake_cuda, monkeypatch, [False, True, False, False])
    assert (out["forward"], out["backward"]) == (3e-3, 4e-3)
    assert leads[2] == pytest.approx(timing.LEAD_GROWTH * leads[0])
    assert leads[3] == pytest.approx(timing.LEAD_GROWTH * leads[1])
    assert timing.LEAD_RERUNS == {"passes": 1, "reruns": 1}


def test_after_the_retries_the_last_pass_stands(fake_cuda, monkeypatch) -> None:
    out, leads = _measure(fake_cuda, monkeypatch, [True] * 20)
    runs = 1 + timing.LEAD_RETRIES
    assert (out["forward"], out["backward"]) == (1e-3 * (2 * runs - 1), 1e-3 * 2 * runs)
    assert leads[-1] == pytest.approx(timing.LEAD_GROWTH ** timing.LEAD_RETRIES * leads[1])
    assert timing.LEAD_RERUNS["reruns"] == timing.LEAD_RETRIES
