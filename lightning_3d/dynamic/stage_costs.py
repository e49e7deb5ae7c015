"""Per-stage cost of a micro-batch shape: the cost model's per-layer answers summed over the layers of each pipeline
stage, for many shapes at once (NumPy arrays), as the partitioner and the schedule search need them.

A stage holds a contiguous run of the model's blocks (the same even split as the strategy's ``split_layers``, or a
given ``layer_split``); stage 0 also holds the embedding, the last stage the head. Its forward/backward time is the
planner's rule (``lightning_3d.costs.host.stage_pass_seconds``): the larger of its layers' summed device seconds and
their summed host seconds, plus the measured per-micro-batch overhead, so that a micro-batch costs at least the
host's time to issue it (docs/dynamic.md, "The host floor"). Its stored activation bytes are sums over its layers;
its transient bytes are the largest of its layers' peaks (layers run one after the other, so their working sets do
not add up).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_3d.costs.host import layer_host_time, microbatch_overhead, stage_pass_seconds
from lightning_3d.costs.model import CostModel, LayerKind, ModelShape


def stage_layers(shape: ModelShape, num_stages: int, layer_split: Sequence[int] | None = None) -> list[list[LayerKind]]:
    """The layer kinds of every pipeline stage, in order."""
    kinds = shape.layer_kinds()
    blocks = kinds[1:-1]
    if layer_split is None:
        if len(blocks) < num_stages:
            raise ValueError(
                f"The model has {len(blocks)} blocks, fewer than the {num_stages} pipeline stages (pp x virtual_stages);"
                " lower pipeline_parallel_size or virtual_stages."
            )
        base, extra = divmod(len(blocks), num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    else:
        counts = list(layer_split)
        if len(counts) != num_stages or sum(counts) != len(blocks) or min(counts) < 1:
            raise ValueError(
                f"layer_split={counts} must list {num_stages} positive block counts summing to {len(blocks)}."
            )
    stages, start = [], 0
    for s, count in enumerate(counts):
        layers = list(blocks[start : start + count])
        start += count
        if s == 0:
            layers.insert(0, kinds[0])
        if s == num_stages - 1:
            layers.append(kinds[-1])
        stages.append(layers)
    return stages


@dataclass(frozen=True)
class StageCosts:
    """Arrays of shape (num_stages, *shape of the query): seconds and bytes of each stage for each micro-batch."""

    forward: np.ndarray
    backward: np.ndarray
    stored: np.ndarray
    transient: np.ndarray

    def take(self, index) -> StageCosts:
        """The costs of a subset of the queried shapes (``index`` into the query's dimensions)."""
        return StageCosts(*(a[:, index] for a in (self.forward, self.backward, self.stored, self.transient)))


def evaluate(
    cost_model: CostModel, stages: list[list[LayerKind]], microbatch_size: np.ndarray, seq_len: np.ndarray,
    target_len: np.ndarray | None, *, recompute: bool, tp: int, attention_ratio: np.ndarray | None = None,
    mask_bytes: np.ndarray | None = None,
) -> StageCosts:
    """Every stage's cost for every queried (size, length[, target length]); one cost-model call per layer kind and
    question (device time, host time, memory). Models without host times (the analytic one, version-1 profiles)
    give the device's sums exactly.

    Packed rows (``dynamic/packed.py``): ``attention_ratio`` scales the causal attention of GPT blocks (the
    attention blocks the packed rows' mask computes over those of causal attention on the same rows), and
    ``mask_bytes`` (the dense document mask, built once per micro-batch and stage) adds to every stage's transient
    memory."""
    shape = np.broadcast_shapes(np.shape(microbatch_size), np.shape(seq_len),
                                np.shape(target_len) if target_len is not None else ())
    per_kind: dict[str, tuple[np.ndarray, ...]] = {}
    for kind in sorted({k for layers in stages for k in layers}):
        kw = dict(target_len=target_len, recompute=recompute, tp=tp)
        fwd, bwd = cost_model.layer_time(kind, microbatch_size, seq_len, **kw)
        if attention_ratio is not None and kind == "block":
            attn_fwd, attn_bwd = causal_attention_seconds(cost_model, kind, microbatch_size, seq_len,
                                                          recompute=recompute, tp=tp)
            extra = np.asarray(attention_ratio, dtype=np.float64) - 1.0
            fwd, bwd = np.asarray(fwd) + extra * attn_fwd, np.asarray(bwd) + extra * attn_bwd
        stored, peak = cost_model.layer_memory(kind, microbatch_size, seq_len, **kw)
        host_fwd, host_bwd = layer_host_time(cost_model, kind, microbatch_size, seq_len, **kw)
        per_kind[kind] = tuple(np.broadcast_to(np.asarray(a, dtype=np.float64), shape)
                               for a in (fwd, bwd, stored, peak, host_fwd, host_bwd))
    # forward, backward, stored, transient, host forward, host backward
    out = [np.zeros((len(stages), *shape)) for _ in range(6)]
    for s, layers in enumerate(stages):
        counts = Counter(layers)
        for kind, n in counts.items():
            fwd, bwd, stored, peak, host_fwd, host_bwd = per_kind[kind]
            out[0][s] += n * fwd
            out[1][s] += n * bwd
            out[2][s] += n * stored
            out[3][s] = np.maximum(out[3][s], peak)
            out[4][s] += n * host_fwd
            out[5][s] += n * host_bwd
    if mask_bytes is not None:
        out[3] = out[3] + np.asarray(mask_bytes, dtype=np.float64)
    forward, backward = stage_pass_seconds(out[0], out[1], out[4], out[5], microbatch_overhead(cost_model))
    return StageCosts(forward, backward, out[2], out[3])


def causal_attention_seconds(cost_model: CostModel, kind: LayerKind, microbatch_size: np.ndarray, seq_len: np.ndarray,
                             *, recompute: bool, tp: int) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) device seconds of the causal attention of a micro-batch of b rows of length s in a layer
    of ``kind``, read off the cost model itself: a layer costs work linear in its tokens plus attention quadratic in
    the length, so b rows of s and 2b rows of s / 2 hold the same tokens and differ only in attention, by half of
    it: attention(b, s) = 2 (f(b, s) - f(2b, s / 2)). Exact for the analytic model where both shapes run above its
    launch floor; where the micro-batch is floor-bound the difference vanishes, as the attention's effect on its
    time does. For a measured profile it reads the attention the profile measured (causal flash on right-padded
    rows); where 2b is outside the profile's grid, b / 2 rows are asked and the answer doubled; zero where neither
    shape is in the grid, clipped at zero."""
    b = np.asarray(microbatch_size, dtype=np.float64)
    s = np.asarray(seq_len, dtype=np.float64)
    b, s = np.broadcast_arrays(b, s)
    out = _attention_difference(cost_model, kind, b, s, recompute, tp)
    half = np.maximum(b // 2, 1.0)
    fallback = _attention_difference(cost_model, kind, half, s, recompute, tp)
    return tuple(np.where(np.isfinite(x), x, np.where(np.isfinite(y), y * b / half, 0.0)).clip(min=0.0)
                 for x, y in zip(out, fallback))


def _attention_difference(cost_model: CostModel, kind: LayerKind, b: np.ndarray, s: np.ndarray, recompute: bool,
                          tp: int) -> tuple[np.ndarray, np.ndarray]:
    one = cost_model.layer_time(kind, b, s, recompute=recompute, tp=tp)
    two = cost_model.layer_time(kind, 2 * b, s / 2, recompute=recompute, tp=tp)
    with np.errstate(invalid="ignore"):  # inf - inf outside a profile's grid: nan, treated as missing
        return tuple(2.0 * (np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64)) for x, y in zip(one, two))
