"""A timed simulation of a pipeline schedule: when each action starts and ends, the step's makespan and each rank's
activation memory, given how long every action takes and what it keeps.

``check_schedule`` (schedules.py) answers *whether* a list of per-rank actions runs; this module answers *how long*
and *how much memory*, for the planner's schedule costs and for dynamic micro-batching, which orders micro-batches of
different sizes to shorten the step within a memory budget (docs/extending.md). It runs the same dependency rules as
the runtime: a rank executes its list in order; F(s, m) of a stage s > 0 needs F(s - 1, m) to have ended and its
output to have arrived (``latency``); B(s, m) needs F(s, m), and unless s is the last stage, B(s + 1, m) plus the
gradient's arrival; W(s, m) (a split backward's weight gradients) needs B(s, m) and sends nothing. Sends are
asynchronous (a rank does not wait for its own sends), as in the runtime.

Host and device (``host``): eager PyTorch issues an action's kernels from the host, and a rank's host does not wait
for the device or for a received message (the runtime's waits on NCCL receives are stream waits), so it issues the
next action while its device runs the current one or waits for data; it runs no further ahead than that (the next
issue starts no earlier than the current action starts on the device: the launch queue holds about one stage's
pass). An action starts on the device no earlier than its issue starts, and ends no earlier than its issue ends:
``end = max(device start + duration, host issue end)``. Without ``host`` every action is timed by ``duration``
alone (the host never the bound).

Memory per rank is counted in the order the rank runs its actions: a forward's ``stored`` bytes are held from its
start until its backward ends (its W, where the backward is split: W needs the saved inputs of the stage's layers);
while an action runs, its ``transient`` bytes come on top. Forward-only schedules
(evaluation) keep nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_3d.pipeline.schedules import Action, check_schedule, deferred_weights

ActionCost = Callable[[Action], float]


@dataclass(frozen=True)
class Timeline:
    """The outcome of ``simulate``: times in the unit of ``duration``, memory in the unit of ``stored``."""

    makespan: float
    start: dict[tuple[str, int, int], float]  # (kind, stage, micro-batch) -> start time
    end: dict[tuple[str, int, int], float]
    rank_end: tuple[float, ...]  # when each rank finishes its list
    rank_busy: tuple[float, ...]  # the sum of each rank's action durations (makespan - busy = its idle time)
    peak_memory: tuple[float, ...]  # per rank: the largest stored + transient amount at any point of its list

    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time over the makespan (0 = no bubble)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.rank_busy) / (len(self.rank_busy) * self.makespan)


def simulate(
    orders: Sequence[Sequence[Action]],
    num_stages: int,
    duration: ActionCost,
    *,
    latency: ActionCost | float = 0.0,
    stored: ActionCost | None = None,
    transient: ActionCost | None = None,
    check: bool = True,
    num_microbatches: int | None = None,
    host: ActionCost | None = None,
) -> Timeline:
    """Simulate ``orders`` (one action list per pipeline rank, looped placement: stage s on rank s % pp).

    ``duration(action)``: how long the action computes. ``latency``: how long the message an action sends takes to
    arrive (a number, or a function of the sending action; messages between stages on the same rank are free).
    ``stored(action)``: for a forward, the activation bytes it keeps until its backward (ignored for backwards).
    ``transient(action)``: working memory on top while the action runs. ``check``: validate the orders with the
    schedule simulator first (``num_microbatches`` defaults to the largest micro-batch index + 1), so that an
    invalid order raises the simulator's message instead of a wrong timeline. ``host(action)``: the host's seconds
    to issue the action (module docstring); ``rank_busy`` stays the device's sum.
    """
    pp = len(orders)
    train = any(a.kind != "F" for order in orders for a in order)
    if check:
        m = num_microbatches if num_microbatches is not None else 1 + max(a.microbatch for o in orders for a in o)
        check_schedule([tuple(o) for o in orders], num_stages, m, train=train)
    lat = latency if callable(latency) else (lambda _a, value=float(latency): value)
    end: dict[tuple[str, int, int], float] = {}
    start: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    position = [0] * pp
    busy = [0.0] * pp
    issued = [0.0] * pp  # each rank's host clock: when it has issued its actions so far
    total = sum(len(o) for o in orders)
    done = 0
    # Each pass advances every rank as far as its dependencies allow; a valid schedule completes (checked above).
    while done < total:
        advanced = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                a = orders[rank][position[rank]]
                ready = _ready(a, num_stages, pp, end, lat)
                if ready is None:
                    break
                begin = max(free[rank], ready, issued[rank])
                took = float(duration(a))
                finish = begin + took
                if host is not None:
                    issued[rank] += float(host(a))
                    finish = max(finish, issued[rank])
                    # The host runs at most one action ahead: it issues the next action's kernels while the device
                    # runs this one, not further (the device's launch queue is bounded, about one stage's pass).
                    issued[rank] = max(issued[rank], begin)
                key = (a.kind, a.stage, a.microbatch)
                start[key], end[key] = begin, finish
                free[rank] = finish
                busy[rank] += took
                position[rank] += 1
                done += 1
                advanced = True
        if not advanced:
            stuck = [orders[r][position[r]] for r in range(pp) if position[r] < len(orders[r])]
            raise ValueError(f"schedule cannot proceed: ranks wait on {stuck} (run with check=True for the cause)")
    peaks = tuple(_peak_memory(order, stored, transient) for order in orders)
    return Timeline(max(free, default=0.0), start, end, tuple(free), tuple(busy), peaks)


def _ready(a: Action, num_stages: int, pp: int, end: dict, lat: ActionCost) -> float | None:
    """When ``a``'s inputs are available, or None if a producer has not run yet."""
    times = []
    if a.kind == "F":
        if a.stage > 0:
            producer = Action("F", a.stage - 1, a.microbatch)
            times.append(_arrival(producer, a, pp, end, lat))
    elif a.kind == "W":
        times.append(end.get(("B", a.stage, a.microbatch)))
    else:
        times.append(end.get(("F", a.stage, a.microbatch)))
        if a.stage < num_stages - 1:
            producer = Action("B", a.stage + 1, a.microbatch)
            times.append(_arrival(producer, a, pp, end, lat))
    if any(t is None for t in times):
        return None
    return max(times, default=0.0)


def _arrival(producer: Action, consumer: Action, pp: int, end: dict, lat: ActionCost) -> float | None:
    finished = end.get((producer.kind, producer.stage, producer.microbatch))
    if finished is None:
        return None
    same_rank = producer.stage % pp == consumer.stage % pp
    return finished if same_rank else finished + float(lat(producer))


def _peak_memory(order: Sequence[Action], stored: ActionCost | None, transient: ActionCost | None) -> float:
    held: dict[tuple[int, int], float] = {}
    current = peak = 0.0
    keeps = any(b.kind == "B" for b in order)  # forward-only lists keep nothing
    split = deferred_weights(order)  # these keep their activations until their W
    for a in order:
        extra = float(transient(a)) if transient is not None else 0.0
        if a.kind == "F":
            keep = float(stored(a)) if stored is not None else 0.0
            peak = max(peak, current + keep + extra)
            if keeps:
                held[(a.stage, a.microbatch)] = keep
                current += keep
        else:
            peak = max(peak, current + extra)
            if a.kind == "W" or (a.stage, a.microbatch) not in split:
                current -= held.pop((a.stage, a.microbatch), 0.0)
    return peak
