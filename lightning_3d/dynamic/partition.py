"""Cutting a step's samples into micro-batches: the sample order, the table of every contiguous range's cost, the
dynamic program that minimises DynaPipe's step-time estimate under a memory limit, and the balancing of the
micro-batches over data-parallel replicas (Karmarkar–Karp).

The estimate of a step, for micro-batches of per-device times t_1..t_m spread over ``dp`` replicas of a pipeline of
``pp`` ranks with ``v`` stages each, is ``(pp - 1) · max t / v + Σ t / dp``: the pipeline's fill and drain are paid
for the longest micro-batch, the rest runs back to back. For a fixed bound on max t, the best partition into
contiguous ranges of the sorted samples minimises Σ t, which a dynamic program over range ends finds; trying every
bound that some range attains gives the exact optimum over contiguous partitions (docs/dynamic.md).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

# Up to EXACT_BOUNDS distinct range times (every batch of <= 13 samples), every one is tried: exact. Above, COARSE
# bounds spread evenly (in rank) over them, then COARSE more between the best one's neighbours: a heuristic whose
# cost does not grow with the number of distinct times.
EXACT_BOUNDS, COARSE = 96, 24


def round_up(lengths: np.ndarray, multiple: int, cap: int | None = None) -> np.ndarray:
    """Lengths rounded up to a multiple (kernels prefer multiples of 8), never above ``cap`` (the model's positions)."""
    out = -(-np.asarray(lengths, dtype=np.int64) // multiple) * multiple
    return np.minimum(out, cap) if cap is not None else out


def sample_order(inputs: np.ndarray, targets: np.ndarray | None) -> np.ndarray:
    """A permutation of the samples in which neighbours have similar (rounded) lengths, so that contiguous ranges pad
    little. One length: ascending (ties by index). Two (T5's input and target): samples with the same rounded pair
    form a cluster; clusters are chained greedily from the smallest, each followed by its nearest (L1) unvisited one
    (DynaPipe solves a travelling-salesman tour over cluster centres; the greedy chain is its cheap cousin)."""
    index = np.arange(len(inputs))
    if targets is None:
        return np.lexsort((index, inputs))
    points, labels = np.unique(np.stack([inputs, targets], axis=1), axis=0, return_inverse=True)
    labels = labels.reshape(-1)
    visited = np.zeros(len(points), dtype=bool)
    current = int(np.argmin(points.sum(axis=1) * (len(points) + 1) + np.arange(len(points))))
    chain = []
    for _ in range(len(points)):
        chain.append(current)
        visited[current] = True
        if visited.all():
            break
        dist = np.abs(points - points[current]).sum(axis=1).astype(np.float64)
        dist[visited] = np.inf
        current = int(np.argmin(dist))  # ties: the lowest cluster (np.unique sorts them)
    rank = np.empty(len(points), dtype=np.int64)
    rank[chain] = np.arange(len(chain))
    return np.lexsort((index, rank[labels]))


@dataclass(frozen=True)
class Ranges:
    """Every contiguous range [start, stop) of the ordered samples: its padded shape, per-device time and whether it
    fits the memory limit. ``time[start, stop]`` is a dense (n, n + 1) matrix, ``inf`` where a range does not fit."""

    time: np.ndarray
    size: np.ndarray  # (n, n + 1): samples in the range
    seq: np.ndarray  # (n, n + 1): padded input length
    target: np.ndarray | None


def range_shapes(inputs: np.ndarray, targets: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """(size, seq, target) matrices indexed [start, stop] of the ranges of the ordered, rounded lengths (0 where
    stop <= start): the padded length of a range is the longest of its samples."""
    n = len(inputs)
    start = np.arange(n)[:, None]
    stop = np.arange(n + 1)[None, :]
    size = np.maximum(stop - start, 0)

    def running_max(values: np.ndarray) -> np.ndarray:
        grid = np.where(np.arange(n)[None, :] >= start, values[None, :], 0)
        out = np.zeros((n, n + 1), dtype=np.int64)
        out[:, 1:] = np.maximum.accumulate(grid, axis=1)
        return np.where(size > 0, out, 0)

    return size, running_max(inputs), running_max(targets) if targets is not None else None


def best_partition(time: np.ndarray, pp: int, virtual_stages: int, dp: int,
                   candidates: np.ndarray | None = None) -> tuple[list[int], float]:
    """The cut points [0, c_1, ..., n] minimising ``(pp - 1) · max t / v + Σ t / dp`` over partitions of the ordered
    samples into contiguous ranges whose ``time[start, stop]`` is finite. Returns (cuts, estimate); raises if none
    exists (some sample fits no range). ``candidates``: a smaller set of values that holds every finite range time
    (extra values never win: the same partition with a larger bound scores worse)."""
    finite = np.isfinite(time)
    values = time[finite] if candidates is None else candidates[np.isfinite(candidates)]
    bounds = np.unique(values)
    if len(bounds) == 0:
        raise NoPartition()
    # No partition can beat the slowest sample's best range: bounds below it are infeasible.
    lower = _cover_lower_bound(time, finite)
    bounds = bounds[bounds >= lower]
    if len(bounds) == 0:
        raise NoPartition()
    if pp == 1:  # no fill or drain: only the sum counts, the loosest bound is the optimum
        bounds = bounds[-1:]
    if len(bounds) <= EXACT_BOUNDS:
        return _solve(time, finite, bounds, pp, virtual_stages, dp)
    half = COARSE
    coarse_at = np.unique(np.linspace(0, len(bounds) - 1, half).round().astype(np.int64))
    cuts, estimate, k = _solve(time, finite, bounds[coarse_at], pp, virtual_stages, dp, with_index=True)
    lo, hi = coarse_at[max(k - 1, 0)], coarse_at[min(k + 1, len(coarse_at) - 1)]
    fine = bounds[np.unique(np.linspace(lo, hi, half).round().astype(np.int64))]
    fine_cuts, fine_estimate = _solve(time, finite, fine, pp, virtual_stages, dp)
    return (fine_cuts, fine_estimate) if fine_estimate < estimate else (cuts, estimate)


def _solve(time: np.ndarray, finite: np.ndarray, bounds: np.ndarray, pp: int, virtual_stages: int, dp: int,
           with_index: bool = False):
    """The program for the given bounds on max t, all at once: f[c, stop] = least Σ t of the first ``stop`` samples
    with every range's t <= bounds[c]."""
    n = time.shape[0]
    c = len(bounds)
    f = np.full((c, n + 1), np.inf)
    f[:, 0] = 0.0
    arg = np.zeros((c, n + 1), dtype=np.int64)
    # Ranges ending at `stop` within the largest bound start at or after first[stop]: the loop skips the rest
    # (exact for any matrix: the earliest such start, not an assumption that longer ranges cost more).
    usable = time <= bounds.max()
    first = np.where(usable.any(axis=0), np.argmax(usable, axis=0), 0)
    for stop in range(1, n + 1):
        lo = int(first[stop])
        col = time[lo:stop, stop]
        cand = np.where(col[None, :] <= bounds[:, None], f[:, lo:stop] + col[None, :], np.inf)
        best = np.argmin(cand, axis=1)
        f[:, stop] = cand[np.arange(c), best]
        arg[:, stop] = best + lo
    estimate = (pp - 1) * bounds / virtual_stages + f[:, n] / dp
    k = int(np.argmin(estimate))
    if not np.isfinite(estimate[k]):
        raise NoPartition()
    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(int(arg[k, cuts[-1]]))
    cuts.reverse()
    value = float(objective(time, cuts, pp, virtual_stages, dp))
    return (cuts, value, k) if with_index else (cuts, value)


def _cover_lower_bound(time: np.ndarray, finite: np.ndarray) -> float:
    """max over samples i of the cheapest feasible range containing i (vectorised over ranges)."""
    n = time.shape[0]
    t = np.where(finite, time, np.inf)
    # best[i] = min over start <= i < stop of t[start, stop]: a running min over starts of each stop's suffix.
    by_stop = np.minimum.accumulate(t, axis=0)  # min over start <= row for each stop
    covering = np.where(np.arange(n)[:, None] < np.arange(n + 1)[None, :], by_stop, np.inf)  # stop > i
    return float(np.max(np.min(covering, axis=1)))


def objective(time: np.ndarray, cuts: list[int], pp: int, virtual_stages: int, dp: int) -> float:
    """The step-time estimate of a partition given by its cut points."""
    t = np.array([time[a, b] for a, b in zip(cuts[:-1], cuts[1:])])
    return float((pp - 1) * t.max() / virtual_stages + t.sum() / dp)


class NoPartition(Exception):
    """No partition of the samples fits the memory limit (raised to the planner, which explains it)."""


def karmarkar_karp(costs: list[float], bins: int) -> list[list[int]]:
    """Multiway largest differencing (Karmarkar–Karp): ``costs`` indices split into ``bins`` groups of near-equal sums.

    Every item starts as a partition with the item in one group; the two partitions of largest spread are merged,
    largest group with smallest, until one is left. Ties break on insertion order, so the result is deterministic.
    """
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for i, c in enumerate(costs):
        sums = [float(c)] + [0.0] * (bins - 1)
        groups = [[i]] + [[] for _ in range(bins - 1)]
        heapq.heappush(heap, (-float(c), i, sums, groups))
    counter = len(costs)
    while len(heap) > 1:
        _, _, sa, ga = heapq.heappop(heap)
        _, _, sb, gb = heapq.heappop(heap)
        oa = sorted(range(bins), key=lambda j: (-sa[j], j))
        ob = sorted(range(bins), key=lambda j: (sb[j], j))
        sums = [sa[x] + sb[y] for x, y in zip(oa, ob)]
        groups = [ga[x] + gb[y] for x, y in zip(oa, ob)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), counter, sums, groups))
        counter += 1
    groups = heap[0][3] if heap else [[] for _ in range(bins)]
    groups = _refine([list(g) for g in groups], [float(c) for c in costs])
    return sorted((sorted(g) for g in groups), key=lambda g: (g[0] if g else len(costs)))


def _refine(groups: list[list[int]], costs: list[float]) -> list[list[int]]:
    """Improve a partition by moving one item out of the fullest group, or swapping one item of it with one of
    another group, while that lowers the largest sum (Karmarkar–Karp is not optimal: [4, 5, 6, 7, 8] in two groups
    gives 16 / 14 where 15 / 15 exists). Each accepted change lowers the fullest group's sum or the number of groups
    at that sum, so this ends."""
    for _ in range(4 * len(costs) + 4):
        sums = [sum(costs[i] for i in g) for g in groups]
        top = max(range(len(groups)), key=lambda j: (sums[j], -j))
        best = None  # (new largest of the two groups, moved-out item, group, swapped-in item or None)
        for other in range(len(groups)):
            if other == top:
                continue
            for i in groups[top]:
                moves = [(None, 0.0)] + [(k, costs[k]) for k in groups[other]]
                for k, ck in moves:
                    a, b = sums[top] - costs[i] + ck, sums[other] + costs[i] - ck
                    if max(a, b) < sums[top] and (best is None or max(a, b) < best[0]):
                        if k is None and len(groups[top]) == 1:
                            continue  # every group keeps at least one item
                        best = (max(a, b), i, other, k)
        if best is None:
            break
        _, i, other, k = best
        groups[top].remove(i)
        groups[other].append(i)
        if k is not None:
            groups[other].remove(k)
            groups[top].append(k)
    return groups
