"""``plan_step``: from one global batch's sample lengths to every replica's micro-batches and schedule.

Steps (docs/dynamic.md): check the lengths; round them up; order the samples; cost every contiguous range of the
order on every pipeline stage (one vectorised cost-model call per layer kind); cut the order by the dynamic program
of ``partition``; spread the micro-batches over the replicas (Karmarkar–Karp); order each replica's micro-batches by
simulation (``ordering``). The simulated peak memory of every rank must stay within ``memory_budget``: if the
per-micro-batch limit the dynamic program used was too loose, it is tightened and the step planned again, and if
no partition fits at all, activation recomputation is switched on for the step.

The plan is a pure function of its arguments (NumPy, no hashing of Python objects, seeded shuffles), so every rank
that plans the same batch gets the same plan without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_3d.costs.analytic import AnalyticCostModel
from lightning_3d.costs.model import CostModel, ModelShape
from lightning_3d.dynamic.adaptive import check_adaptive
from lightning_3d.dynamic.ordering import in_flight, order_microbatches
from lightning_3d.dynamic.partition import NoPartition, best_partition, karmarkar_karp, range_shapes, round_up, sample_order
from lightning_3d.dynamic.stage_costs import StageCosts, evaluate, stage_layers
from lightning_3d.pipeline.schedules import Action, schedule_spec

# How often the per-micro-batch memory limit is tightened (by TIGHTEN each time) when a simulated schedule exceeds
# the budget, before recomputation is tried.
RETRIES, TIGHTEN = 6, 0.8


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch: indices into the step's samples, padded to ``seq_len`` (and ``target_len`` for T5).
    ``rows``: for a micro-batch of packed rows (``packed_plan.py``), the samples of each row, in row order (rows of
    ``seq_len`` tokens, documents masked from each other); None for one padded sample per row."""

    samples: tuple[int, ...]
    seq_len: int
    target_len: int | None
    recompute: bool
    rows: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class ReplicaPlan:
    """One data-parallel replica's micro-batches in running order, and the schedule (one action tuple per pipeline
    rank) to pass as ``MicroBatches(..., orders=orders)``. ``makespan`` (seconds) and ``peak_memory`` (bytes per
    pipeline rank) are the simulator's predictions under the cost model; ``schedule`` names what ``orders`` are (the
    named schedule, ``"1f1b-warmup<w>"`` or ``"adaptive"``: ``ordering.Ordered``)."""

    microbatches: tuple[MicroBatchPlan, ...]
    orders: tuple[tuple[Action, ...], ...]
    makespan: float
    peak_memory: tuple[float, ...]
    schedule: str = ""


@dataclass(frozen=True)
class StepPlan:
    """Every replica's plan. ``makespan``: the slowest replica's; ``peak_memory``: the largest of any rank;
    ``estimate``: the partition's objective ((pp - 1)·max t / v + Σ t / dp); ``cost_source``: the cost model's."""

    replicas: tuple[ReplicaPlan, ...]
    makespan: float
    peak_memory: float
    estimate: float
    recompute: bool
    cost_source: str


def default_cost_model(shape: ModelShape) -> CostModel:
    """The analytic cost model (FLOPs and bytes), for plans without a measured profile."""
    return AnalyticCostModel(shape, None)


def plan_step(
    input_lengths: Sequence[int], *, target_lengths: Sequence[int] | None = None, cost_model: CostModel | None = None,
    shape: ModelShape, dp: int, pp: int, virtual_stages: int = 1, schedule: str = "1f1b", memory_budget: float,
    round_to: int = 8, max_seq_len: int | None = None, max_target_len: int | None = None, tp: int = 1, seed: int = 0,
    layer_split: Sequence[int] | None = None, adaptive_schedule: str = "auto",
) -> StepPlan:
    """Plan one global batch (see the module docstring). ``memory_budget``: activation bytes per GPU.
    ``max_seq_len`` / ``max_target_len``: the model's limits (a longer sample is an error; padded lengths never
    exceed them). ``layer_split``: blocks per stage if the strategy's ``pipeline_layer_split`` overrides the even
    split. ``adaptive_schedule``: whether the order search also tries the adaptive schedule ("auto", "off" or
    "only": ``adaptive.ADAPTIVE_CHOICES``). Raises ``ValueError`` naming the bad value and the fix for inputs no plan
    can serve."""
    inputs, targets = check_sample_lengths(input_lengths, target_lengths, max_seq_len, max_target_len)
    check_layout(len(inputs), dp, pp, virtual_stages, schedule, memory_budget, round_to)
    check_adaptive(adaptive_schedule, schedule)
    cost_model = cost_model if cost_model is not None else default_cost_model(shape)
    stages = stage_layers(shape, pp * virtual_stages, layer_split)
    order = sample_order(round_up(inputs, round_to, max_seq_len),
                         round_up(targets, round_to, max_target_len) if targets is not None else None)
    rin = round_up(inputs[order], round_to, max_seq_len)
    rtg = round_up(targets[order], round_to, max_target_len) if targets is not None else None
    ctx = PlanContext(order, rin, rtg, *_grid(rin, rtg), pp, virtual_stages, dp, schedule, memory_budget, seed,
                      adaptive=adaptive_schedule)
    return search_plan(ctx, lambda recompute: evaluate(cost_model, stages, *ctx.shapes, recompute=recompute, tp=tp),
                       cost_model)


