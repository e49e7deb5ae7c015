"""Handing planned steps from DataLoader workers to the training process cheaply, and counting the steps that waited
for their plan.

**Why the hand-off needs care.** A DataLoader worker sends its batch through a queue; every CPU tensor in it travels
as a shared-memory storage, and with torch's default sharing strategy each storage costs the receiving process a
round trip to the worker (a Unix-socket connection with an authentication handshake that passes the file
descriptor). A planned step holds two to four tensors per micro-batch and tens of micro-batches, so the training
process spent milliseconds per step receiving a batch that had been ready for a long time. ``PlannedMicroBatches``
pickles differently: all its tensors of one dtype are copied into one contiguous buffer in the worker, so the step
crosses as one storage per dtype plus a small skeleton, and the training process cuts the buffer back into
micro-batch tensors with views (``Tensor.split``), which costs microseconds. In the process that made it (no workers,
or a plain ``pickle`` round trip) it is an ordinary ``MicroBatches``.

Receiving is still a round trip to the worker, and the worker may be busy planning the next step (on a loaded
host the reply waits for a core). ``background(loader, ahead)`` therefore takes the batches off the loader in a
thread of the training process, ``ahead`` steps before they are needed: the training loop's ``next`` then only
takes a ready step out of a local queue. The thread spends its time in the hand-off's system calls, which release
the interpreter lock, so it does not slow the training thread down.

**Waiting for a plan, precisely.** The batcher stamps every step with the ``time.monotonic()`` at which its plan and
collation were done (``planned_at``; on Linux the monotonic clock is one clock for all processes of the machine).
``PlanWaits.wrap(loader)`` records, in the training process, when each step's batch was asked for (``next`` on the
loader) and when it arrived. A step *waited for its plan* when it was asked for before its plan was done
(``requested < planned_at``): the training loop stood still while the planner ran. Separately, the *fetch* time is
what ``next`` cost the training process (queue hand-off and unpickling included), and the *lead* of a step is how
many steps ahead of training its plan was finished: the number of steps the loop had asked for before
``planned_at``, subtracted from the step's own index (lead 2: the plan was done while the step two before it ran).
The first ``startup`` steps (default 1) are reported apart: nothing can be planned ahead of the loader's start.
The lead of step k is at most k - 1 (no plan is done before the loader starts), so the smallest lead is taken over
steps 3 and later, where a lead of 2 is possible.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_3d.pipeline.microbatch import MicroBatches


class _Slot:
    """Where a tensor sat in a micro-batch's structure: its buffer (dtype) and its place in that buffer."""

    __slots__ = ("buffer", "index", "shape")

    def __init__(self, buffer: int, index: int, shape: tuple[int, ...]) -> None:
        self.buffer, self.index, self.shape = buffer, index, shape

    def __reduce__(self):
        return _Slot, (self.buffer, self.index, self.shape)


def _strip(x: Any, dtypes: dict[torch.dtype, int], parts: list[list[torch.Tensor]]) -> Any:
    """``x`` with every plain CPU tensor replaced by a ``_Slot``; the tensors collected per dtype."""
    if type(x) is torch.Tensor and x.device.type == "cpu" and not x.requires_grad:
        b = dtypes.setdefault(x.dtype, len(dtypes))
        if b == len(parts):
            parts.append([])
        parts[b].append(x.reshape(-1))
        return _Slot(b, len(parts[b]) - 1, tuple(x.shape))
    if type(x) is dict:
        return {k: _strip(v, dtypes, parts) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_strip(v, dtypes, parts) for v in x)
    return x  # anything else (other containers, non-tensor leaves) is pickled as it is


def _fill(x: Any, views: list[list[torch.Tensor]]) -> Any:
    if isinstance(x, _Slot):
        return views[x.buffer][x.index].view(x.shape)
    if type(x) is dict:
        return {k: _fill(v, views) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_fill(v, views) for v in x)
    return x


def _rebuild(skeleton: list, buffers: list[torch.Tensor], sizes: list[list[int]], state: dict) -> MicroBatches:
    views = [list(buffer.split(s)) for buffer, s in zip(buffers, sizes)]
    out = MicroBatches([_fill(mb, views) for mb in skeleton], orders=state.pop("orders"))
    out.__dict__.update(state)
    return out


class PlannedMicroBatches(MicroBatches):
    """A planned step's ``MicroBatches`` that crosses process boundaries as one buffer per dtype (module docstring).
    ``planned_at``: the ``time.monotonic()`` at which planning and collation finished."""

    planned_at: float | None = None

    def __copy__(self) -> PlannedMicroBatches:
        # A shallow copy stays what it is (``copy.copy`` would otherwise go through the packing ``__reduce__``).
        out = PlannedMicroBatches(self, orders=self.orders)
        out.__dict__.update(self.__dict__)
        return out

    def __reduce__(self):
        dtypes: dict[torch.dtype, int] = {}
        parts: list[list[torch.Tensor]] = []
        skeleton = [_strip(mb, dtypes, parts) for mb in self]
        buffers = [torch.cat(p) if len(p) > 1 else p[0].clone() for p in parts]
        sizes = [[t.numel() for t in p] for p in parts]
        return _rebuild, (skeleton, buffers, sizes, dict(self.__dict__))


