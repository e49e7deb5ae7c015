"""Ordering one replica's micro-batches: which of them runs first in the pipeline schedule, chosen by simulating
the step (``lightning_3d.pipeline.timing``) with each micro-batch's per-stage times and memory.

With micro-batches of different sizes the order matters: the pipeline fills with the first ones and drains with the
last ones, and a rank holds the activations of its in-flight micro-batches at once. The search tries a few orders
(as planned, reversed, by time both ways, largest in the middle, seeded shuffles) and improves the best by
swapping neighbours, under the named schedule and, where memory is tight, 1F1B with fewer warm-up forwards; and,
unless ``adaptive="off"``, under the adaptive schedule built for each order (``adaptive.py``). Every candidate is
simulated; the fastest one within the memory budget wins, ties going to the named schedule (docs/dynamic.md).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from lightning_3d.dynamic.adaptive import adaptive_orders, check_adaptive, supports_adaptive
from lightning_3d.dynamic.stage_costs import StageCosts
from lightning_3d.pipeline.schedules import Action, build_schedule, check_schedule, deferred_weights, mark_epilogue
from lightning_3d.pipeline.timing import Timeline, simulate

# Replicas of at most EXHAUSTIVE micro-batches try every order (5! = 120 simulations); up to MAX_SWAP_SEARCH, the
# best candidate is improved by swapping pairs (neighbours only above MAX_PAIR_SEARCH); each try is one simulation.
EXHAUSTIVE, MAX_PAIR_SEARCH, MAX_SWAP_SEARCH = 5, 8, 16


@dataclass(frozen=True)
class Ordered:
    """The chosen order: ``perm[j]`` is the micro-batch (column of the costs) that runs as micro-batch j;
    ``schedule`` names what ``orders`` are: the named schedule, ``"1f1b-warmup<w>"`` (1F1B with at most w warm-up
    forwards) or ``"adaptive"``."""

    perm: tuple[int, ...]
    orders: tuple[tuple[Action, ...], ...]
    timeline: Timeline
    schedule: str = ""

    @property
    def peak(self) -> float:
        return max(self.timeline.peak_memory)


@lru_cache(maxsize=512)
def in_flight(schedule: str, pp: int, virtual_stages: int, m: int) -> tuple[int, ...]:
    """The most (stage, micro-batch) forwards each rank holds at once under ``schedule`` with ``m`` micro-batches."""
    out = []
    for rank in range(pp):
        held = peak = 0
        order = build_schedule(schedule, pp, virtual_stages, m, rank)
        split = deferred_weights(order)  # a split backward's activations are held until its W
        for a in order:
            held += 1 if a.kind == "F" else -1 if a.kind == "W" or (a.stage, a.microbatch) not in split else 0
            peak = max(peak, held)
        out.append(peak)
    return tuple(out)


@lru_cache(maxsize=512)
def limited_1f1b(pp: int, m: int, warmup: int) -> tuple[tuple[Action, ...], ...]:
    """1F1B with at most ``warmup`` warm-up forwards on any rank (fewer micro-batches in flight, more bubble).

    Rank r warms up with min(pp - r - 1, warmup) forwards; these counts do not increase along the pipeline, so
    every backward's gradient arrives from a rank that has run enough forwards (check_schedule verifies it)."""
    orders = []
    for rank in range(pp):
        w = min(pp - rank - 1, warmup, m)
        order = [Action("F", rank, i) for i in range(w)]
        for i in range(m - w):
            order += [Action("F", rank, w + i), Action("B", rank, i)]
        order += [Action("B", rank, i) for i in range(m - w, m)]
        orders.append(mark_epilogue(order))
    orders = tuple(orders)
    check_schedule(list(orders), pp, m, train=True)
    return orders