def check_sample_lengths(input_lengths: Sequence[int], target_lengths: Sequence[int] | None, max_seq_len: int | None,
                         max_target_len: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The lengths as int64 arrays; ValueError naming the sample and the fix for an empty or too long one."""
    inputs = _lengths(input_lengths, "input", max_seq_len, "max_seq_len")
    targets = None
    if target_lengths is not None:
        targets = _lengths(target_lengths, "target", max_target_len, "max_target_len")
        if len(targets) != len(inputs):
            raise ValueError(f"target_lengths has {len(targets)} entries but input_lengths has {len(inputs)}; give one"
                             " target length per sample.")
    return inputs, targets


def search_plan(ctx: PlanContext, costs_for, cost_model: CostModel) -> StepPlan:
    """The partition, replica spread and order search of ``ctx``'s units (samples, or packed rows) under the memory
    budget: the per-unit limit tightened while the simulated schedule exceeds the budget, then fewer micro-batches
    in flight, then recomputation (``costs_for(recompute)`` gives the per-range ``StageCosts``), then an error."""
    levels = _held_levels(ctx.schedule, ctx.pp, ctx.v, _count_for(ctx.schedule, ctx.pp, len(ctx.rin)))
    memory_budget = ctx.budget
    for recompute in (False, True):
        ctx.costs = costs_for(recompute)
        for held in levels:
            limit = memory_budget
            for _ in range(RETRIES):
                try:
                    plan = _plan_once(ctx, limit, held, recompute)
                except NoPartition:
                    break
                if plan.peak_memory <= memory_budget:
                    return StepPlan(plan.replicas, plan.makespan, plan.peak_memory, plan.estimate, recompute,
                                    str(getattr(cost_model, "source", type(cost_model).__name__)))
                limit *= TIGHTEN
    raise _budget_error(ctx, levels[-1])


def _grid(rin: np.ndarray, rtg: np.ndarray | None) -> tuple:
    """Every contiguous range [start, stop) of the ordered samples (as two arrays), the distinct micro-batch shapes
    the cost model is asked about (size, length[, target length]) and each range's index into them.

    Without targets the order is ascending, so a range's shape is (its size, its last sample's length): the shapes
    are the grid of sizes 1..n by distinct lengths, n x (distinct lengths) of them instead of n^2 / 2. With targets
    every range is its own shape (padded lengths from running maxima)."""
    n = len(rin)
    starts, last = np.triu_indices(n)
    stops = last + 1
    if rtg is None:
        lengths = np.unique(rin)
        index = np.searchsorted(lengths, rin[last]) * n + (stops - starts - 1)
        return starts, stops, (np.tile(np.arange(1, n + 1), len(lengths)), np.repeat(lengths, n), None), index
    size, seq, tgt = range_shapes(rin, rtg)
    return starts, stops, (size[starts, stops], seq[starts, stops], tgt[starts, stops]), np.arange(len(starts))


def _held_levels(schedule: str, pp: int, v: int, m: int) -> list[np.ndarray]:
    """Micro-batches in flight per rank that the memory bound assumes, from the named schedule's down to 1F1B with
    fewer warm-up forwards (``ordering.limited_1f1b``, which the order search falls back to when memory is tight)."""
    levels = [np.array(in_flight(schedule, pp, v, m), dtype=np.float64)]
    if v == 1:
        for warmup in range(pp - 2, -1, -1):
            levels.append(np.array([min(pp - r - 1, warmup) + 1 for r in range(pp)], dtype=np.float64))
    return levels


@dataclass
class PlanContext:
    """What the partition and the order search work on: the units (samples, or packed rows) in their order, every
    contiguous range of that order with its shape, the layout and (set by ``search_plan``) the per-range costs."""

    order: np.ndarray  # position in the order -> sample index
    rin: np.ndarray  # rounded lengths in that order
    rtg: np.ndarray | None
    starts: np.ndarray  # every range [start, stop) of the order
    stops: np.ndarray
    shapes: tuple  # the distinct shapes the cost model is asked about
    index: np.ndarray  # range -> shape
    pp: int
    v: int
    dp: int
    schedule: str
    budget: float
    seed: int
    costs: StageCosts | None = None  # per stage and shape
    adaptive: str = "auto"  # ``order_microbatches``'s ``adaptive``

    def shape_of(self, a: int, b: int) -> int:
        """The shape index of range [a, b)."""
        n = len(self.rin)
        # np.triu_indices(n) lists ranges by start, then stop: those of start a begin after sum(n - i for i < a).
        return int(self.index[a * n - a * (a - 1) // 2 + (b - a - 1)])


def _rank_view(costs: StageCosts, pp: int, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pipeline rank (summing its v stages): time, largest stored bytes of one stage, largest transient."""
    shape = (v, pp, *costs.forward.shape[1:])
    time = (costs.forward + costs.backward).reshape(shape).sum(axis=0)
    return time, costs.stored.reshape(shape).max(axis=0), costs.transient.reshape(shape).max(axis=0)


