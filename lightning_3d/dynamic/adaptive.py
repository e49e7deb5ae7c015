"""The adaptive schedule: DynaPipe's idea of a pipeline order made for the step's own micro-batches, as explicit
per-rank ``Action`` lists that the runtime runs like any other (docs/dynamic.md, "The adaptive schedule").

1F1B fixes every rank's interleaving of forwards and backwards in advance (pp - r warm-up forwards, then strict
alternation). With micro-batches of very different sizes that rule makes a rank wait for one kind of action while
the other kind is ready: a rank behind a long micro-batch idles for its backward although small forwards have
arrived, and how many micro-batches fit in memory depends on which ones are in flight, not on a count.

``adaptive_orders`` builds the orders by list scheduling on the step's per-stage costs (the cost model's, the same
numbers the simulator judges the result with). It plays the step forward in time: whenever a rank is free, it runs
one of the actions whose inputs have arrived, a backward before a forward (a backward frees memory and unblocks the
ranks before it), the lower micro-batch first; it never idles while an admissible action is ready. Micro-batches
enter stage 0 in the given order (the order search chooses it), and each channel between two ranks is consumed in
the order it was sent, so the orders pass ``check_schedule`` and the runtime's FIFO message matching.

Memory: a new micro-batch is admitted into the pipeline only if, on every rank, the activations of all admitted
micro-batches that the rank still holds or will hold (each one's stored bytes summed over the rank's stages), plus
the largest working set among them, stay within the budget. Once admitted, a micro-batch runs through every stage
without further checks, so no rank ever waits on memory for a micro-batch that is already in the pipeline (with
looped placement, v > 1, a rank that refused a micro-batch's later stage could deadlock the ranks holding its
earlier ones). A rank's held activations never exceed its reservations, so the simulated peak of every rank stays
within the budget, except when one micro-batch alone exceeds it: it is then admitted alone (nothing else in flight)
and the plan's memory check reports it.

Everything is a function of the cost arrays and the order (ties broken by rank, micro-batch and stage), so every
process computes the same lists from the same plan without communicating.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from lightning_3d.pipeline.schedules import Action, mark_epilogue, schedule_spec

# What ``adaptive_schedule`` accepts (the data module's option, the planner's argument) and what each value does.
ADAPTIVE_CHOICES = {
    "auto": "the adaptive schedule is one more candidate of the order search, run where it simulates faster",
    "off": "only the named schedule (and 1F1B with fewer warm-up forwards where memory is tight)",
    "only": "always the adaptive schedule (at pp > 1)",
}


def check_adaptive_choice(value: object) -> str:
    """``value`` if it is one of ``ADAPTIVE_CHOICES``; else a ValueError naming them."""
    if value not in ADAPTIVE_CHOICES:
        choices = "; ".join(f"{k!r}: {v}" for k, v in ADAPTIVE_CHOICES.items())
        raise ValueError(f"adaptive_schedule={value!r} is not a choice ({choices}).")
    return str(value)


def check_adaptive(value: object, schedule: str) -> str:
    """``value`` if it is an ``adaptive_schedule`` choice the named schedule allows; else a ValueError naming the
    choices and the fix."""
    check_adaptive_choice(value)
    if value == "only" and not supports_adaptive(schedule):
        raise ValueError(f"adaptive_schedule='only' with schedule={schedule!r}: the adaptive schedule runs whole "
                         "backwards, while this schedule splits them into input and weight gradients (W actions). Use a"
                         " schedule without W ('1f1b', 'gpipe', 'interleaved_1f1b'), or adaptive_schedule='auto'/'off'.")
    return str(value)


def supports_adaptive(schedule: str) -> bool:
    """Whether the order search may replace the named schedule's orders with adaptive ones: not for schedules that
    split backwards (the strategy sets their layers up for deferred weight gradients, which the adaptive lists,
    whole backwards only, would not exercise as planned)."""
    return not schedule_spec(schedule).splits_backward


def adaptive_orders(
    forward: np.ndarray, backward: np.ndarray, stored: np.ndarray, transient: np.ndarray, pp: int, budget: float,
) -> tuple[tuple[Action, ...], ...]:
    """Per-rank action lists for ``m`` micro-batches over ``num_stages`` looped stages (stage s on rank s % pp).

    The arrays have shape (num_stages, m): seconds of each stage's forward and backward for micro-batch j (the
    columns in the order they enter the pipeline), bytes it keeps until its backward, bytes of working memory while
    an action runs. ``budget``: bytes of activation memory per rank (module docstring)."""
    num_stages, m = forward.shape
    if num_stages % pp:
        raise ValueError(f"{num_stages} stages cannot be placed looped over pp={pp} ranks (a multiple is needed).")
    fwd, bwd, keep = forward.tolist(), backward.tolist(), stored.tolist()
    last = (num_stages - 1) % pp  # the rank of the last stage
    # What admitting micro-batch j reserves on each rank: its stored bytes over the rank's stages, and the largest
    # working set of its actions there.
    need = [[float(sum(stored[s, j] for s in range(r, num_stages, pp))) for j in range(m)] for r in range(pp)]
    work = [[float(max(transient[s, j] for s in range(r, num_stages, pp))) for j in range(m)] for r in range(pp)]
    reserved: list[dict[int, float]] = [{} for _ in range(pp)]  # per rank: micro-batch -> bytes still reserved
    free = [0.0] * pp  # when each rank finishes its last action so far
    # Per receiving rank, the messages sent to it in sending order: (arrival, stage, micro-batch). The last stage's
    # backwards need no message: they queue in ``local`` when their forward ends.
    queues = {(r, src): deque() for r in range(pp) for src in ("b", "f")}
    local: deque = deque()
    orders: list[list[Action]] = [[] for _ in range(pp)]
    admitted, now, remaining = 0, 0.0, 2 * num_stages * m
    admit: bool | None = None  # whether the next micro-batch may enter (recomputed when reservations change)
    chosen: list = [None] * pp  # each rank's next action, recomputed for the ranks whose state changed

    def admissible() -> bool:
        if admitted >= m:
            return False
        if not any(reserved):
            return True  # nothing in flight: the next one runs even alone over the budget (the plan's check says so)
        j = admitted
        return all(sum(held.values()) + need[r][j] + max([work[r][i] for i in held] + [work[r][j]]) <= budget
                   for r, held in enumerate(reserved))

    def choose(r: int) -> tuple[float, int, str] | None:
        """(start, rank, source) of the action rank r runs next: at the earliest time one is ready, among those
        ready then a backward before a forward, then the lower micro-batch; None if none can run yet."""
        heads = []  # (is a forward, micro-batch, arrival, source)
        for src, queue in (("b", queues[r, "b"]), ("local", local if r == last else ()), ("f", queues[r, "f"])):
            if queue:
                heads.append((src == "f", queue[0][2], queue[0][0], src))
        if r == 0 and admit:
            heads.append((True, admitted, now, "new"))
        if not heads:
            return None
        start = max(free[r], min(h[2] for h in heads))
        return start, r, min(h for h in heads if h[2] <= start)[3]

    while remaining:
        if admit is None:
            admit = admissible()
            chosen[0] = None
        for r in range(pp):
            if chosen[r] is None:
                chosen[r] = choose(r) or (math.inf, pp, "")  # sorts after every real option
        start, r, source = min(chosen)
        if source == "":
            raise RuntimeError("adaptive schedule: no rank can run (an internal error; please report it)")
        now = max(now, start)
        if source == "new":
            stage, j, kind = 0, admitted, "F"
            for q in range(pp):
                reserved[q][j] = need[q][j]
            admitted, admit = admitted + 1, None
        else:
            _, stage, j = (local if source == "local" else queues[r, source]).popleft()
            kind = "F" if source == "f" else "B"
        end = start + (fwd if kind == "F" else bwd)[stage][j]
        free[r], chosen[r] = end, None
        orders[r].append(Action(kind, stage, j))
        remaining -= 1
        if kind == "F" and stage == num_stages - 1:
            local.append((end, stage, j))
        elif kind == "F":
            queues[(stage + 1) % pp, "f"].append((end, stage + 1, j))
            chosen[(stage + 1) % pp] = None
        else:
            if stage < pp:  # the rank's first stage of j: its last backward there, nothing of j is held any more
                del reserved[r][j]
            else:
                reserved[r][j] -= keep[stage][j]
            admit = None
            if stage > 0:
                queues[(stage - 1) % pp, "b"].append((end, stage - 1, j))
                chosen[(stage - 1) % pp] = None
    if not all(math.isfinite(f) for f in free):
        raise ValueError("adaptive schedule: a stage's cost is not finite (a shape outside the cost model's range).")
    return tuple(mark_epilogue(order) for order in orders)
