"""``plan_packed_step``: a dynamic partition whose micro-batches are packed rows with document masks.

The global batch is packed first-fit-decreasing into rows of ``max_seq_len`` tokens (T5: and ``max_target_len``
target tokens); the rows, not the samples, are spread over the replicas (balanced by each row's time), and each
replica's rows are partitioned and ordered for the pipeline by ``plan_step``'s machinery (``search_plan``) under the
same cost model and memory budget. A range of
rows is one micro-batch of (rows, L[, T]) with L its fullest row's tokens rounded up (to ``FLEX_BLOCK`` under
FlexAttention, so that the block mask's shapes stay few; to ``round_to`` otherwise), or with
``packed_row_length="full"`` the row length itself (every row one shape: what a compiled model runs at the speed its
compiled grids measured, where each new length is a shape its kernels meet for the first time and, once torch marks
the length dynamic, run as kernels for any length; docs/dynamic.md, "Compiled models"), costed as what it runs
(``packed.py``): its linear parts as a padded micro-batch of that shape, its attention as the blocks its document
mask computes. So the number of rows per micro-batch is chosen by the pipeline's cost and memory model instead of
being a fixed ``micro_batch_size``: few large micro-batches where per-micro-batch costs dominate (pp = 1), more and
smaller ones where the pipeline's fill and drain do (pp > 1), none larger than the memory budget allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_3d.costs.model import CostModel, ModelShape
from lightning_3d.dynamic.adaptive import check_adaptive
from lightning_3d.dynamic.packed import FLEX_BLOCK, attention_ratio, causal_blocks, dense_mask_bytes, document_blocks, first_fit_decreasing
from lightning_3d.dynamic.partition import karmarkar_karp, range_shapes, round_up, sample_order
from lightning_3d.dynamic.plan import (
    MicroBatchPlan,
    PlanContext,
    ReplicaPlan,
    StepPlan,
    check_layout,
    check_sample_lengths,
    default_cost_model,
    search_plan,
)
from lightning_3d.dynamic.stage_costs import StageCosts, evaluate, stage_layers
from lightning_3d.pipeline.schedules import schedule_spec


def pack_global_batch(inputs: np.ndarray, targets: np.ndarray | None, max_seq_len: int, max_target_len: int | None,
                      at_least: int) -> list[list[int]]:
    """First-fit-decreasing rows of the samples, then the row of most samples halved until there are ``at_least``
    rows (every replica needs one; the caller guarantees as many samples)."""
    lengths = [(int(s), int(t)) for s, t in zip(inputs, targets if targets is not None else np.zeros_like(inputs))]
    rows = first_fit_decreasing(lengths, (max_seq_len, max_target_len or 0))
    while len(rows) < at_least:
        k = max(range(len(rows)), key=lambda j: (len(rows[j]), -j))
        half = len(rows[k]) // 2
        rows[k : k + 1] = [rows[k][:half], rows[k][half:]]
    return rows


def plan_packed_step(
    input_lengths: Sequence[int], *, target_lengths: Sequence[int] | None = None, cost_model: CostModel | None = None,
    shape: ModelShape, dp: int, pp: int, virtual_stages: int = 1, schedule: str = "1f1b", memory_budget: float,
    round_to: int = 8, max_seq_len: int | None = None, max_target_len: int | None = None, tp: int = 1, seed: int = 0,
    layer_split: Sequence[int] | None = None, packed_attention: str = "dense", adaptive_schedule: str = "auto",
    packed_row_length: str = "fill",
) -> StepPlan:
    """Plan one global batch as micro-batches of packed rows (module docstring): the rows are spread over the
    replicas first (Karmarkar–Karp on each row's time), then each replica's rows are partitioned and ordered
    (``search_plan`` with dp = 1). The arguments are ``plan_step``'s,
    plus ``packed_attention`` (GPT: ``"flex"`` or ``"dense"``, what the model runs for packed rows on its device;
    T5's packed rows always attend with dense masks). ``max_seq_len`` (and for T5 ``max_target_len``) is the row
    length. ``packed_row_length``: ``"fill"`` (a micro-batch's rows as long as its fullest, rounded up) or ``"full"``
    (every row ``max_seq_len``; module docstring). Every ``MicroBatchPlan`` carries its ``rows``."""
    if max_seq_len is None or (target_lengths is not None and max_target_len is None):
        raise ValueError("Packed rows need their length: pass max_seq_len (and max_target_len with target_lengths),"
                         " the model's positions.")
    if packed_attention not in ("flex", "dense"):
        raise ValueError(f"packed_attention={packed_attention!r}: use 'flex' (FlexAttention's block mask) or 'dense'"
                         " (SDPA's dense document mask), what the model runs for packed rows.")
    check_packed_row_length(packed_row_length)
    inputs, targets = check_sample_lengths(input_lengths, target_lengths, max_seq_len, max_target_len)
    check_layout(len(inputs), dp, pp, virtual_stages, schedule, memory_budget, round_to)
    check_adaptive(adaptive_schedule, schedule)
    cost_model = cost_model if cost_model is not None else default_cost_model(shape)
    stages = stage_layers(shape, pp * virtual_stages, layer_split)
    # Every replica needs a micro-batch, and interleaved schedules a multiple of pp of them: as many rows at least.
    per_replica = pp if schedule_spec(schedule).microbatch_multiple_of_pp else 1
    rows = pack_global_batch(inputs, targets, max_seq_len, max_target_len, min(dp * per_replica, len(inputs)))
    gpt = shape.family == "gpt"
    step = FLEX_BLOCK if gpt and packed_attention == "flex" else round_to
    fill_in = round_up(np.array([inputs[r].sum() for r in rows], dtype=np.int64), step, max_seq_len)
    fill_tg = (round_up(np.array([targets[r].sum() for r in rows], dtype=np.int64), round_to, max_target_len)
               if targets is not None else None)
    if packed_row_length == "full":
        fill_in = np.full(len(rows), max_seq_len, dtype=np.int64)
        fill_tg = np.full(len(rows), max_target_len, dtype=np.int64) if targets is not None else None
    docs = [[int(inputs[i]) for i in row] for row in rows] if gpt else None
    costs = _Costs(cost_model, stages, tp, packed_attention if gpt else None)
    replicas, plans = [], []
    for r, mine in enumerate(_spread(rows, fill_in, fill_tg, docs, costs, dp)):
        units = PlanUnits(np.array(mine), fill_in[mine], fill_tg[mine] if fill_tg is not None else None,
                          [docs[i] for i in mine] if docs is not None else None)
        try:
            plan = _plan_replica(units, costs, pp, virtual_stages, schedule, memory_budget, seed + r, adaptive_schedule)
        except ValueError as err:
            raise ValueError(f"Packed rows of {max_seq_len} tokens: {str(err).replace('sample ', 'packed row ', 1)}"
                             ) from err
        replicas.append(_with_rows(plan.replicas[0], rows))
        plans.append(plan)
    return StepPlan(tuple(replicas), max(p.makespan for p in plans),
                    max(p.peak_memory for p in plans), max(p.estimate for p in plans), any(p.recompute for p in plans),
                    plans[0].cost_source)


PACKED_ROW_LENGTHS = ("fill", "full")


def check_packed_row_length(value: object) -> str:
    """``packed_row_length`` if it is one of :data:`PACKED_ROW_LENGTHS`; ValueError naming it and the choices."""
    if value not in PACKED_ROW_LENGTHS:
        raise ValueError(f"packed_row_length={value!r}: use 'fill' (rows as long as a micro-batch's fullest, rounded"
                         " up) or 'full' (every row the model's sequence length: one shape, for compiled models).")
    return str(value)


@dataclass(frozen=True)
class PlanUnits:
    """One replica's packed rows: their indices into the step's rows, padded lengths and (GPT) document lengths."""

    rows: np.ndarray
    seq: np.ndarray
    target: np.ndarray | None
    docs: list[list[int]] | None


@dataclass(frozen=True)
class _Costs:
    cost_model: CostModel
    stages: list
    tp: int
    attention: str | None  # GPT's packed attention; None for T5 (dense masks, costed as padded)

    def of(self, size: np.ndarray, seq: np.ndarray, target: np.ndarray | None, ratio: np.ndarray | None,
           recompute: bool) -> StageCosts:
        mask = dense_mask_bytes(size, seq) if self.attention == "dense" else None
        return evaluate(self.cost_model, self.stages, size, seq, target, recompute=recompute, tp=self.tp,
                        attention_ratio=ratio, mask_bytes=mask)


def _spread(rows: list[list[int]], seq: np.ndarray, target: np.ndarray | None, docs: list[list[int]] | None,
            costs: _Costs, dp: int) -> list[list[int]]:
    """The rows spread over the replicas by Karmarkar–Karp on each row's own time (every replica gets one: there are
    at least ``dp`` rows), each replica's rows in ascending index. Balancing rows before partitioning keeps the
    replicas even: a partition of the whole step into few large micro-batches cannot be spread evenly."""
    ones = np.ones(len(rows))
    ratio = (np.array([attention_ratio([d], int(s), costs.attention) for d, s in zip(docs, seq)])
             if costs.attention is not None else None)
    single = costs.of(ones, seq, target, ratio, recompute=False)
    time = (single.forward + single.backward).sum(axis=0)
    groups = [sorted(g) for g in karmarkar_karp([float(t) for t in time], dp)]
    for g in groups:  # Karmarkar–Karp may leave a group empty on pathological costs: give it the largest's last row
        if not g:
            donor = max(groups, key=len)
            g.append(donor.pop())
    return [sorted(g) for g in groups]


def _plan_replica(units: PlanUnits, costs: _Costs, pp: int, v: int, schedule: str, budget: float,
                  seed: int, adaptive: str) -> StepPlan:
    """``search_plan`` over one replica's rows (dp = 1): every contiguous range of its rows, ordered by padded
    length, is a candidate micro-batch, costed as packed rows."""
    order = sample_order(units.seq, units.target)
    rin, rtg = units.seq[order], units.target[order] if units.target is not None else None
    n = len(order)
    starts, last = np.triu_indices(n)
    stops = last + 1
    size, seq, tgt = range_shapes(rin, rtg)
    shapes = (size[starts, stops], seq[starts, stops], tgt[starts, stops] if tgt is not None else None)
    ctx = PlanContext(units.rows[order], rin, rtg, starts, stops, shapes, np.arange(len(starts)), pp, v, 1, schedule,
                      budget, seed, adaptive=adaptive)
    ratio = None
    if costs.attention is not None:
        ratio = _range_attention_ratio([units.docs[i] for i in order], starts, stops, shapes[1], costs.attention)
    return search_plan(ctx, lambda recompute: costs.of(*shapes, ratio, recompute), costs.cost_model)


def _range_attention_ratio(docs: list[list[int]], starts: np.ndarray, stops: np.ndarray, seq: np.ndarray,
                           attention: str) -> np.ndarray:
    """Per range of the ordered rows: blocks its rows' masks compute at the range's padded length, over causal
    attention's blocks on as many rows. Prefix sums per distinct length (a row's blocks depend on the length only
    through its padding tail)."""
    lengths = np.unique(seq)
    blocks = np.zeros((len(lengths), len(docs) + 1))
    for k, length in enumerate(lengths):
        per_row = [document_blocks(d, int(length), attention) if sum(d) <= length else 0 for d in docs]
        blocks[k, 1:] = np.cumsum(per_row)
    k = np.searchsorted(lengths, seq)
    causal = np.array([causal_blocks(int(x)) for x in lengths])[k]
    return (blocks[k, stops] - blocks[k, starts]) / ((stops - starts) * causal)


def _with_rows(replica: ReplicaPlan, rows: list[list[int]]) -> ReplicaPlan:
    """A replica's micro-batches of row indices as micro-batches of samples with their rows."""
    mbs = tuple(MicroBatchPlan(tuple(i for r in mb.samples for i in rows[r]), mb.seq_len, mb.target_len,
                               mb.recompute, tuple(tuple(rows[r]) for r in mb.samples))
                for mb in replica.microbatches)
    return ReplicaPlan(mbs, replica.orders, replica.makespan, replica.peak_memory, replica.schedule)