def _plan_once(ctx: PlanContext, limit: float, held: np.ndarray, recompute: bool) -> StepPlan:
    n = len(ctx.rin)
    rank_time, stored, transient = _rank_view(ctx.costs, ctx.pp, ctx.v)
    # A micro-batch fits if ``held`` (per rank) stages like its largest, plus its largest working set, fit every
    # rank; the simulation of the final order checks the real mix.
    fits = np.all(held[:, None] * stored + transient <= limit, axis=0)
    per_shape = np.where(fits, rank_time.max(axis=0), np.inf)
    time = np.full((n, n + 1), np.inf)
    time[ctx.starts, ctx.stops] = per_shape[ctx.index]
    cuts, estimate = best_partition(time, ctx.pp, ctx.v, ctx.dp, candidates=per_shape)
    ranges = list(zip(cuts[:-1], cuts[1:]))
    ranges = _split_until(ranges, ctx.dp, time)
    groups = karmarkar_karp([time[a, b] for a, b in ranges], ctx.dp)
    replicas = []
    for r, group in enumerate(groups):
        mine = [ranges[i] for i in sorted(group)]
        if schedule_spec(ctx.schedule).microbatch_multiple_of_pp:
            mine = _split_to_multiple(mine, ctx.pp, time, ctx.schedule)
        cols = np.array([ctx.shape_of(a, b) for a, b in mine])
        chosen = order_microbatches(ctx.costs.take(cols), ctx.pp, ctx.v, ctx.schedule, ctx.budget, ctx.seed + r,
                                    adaptive=ctx.adaptive)
        mbs = tuple(
            MicroBatchPlan(tuple(sorted(int(i) for i in ctx.order[a:b])), int(ctx.rin[a:b].max()),
                           int(ctx.rtg[a:b].max()) if ctx.rtg is not None else None, recompute)
            for a, b in (mine[j] for j in chosen.perm)
        )
        replicas.append(ReplicaPlan(mbs, chosen.orders, chosen.timeline.makespan, chosen.timeline.peak_memory,
                                    chosen.schedule))
    return StepPlan(tuple(replicas), max(p.makespan for p in replicas), max(max(p.peak_memory) for p in replicas),
                    estimate, recompute, "")


