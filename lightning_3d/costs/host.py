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


def microbatch_overhead_from(per_microbatch: float, layers: list[dict[str, float]]) -> float:
    """The per-micro-batch seconds outside the layers, from a model's measured seconds per micro-batch in the training
    loop and its layers' device and host seconds (``layers``: one mapping per layer with forward, backward,
    host_forward, host_backward): what is left of the micro-batch once its layers are priced by ``stage_pass_seconds``'
    rule (max of the summed device and host seconds per pass), at least 0. Pricing them otherwise than the planner
    does (the device's spans alone, say) would leave the layers' host time in this term, and the planner, which adds
    it on top of the max, would count that time twice."""
    total = lambda q: sum(float(layer[q]) for layer in layers)  # noqa: E731
    priced = max(total("forward"), total("host_forward")) + max(total("backward"), total("host_backward"))
    return max(0.0, float(per_microbatch) - priced)


#: the seconds of one block kind's host time the in-situ term holds (docs/planner.md "in-situ host times")
IN_SITU_PASSES = ("forward", "backward", "recompute_forward", "recompute_backward")


def in_situ_host_layers(isolated: dict[str, dict[str, float]], tiny_counts: dict[str, int],
                        deep_counts: dict[str, int], c_1: float, c_deep: float,
                        c_deep_recompute: float) -> tuple[dict[str, dict[str, float]], list[float]]:
    """Each block kind's host seconds inside the training loop (``IN_SITU_PASSES``) and the two loop scales
    ``[s, s_rc]``, from the profiler's tiny-width models: ``isolated[kind]`` their blocks' isolated host times (one
    block in a tight loop, per pass), ``tiny_counts``/``deep_counts`` the blocks per kind of the one-layer model and of
    the model at the real depth, ``c_1``/``c_deep``/``c_deep_recompute`` their per-micro-batch seconds in the training
    loop (host-bound at tiny widths: the host's seconds).

    With ``ends`` the micro-batch's seconds outside the blocks, c_1 = ends + s·Σ_1 and c_deep = ends + s·Σ_deep (Σ over
    each model's blocks of their isolated forward + backward), so s = (c_deep − c_1) / (Σ_deep − Σ_1): the blocks the
    depth adds cost c_deep − c_1, measured in the loop, and the isolated times only split that total among the kinds
    and passes. The checkpointed run gives s_rc = (c_deep_recompute − ends) / Σ_deep,rc. A scale is taken as measured
    (at least 0), also below 1: the loop's cost is what the planner predicts; a tight loop's own timing of the tiny
    block is not a bound on it (profiles before this rule clamped the scales at 1, which put the tight loop's noise
    into the floor: ``ProfiledCostModel`` re-derives their terms from the stored seconds)."""
    per = {k: isolated[k]["forward"] + isolated[k]["backward"] for k in isolated}
    per_rc = {k: isolated[k]["recompute_forward"] + isolated[k]["recompute_backward"] for k in isolated}
    extra = sum(n * per[k] for k, n in deep_counts.items()) - sum(n * per[k] for k, n in tiny_counts.items())
    scale = max(0.0, (c_deep - c_1) / extra) if extra > 0 else 1.0
    ends = c_1 - scale * sum(n * per[k] for k, n in tiny_counts.items())
    deep_rc = sum(n * per_rc[k] for k, n in deep_counts.items())
    scale_rc = max(0.0, (c_deep_recompute - ends) / deep_rc) if deep_rc > 0 else 1.0
    layers = {k: {"forward": scale * isolated[k]["forward"], "backward": scale * isolated[k]["backward"],
                  "recompute_forward": scale_rc * isolated[k]["recompute_forward"],
                  "recompute_backward": scale_rc * isolated[k]["recompute_backward"]} for k in deep_counts}
    return layers, [scale, scale_rc]
