"""Dense peak FLOP/s of the GPUs the library knows: the one table behind MFU everywhere.

The planner's device specs (``lightning_3d.costs``), the MFU callback (``ThroughputMFUMonitor``) and the benchmark
scripts (their MFU convention, benchmarks/CONVENTIONS.md) all read it, so a figure is written once. The values are the
vendors' dense figures per compute dtype; the sparse figures of the datasheets (twice these) are never used, because
training GEMMs are dense and MFU against a sparse peak would halve.
"""

from __future__ import annotations

import torch

# An H200 is the H100 SXM's silicon with more and faster memory: the same tensor-core peaks.
_HOPPER_SXM = {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}

#: GPU key -> compute dtype ("bf16", "fp16", "tf32", "fp32") -> dense peak FLOP/s of one device
DENSE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100": dict(_HOPPER_SXM),
    "h200": dict(_HOPPER_SXM),
    "a100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dense_peak_flops(gpu: str, dtype: torch.dtype | str = "bf16") -> float:
    """Dense peak FLOP/s of one ``gpu`` ("h100", "h200", "a100") for GEMMs in ``dtype`` (a torch dtype or one of
    "bf16", "fp16", "tf32", "fp32")."""
    key = _DTYPE_KEYS.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if gpu not in DENSE_PEAK_FLOPS:
        raise ValueError(f"dense_peak_flops: unknown GPU {gpu!r}; known are {sorted(DENSE_PEAK_FLOPS)} (give the peak"
                         f" yourself for another device).")
    table = DENSE_PEAK_FLOPS[gpu]
    if key not in table:
        raise ValueError(f"dense_peak_flops: no peak for dtype {dtype!r}; use one of {sorted(table)}.")
    return table[key]