def order_microbatches(
    costs: StageCosts, pp: int, virtual_stages: int, schedule: str, memory_budget: float, seed: int, shuffles: int = 4,
    adaptive: str = "auto",
) -> Ordered:
    """The fastest simulated order within ``memory_budget`` (or, if none fits, the one of least peak memory: the
    caller then plans smaller micro-batches). ``costs`` holds one column per micro-batch. ``adaptive``: "auto" also
    searches orders under the adaptive schedule (``adaptive.py``) and keeps it where it simulates faster, "only"
    searches nothing else (at pp > 1), "off" leaves it out."""
    check_adaptive(adaptive, schedule)
    m = costs.forward.shape[1]
    times = (costs.forward + costs.backward).sum(axis=0)
    ascending = [int(i) for i in np.argsort(times, kind="stable")]
    middle = ascending[0::2] + ascending[1::2][::-1]  # small at both ends, largest in the middle
    candidates = [list(range(m)), list(range(m))[::-1], ascending, ascending[::-1], middle]
    rng = np.random.default_rng(seed)
    # Shuffles only for steps of few micro-batches: with many, only the first and last pp - 1 shape the fill and
    # drain, and the sorted candidates already place them (each candidate costs one simulation).
    candidates += [[int(i) for i in rng.permutation(m)] for _ in range(shuffles if 2 < m <= MAX_SWAP_SEARCH and pp > 1 else 0)]
    heuristic = candidates
    if pp > 1 and m <= EXHAUSTIVE:
        candidates = [list(p) for p in itertools.permutations(range(m))]
    if pp == 1:  # one rank runs them back to back, one in flight: every order takes as long and as much memory
        candidates = candidates[:1]
    use_adaptive = pp > 1 and adaptive != "off" and supports_adaptive(schedule)
    schedules: list[tuple[str, tuple]] = []
    if not (use_adaptive and adaptive == "only"):
        schedules.append((schedule, tuple(build_schedule(schedule, pp, virtual_stages, m, r) for r in range(pp))))
        check_schedule(list(schedules[0][1]), pp * virtual_stages, m, train=True)
        if virtual_stages == 1 and pp > 1:
            schedules += [(f"1f1b-warmup{w}", limited_1f1b(pp, m, w)) for w in range(pp - 2, -1, -1)]

    def run(perm: list[int], name: str, orders: tuple | None = None) -> Ordered:
        f, b = costs.forward[:, perm], costs.backward[:, perm]
        stored, transient = costs.stored[:, perm], costs.transient[:, perm]
        if orders is None:  # the adaptive schedule is built for this order's costs
            orders = adaptive_orders(f, b, stored, transient, pp, memory_budget)
        timeline = simulate(
            orders, pp * virtual_stages, lambda a: (f if a.kind == "F" else b)[a.stage, a.microbatch],
            stored=lambda a: stored[a.stage, a.microbatch], transient=lambda a: transient[a.stage, a.microbatch],
            check=False,
        )
        return Ordered(tuple(perm), orders, timeline, name)

    def better(x: Ordered, y: Ordered | None) -> bool:
        if y is None:
            return True
        x_fits, y_fits = x.peak <= memory_budget, y.peak <= memory_budget
        if x_fits != y_fits:
            return x_fits
        return x.timeline.makespan < y.timeline.makespan if x_fits else x.peak < y.peak

    def improve(best: Ordered, swaps: bool) -> Ordered:
        """Pair swaps from ``best`` while one helps (neighbours only above MAX_PAIR_SEARCH)."""
        if not swaps:
            return best
        pairs = [(j, k) for j in range(m) for k in range(j + 1, m) if m <= MAX_PAIR_SEARCH or k == j + 1]
        improved = True
        while improved:
            improved = False
            for j, k in pairs:
                perm = list(best.perm)
                perm[j], perm[k] = perm[k], perm[j]
                result = run(perm, best.schedule, None if best.schedule == "adaptive" else best.orders)
                if better(result, best):
                    best, improved = result, True
        return best

    best: Ordered | None = None
    for name, orders in schedules:
        for perm in candidates:
            result = run(perm, name, orders)
            if better(result, best):
                best = result
        if best.peak <= memory_budget:
            break  # a schedule with more warm-up forwards fits: fewer would only add bubble
    if best is not None:
        best = improve(best, pp > 1 and EXHAUSTIVE < m <= MAX_SWAP_SEARCH)
    if use_adaptive:
        # Searched on its own and compared last, so that it never makes the named schedule's result worse and a
        # tie keeps the named schedule. The adaptive lists adapt to the order themselves, so the heuristic orders
        # (and the named schedule's best one) with pair swaps replace the exhaustive search. They honour the budget
        # by construction (except for a micro-batch over it alone), so they also compete where no fixed schedule fits.
        own: Ordered | None = None
        for perm in heuristic + ([list(best.perm)] if best is not None else []):
            result = run(perm, "adaptive")
            if better(result, own):
                own = result
        own = improve(own, 2 < m <= MAX_SWAP_SEARCH)
        if better(own, best):
            best = own
    return best
