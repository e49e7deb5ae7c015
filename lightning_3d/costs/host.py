"""The host's share of a pipeline stage's pass over one micro-batch, shared by the planner
(``lightning_3d.planner.model``) and dynamic micro-batching (``lightning_3d.dynamic.stage_costs``), so that both
price a micro-batch by the same rule (docs/planner.md, docs/dynamic.md "The host floor").

Eager PyTorch issues every kernel from Python: a stage's pass cannot end before the host has issued its layers'
kernels, nor before the device has run them. The two overlap across the stage's layers (the host issues the next
layers while the device runs the earlier ones), so the pass takes max(Σ device seconds, Σ host seconds) over the
stage's layers, not Σ max per layer. On top of that come the fixed host costs of one forward and one backward call
(the strategy's engine, the autograd engine's start), which the profiler measures as one total per micro-batch.

Cost models without host times (the analytic model, version-1 profiles) answer zeros, and the rule reduces to the
device's sum exactly.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from lightning_3d.costs.model import CostModel, LayerKind


def layer_host_time(cost_model: CostModel, kind: LayerKind, microbatch_size: ArrayLike, seq_len: ArrayLike, *,
                    target_len: ArrayLike | None = None, recompute: bool = False,
                    tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds the host takes to issue one layer's kernels: the cost model's
    ``layer_host_time`` (``ProfiledCostModel``'s), zeros of the query's shape for models without one."""
    host = getattr(cost_model, "layer_host_time", None)
    if host is None:
        shape = np.broadcast_shapes(np.shape(microbatch_size), np.shape(seq_len),
                                    np.shape(target_len) if target_len is not None else ())
        return np.zeros(shape), np.zeros(shape)
    f, b = host(kind, microbatch_size, seq_len, target_len=target_len, recompute=recompute, tp=tp)
    return np.asarray(f, dtype=np.float64), np.asarray(b, dtype=np.float64)


def microbatch_overhead(cost_model: CostModel) -> float:
    """The measured host seconds of one micro-batch outside its layers (0 for models that did not measure it)."""
    return float(getattr(cost_model, "microbatch_overhead_seconds", 0.0) or 0.0)


def stage_pass_seconds(device_forward: ArrayLike, device_backward: ArrayLike, host_forward: ArrayLike,
                       host_backward: ArrayLike, overhead: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of a stage's pass over a micro-batch, from its layers' summed device and host
    seconds (arrays broadcast) and the per-micro-batch ``overhead``: max(device, host) per pass, plus half the
    overhead on each (each stage runs one forward and one backward call per micro-batch; the profiler measures their
    fixed costs as one total)."""
    half = overhead / 2
    return (np.maximum(device_forward, host_forward) + half, np.maximum(device_backward, host_backward) + half)