_DONE = object()


def background(batches: Iterable[Any], ahead: int = 2) -> Iterator[Any]:
    """Iterate ``batches`` in a thread, keeping up to ``ahead`` batches ready (module docstring). An exception of the
    source is raised here, at the batch where it happened; closing this generator (or dropping it) stops the thread,
    which then releases the source (a DataLoader's workers shut down with its iterator)."""
    if not isinstance(ahead, int) or ahead < 1:
        raise ValueError(f"ahead must be a positive number of batches, got {ahead!r}.")
    ready: queue.Queue = queue.Queue(ahead)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for batch in batches:
                if not put((batch, None)):
                    return
            put((_DONE, None))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
            put((_DONE, err))

    thread = threading.Thread(target=run, name="lightning_3d-batch-handoff", daemon=True)
    thread.start()
    try:
        while True:
            batch, err = ready.get()
            if err is not None:
                raise err
            if batch is _DONE:
                return
            yield batch
    finally:
        # Not joined: the thread may be inside the source's ``next`` (a worker still planning); it sees ``stop`` and
        # ends after that batch, dropping it.
        stop.set()


@dataclass
class PlanWaits:
    """Per-step record of a planned loader in the training process (see the module docstring for the terms).

    ``wrap(loader)`` yields the loader's batches and records each step; ``summary()`` reports the counts. A batch
    without ``planned_at`` (not from a ``DynamicMicroBatcher``) is recorded with its fetch time only. Per step also
    ``choices`` (the candidate that ran, for a batcher with ``candidates``; else None) and ``predicted_s`` (the cost
    model's simulated step seconds of what ran, for planned steps) and ``schedules`` (per replica, what its pipeline
    orders are: the named schedule, ``"1f1b-warmup<w>"`` or ``"adaptive"``; None for a step that was not planned).
    """

    startup: int = 1
    requested: list[float] = field(default_factory=list)
    received: list[float] = field(default_factory=list)
    planned: list[float | None] = field(default_factory=list)
    choices: list[str | None] = field(default_factory=list)
    predicted_s: list[float | None] = field(default_factory=list)
    schedules: list[tuple[str, ...] | None] = field(default_factory=list)

    def wrap(self, loader: Iterable[Any]) -> Iterator[Any]:
        it = iter(loader)
        while True:
            start = time.monotonic()
            try:
                batch = next(it)
            except StopIteration:
                return
            received = time.monotonic()
            choice, plan = getattr(batch, "choice", None), getattr(batch, "plan", None)
            self.record(start, received, getattr(batch, "planned_at", None),
                        choice.chosen if choice is not None else None, plan.makespan if plan is not None else None,
                        tuple(r.schedule for r in plan.replicas) if plan is not None else None)
            yield batch

    def record(self, requested: float, received: float, planned_at: float | None, chosen: str | None = None,
               predicted_s: float | None = None, schedules: tuple[str, ...] | None = None) -> None:
        self.requested.append(requested)
        self.received.append(received)
        self.planned.append(planned_at)
        self.choices.append(chosen)
        self.predicted_s.append(predicted_s)
        self.schedules.append(schedules)

    def choice_counts(self) -> dict[str, int]:
        """How many steps ran each chosen candidate (empty without candidates)."""
        counts: dict[str, int] = {}
        for name in self.choices:
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
        return counts

    def waited(self) -> list[bool]:
        """Per step: asked for before its plan was done."""
        return [p is not None and r < p for r, p in zip(self.requested, self.planned)]

    def leads(self) -> list[int | None]:
        """Per step: its index minus the number of steps asked for before its plan was done (None: not planned)."""
        out: list[int | None] = []
        for k, p in enumerate(self.planned):
            out.append(None if p is None else k - sum(r <= p for r in self.requested))
        return out

    def summary(self) -> dict[str, Any]:
        steady = slice(self.startup, None)
        fetch = [1e3 * (b - a) for a, b in zip(self.requested, self.received)]
        leads = [x for x in self.leads()[max(self.startup, 3):] if x is not None]
        fs = sorted(fetch[steady])
        return {
            "steps": len(fetch), "startup_steps": min(self.startup, len(fetch)),
            "steps_waiting_for_plan": int(sum(self.waited()[steady])),
            "startup_waiting_for_plan": int(sum(self.waited()[: self.startup])),
            "plan_lead_min": min(leads) if leads else None,
            "fetch_ms_median": fs[len(fs) // 2] if fs else None,
            "fetch_ms_p99": fs[min(len(fs) - 1, int(0.99 * len(fs)))] if fs else None,
            "fetch_ms_max": fs[-1] if fs else None,
            "steps_fetching_over_1ms": int(sum(f > 1.0 for f in fetch[steady])),
            "choices": self.choice_counts(),
        }