def _count_for(schedule: str, pp: int, n: int) -> int:
    """A micro-batch count the named schedule accepts, at least every sample on its own (the in-flight bound)."""
    m = max(n, 1)
    return -(-m // pp) * pp if schedule_spec(schedule).microbatch_multiple_of_pp else m


def _split_until(ranges: list[tuple[int, int]], count: int, time: np.ndarray) -> list[tuple[int, int]]:
    """Halve the slowest splittable range until there are ``count`` (every replica needs one micro-batch); halves of
    a fitting range fit too (fewer, no longer samples)."""
    ranges = list(ranges)
    while len(ranges) < count:
        splittable = [k for k, (a, b) in enumerate(ranges) if b - a > 1]
        k = max(splittable, key=lambda k: (time[ranges[k]], -k))
        a, b = ranges[k]
        ranges[k : k + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return ranges


def _split_to_multiple(ranges: list[tuple[int, int]], pp: int, time: np.ndarray, schedule: str) -> list[tuple[int, int]]:
    """A multiple of ``pp`` micro-batches: halve the slowest ranges up to the next multiple or, when the replica has
    too few samples for that (e.g. an odd number of single-sample micro-batches, which equal lengths favour: they
    shorten the pipeline's fill), merge adjacent ranges down to the previous one."""
    target = -(-len(ranges) // pp) * pp
    if sum(b - a for a, b in ranges) < target:
        merged = _merge_until(sorted(ranges), len(ranges) // pp * pp, time) if len(ranges) >= pp else None
        if merged is not None:
            return merged
        raise ValueError(
            f"schedule={schedule!r} needs a multiple of pipeline_parallel_size={pp} micro-batches per replica, but a"
            f" replica holds only {sum(b - a for a, b in ranges)} samples: use a larger global batch, or"
            " schedule='1f1b'."
        )
    return sorted(_split_until(ranges, target, time))


def _merge_until(ranges: list[tuple[int, int]], count: int, time: np.ndarray) -> list[tuple[int, int]] | None:
    """Merge the adjacent pair of ranges (one contiguous range of the order) whose union is fastest, until ``count``
    remain; None if no adjacent pair fits (its time is infinite) before that."""
    while len(ranges) > count:
        pairs = [(time[a, d], k) for k, ((a, b), (c, d)) in enumerate(zip(ranges, ranges[1:])) if b == c]
        pairs = [(t, k) for t, k in pairs if np.isfinite(t)]
        if not pairs:
            return None
        _, k = min(pairs)
        ranges[k : k + 2] = [(ranges[k][0], ranges[k + 1][1])]
    return ranges


def _lengths(values: Sequence[int], what: str, limit: int | None, limit_name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or len(array) == 0:
        raise ValueError(f"{what}_lengths must be a non-empty list of per-sample lengths, got shape {array.shape}.")
    if not np.issubdtype(array.dtype, np.integer):
        if not np.all(np.mod(array, 1) == 0):
            raise ValueError(f"{what}_lengths must be whole token counts, got {array.tolist()[:8]}...")
        array = array.astype(np.int64)
    empty = np.flatnonzero(array <= 0)
    if len(empty):
        raise ValueError(
            f"Sample {int(empty[0])} of the batch has {what} length {int(array[empty[0]])}: every sample needs at"
            f" least one {what} token. Drop empty samples in the dataset (or its filter) before batching."
        )
    if limit is not None:
        long = np.flatnonzero(array > limit)
        if len(long):
            raise ValueError(
                f"Sample {int(long[0])} of the batch has {what} length {int(array[long[0]])} > {limit_name}={limit}:"
                f" truncate or split such samples in the dataset, or raise {limit_name} (the model's positions)."
            )
    return array.astype(np.int64)


def check_layout(n: int, dp: int, pp: int, v: int, schedule: str, budget: float, round_to: int) -> None:
    for name, value in (("dp", dp), ("pp", pp), ("virtual_stages", v), ("round_to", round_to)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    spec = schedule_spec(schedule)
    if spec.interleaved and (v < 2 or pp < 2):
        raise ValueError(f"schedule={schedule!r} needs virtual_stages >= 2 and pp >= 2, got {v} and {pp}.")
    if not spec.interleaved and v != 1:
        raise ValueError(f"virtual_stages={v} only applies to interleaved schedules, not {schedule!r}.")
    if not (isinstance(budget, (int, float, np.floating)) and budget > 0 and np.isfinite(budget)):
        raise ValueError(f"memory_budget must be a positive number of activation bytes per GPU, got {budget!r}.")
    if n < dp:
        raise ValueError(f"The global batch holds {n} samples but there are dp={dp} replicas, each needing at least"
                         f" one: use a global batch of at least {dp} samples.")


def _budget_error(ctx: PlanContext, held: np.ndarray) -> ValueError:
    """The budget no micro-batch fits: name the sample that needs the most, its need and the budget."""
    n = len(ctx.rin)
    singles = np.array([ctx.shape_of(i, i + 1) for i in range(n)])
    _, stored, transient = _rank_view(ctx.costs.take(singles), ctx.pp, ctx.v)
    need = (held[:, None] * stored + transient).max(axis=0)
    worst = int(np.argmax(need))
    length = f"length {int(ctx.rin[worst])}" + (f" (target {int(ctx.rtg[worst])})" if ctx.rtg is not None else "")
    return ValueError(
        f"memory_budget={ctx.budget:.4g} bytes fits no micro-batch plan: sample {int(ctx.order[worst])} ({length}) alone"
        f" needs {need[worst]:.4g} bytes of activations on a pipeline rank with up to {int(held.max())} micro-batches in"
        f" flight, even with recomputation. Raise memory_budget to at least {need[worst]:.4g}, lower max_seq_len"
        " (truncate long samples), or use more pipeline or tensor parallelism."
    )
