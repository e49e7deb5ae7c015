"""Pipeline schedules as explicit per-rank action lists (picotron style: read them top to bottom).

A schedule is, for each pipeline rank, the order in which it runs forwards ``F`` and backwards ``B`` of
(stage, micro-batch) pairs, and optionally weight-gradient actions ``W``: a ``B`` with a later ``W`` of the same
(stage, micro-batch) computes and sends only the input gradient, and its ``W`` computes the weight gradients
(zero-bubble schedules, ``zero_bubble.py``); a ``B`` without one is the whole backward. Stages are placed round-robin
("looped"): stage ``s`` lives on pipeline rank
``s % pp``, so with ``v`` virtual stages per rank, rank ``r`` owns stages ``r, r + pp, ..., r + (v-1)·pp``.

Communication is not part of the list: every F of a non-first stage receives the previous stage's output,
every B of a non-last stage receives the next stage's gradient, in the order the sender produced them.
``check_schedule`` verifies this by simulation, so a schedule that could deadlock is rejected up front.

Training schedules live in one registry (``SCHEDULES``, filled by ``register_schedule``) that holds each builder
with its constraints; ``build_schedule`` and the strategy's argument validation both read it.

Why not ``torch.distributed.pipelining``'s schedules: they are bound to ``PipelineStage`` objects whose
receive buffers are sized once from the first micro-batch and whose micro-batch count is fixed at
construction; we need a different count and different shapes at every step (dynamic micro-batching) and a
hook on each send (compressed backpropagation).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Kind = Literal["F", "B", "W"]


@dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int
    microbatch: int
    # True for a backward issued after the rank's last forward: the drain ("cool-down") of the schedule,
    # whose gradient sends sit on the critical path. Compressed backpropagation's ``epilogue_only`` uses it.
    epilogue: bool = False

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage},{self.microbatch}{'*' if self.epilogue else ''}"


Builder = Callable[[int, int, int, int], list[Action]]


@dataclass(frozen=True)
class ScheduleSpec:
    """A training schedule and the constraints under which its builder is correct.

    ``builder(rank, pp, virtual_stages, num_microbatches)`` returns one rank's action list. Stages are looped
    (stage ``s`` on rank ``s % pp``); a non-``interleaved`` schedule has one stage per rank. The runtime runs
    ``check_schedule`` on every rank at the first step of each micro-batch count, before any communication, so
    a builder that drops, repeats or misorders an action fails there with a message rather than hanging.
    """

    name: str
    builder: Builder
    # Several stages per rank (virtual_stages >= 2, default 2, and pp >= 2); otherwise virtual_stages must be 1.
    interleaved: bool = False
    # The builder only works for micro-batch counts that are multiples of pp: enforced at every build, since a
    # `MicroBatches` batch can bring any count.
    microbatch_multiple_of_pp: bool = False
    # Configuration-time minimum of num_microbatches as a function of pp (a performance rule, not a correctness
    # one: the builder must stay correct for every count down to 1, which `MicroBatches` batches can bring).
    min_microbatches: Callable[[int], int] = lambda pp: 1
    min_microbatches_reason: str = ""
    title: str = ""
    # The builder emits W actions (split backwards): the strategy then gives the stages' nn.Linear layers a backward
    # whose weight gradient can be deferred to W (pipeline/weight_grad.py).
    splits_backward: bool = False
    # An interleaved schedule's counterpart with one stage per rank: the fix its error names when pp or
    # virtual_stages is below 2.
    single_stage_alternative: str = "1f1b"

    def check_interleaving(self, pp: int, virtual_stages: object) -> None:
        """The stage-count constraint: several stages per rank for an interleaved schedule, else exactly one."""
        if self.interleaved and (pp < 2 or not isinstance(virtual_stages, int) or virtual_stages < 2):
            raise ValueError(
                f"The {self.title or self.name} schedule needs pipeline_parallel_size >= 2 and virtual_stages >= 2 (got"
                f" {pp} and {virtual_stages}); use schedule={self.single_stage_alternative!r} otherwise."
            )
        if not self.interleaved and virtual_stages != 1:
            raise ValueError(f"virtual_stages={virtual_stages} only applies to interleaved schedules, not {self.name!r}.")

    def check_microbatches(self, pp: int, num_microbatches: int) -> None:
        """The hard constraint of the builder on the micro-batch count (raised at configuration and at every build)."""
        if self.microbatch_multiple_of_pp and num_microbatches % pp != 0:
            raise ValueError(
                f"The {self.title or self.name} schedule needs num_microbatches ({num_microbatches}) to be a multiple of"
                f" pipeline_parallel_size ({pp}); give a multiple of {pp} (or a `MicroBatches` batch of such a count)."
            )


SCHEDULES: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Add a training schedule under ``spec.name``; the strategy's ``schedule=`` argument then accepts the name.

    Register before the strategy is constructed, in every process. Re-registering a name replaces it.
    """
    if not spec.name or not isinstance(spec.name, str):
        raise ValueError(f"A schedule needs a non-empty string name, got {spec.name!r}.")
    SCHEDULES[spec.name] = spec
    build_schedule.cache_clear()
    return spec


def schedule_spec(name: str) -> ScheduleSpec:
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ValueError(f"Unknown schedule {name!r}; choose one of {', '.join(map(repr, SCHEDULES))}.")
    return spec


@lru_cache(maxsize=256)
def build_schedule(name: str, pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> tuple[Action, ...]:
    """The training action list of one pipeline rank."""
    spec = schedule_spec(name)
    spec.check_interleaving(pp, virtual_stages)
    spec.check_microbatches(pp, num_microbatches)
    return mark_epilogue(spec.builder(rank, pp, virtual_stages, num_microbatches))


@lru_cache(maxsize=256)
def build_forward_only(pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> tuple[Action, ...]:
    """Evaluation: forwards only, in the forward order of the interleaved schedule (plain order when v = 1).

    Correct for every micro-batch count: evaluation splits a last, smaller batch into fewer micro-batches.
    """
    return tuple(
        Action("F", *interleaved_slot(k, rank, pp, virtual_stages, num_microbatches, False))
        for k in range(num_microbatches * virtual_stages)
    )


def _gpipe(rank: int, pp: int, v: int, m: int) -> list[Action]:
    # All forwards, then all backwards: simplest, most activation memory (all M in flight).
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def one_f_one_b(rank: int, pp: int, v: int, m: int) -> list[Action]:
    # Warm up with as many forwards as there are later stages, then alternate, then drain:
    # at most pp - rank micro-batches are in flight on rank `rank`.
    warmup = min(pp - rank - 1, m)
    order = [Action("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", rank, warmup + i), Action("B", rank, i)]
    order += [Action("B", rank, i) for i in range(m - warmup, m)]
    return order


def interleaved_slot(k: int, rank: int, pp: int, v: int, m: int, backward: bool) -> tuple[int, int]:
    """(stage, micro-batch) of the k-th forward (or backward) of a rank in Megatron's interleaved order.

    Micro-batches go in groups of pp through chunk 0, then the same group through chunk 1, and so on;
    backwards visit the chunks in reverse. When pp does not divide m, the last group holds the m % pp
    remaining micro-batches (as in Megatron-core's schedule table): every rank walks the same
    (group, chunk, micro-batch) sequence, so each channel delivers in the order its receiver consumes.
    """
    full_groups = m // pp
    if k < full_groups * pp * v:
        chunk = (k // pp) % v
        microbatch = (k // (pp * v)) * pp + k % pp
    else:
        last_group = m - full_groups * pp
        k -= full_groups * pp * v
        chunk = k // last_group
        microbatch = full_groups * pp + k % last_group
    if backward:
        chunk = v - 1 - chunk
    return rank + chunk * pp, microbatch


def interleaved_warmup(rank: int, pp: int, v: int, m: int) -> int:
    """Forwards a rank runs before its first backward in Megatron's interleaved order: the rank's share of the first
    chunk's round trip, twice per later rank (a forward and a backward away), plus the other chunks' first group."""
    return min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)


def interleaved_1f1b(rank: int, pp: int, v: int, m: int) -> list[Action]:
    # Megatron's warm-up below is only deadlock-free for m % pp == 0 (the simulator finds deadlocks otherwise,
    # e.g. pp=4, v=3, m=5), hence ``microbatch_multiple_of_pp`` in its registration.
    total = m * v
    warmup = interleaved_warmup(rank, pp, v, m)
    order = [Action("F", *interleaved_slot(k, rank, pp, v, m, False)) for k in range(warmup)]
    for i in range(total - warmup):
        order.append(Action("F", *interleaved_slot(warmup + i, rank, pp, v, m, False)))
        order.append(Action("B", *interleaved_slot(i, rank, pp, v, m, True)))
    order += [Action("B", *interleaved_slot(k, rank, pp, v, m, True)) for k in range(total - warmup, total)]
    return order


register_schedule(ScheduleSpec("gpipe", _gpipe, title="GPipe"))
register_schedule(
    ScheduleSpec(
        "1f1b",
        one_f_one_b,
        title="1F1B",
        min_microbatches=lambda pp: pp,
        min_microbatches_reason="fewer leave stages idle most of the step (use schedule='gpipe' for fewer)",
    )
)
register_schedule(
    ScheduleSpec("interleaved_1f1b", interleaved_1f1b, interleaved=True, microbatch_multiple_of_pp=True, title="interleaved 1F1B")
)


def mark_epilogue(order: Sequence[Action]) -> tuple[Action, ...]:
    """The order with each backward's ``epilogue`` flag set from its position (after the rank's last forward)."""
    last_forward = max((i for i, a in enumerate(order) if a.kind == "F"), default=-1)
    return tuple(
        Action(a.kind, a.stage, a.microbatch, epilogue=(a.kind == "B" and i > last_forward)) for i, a in enumerate(order)
    )


def deferred_weights(order: Sequence[Action]) -> frozenset[tuple[int, int]]:
    """(stage, micro-batch) of the backwards in ``order`` whose weight gradients a later W computes (split backwards)."""
    return frozenset((a.stage, a.microbatch) for a in order if a.kind == "W")


def message_order(
    orders: list[tuple[Action, ...]], num_stages: int, kind: Kind, src_rank: int, dst_rank: int
) -> list[tuple[int, int]]:
    """(sending stage, micro-batch) of every message on the channel src_rank -> dst_rank, in sending order.

    ``kind`` "F" is the activation channel, "B" the gradient channel.
    """
    pp = len(orders)
    step = 1 if kind == "F" else -1
    return [
        (a.stage, a.microbatch)
        for a in orders[src_rank]
        if a.kind == kind and 0 <= a.stage + step < num_stages and (a.stage + step) % pp == dst_rank
    ]


def check_schedule(orders: list[tuple[Action, ...]], num_stages: int, num_microbatches: int, *, train: bool) -> None:
    """Check a schedule's content, then simulate it with FIFO channels and blocking receives; raise if it is
    incomplete, deadlocks or misorders.

    Content: every stage runs on its own rank (``stage % pp``), every F of every (stage, micro-batch) in
    ``range(num_stages) x range(num_microbatches)`` runs exactly once, and in training (``train``) every B
    exactly once too, and W at most once, after its B; a forward-only schedule has no B. Simulation: each rank executes
    its list in order; an F
    of stage s > 0 needs the activation of (s - 1, m), a B of a non-last stage needs the gradient of (s + 1, m),
    and each message must be the next one in its channel.
    """
    _check_content(orders, num_stages, num_microbatches, train)
    pp = len(orders)
    sent: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    received: dict[tuple[str, int, int], int] = {}
    position = [0] * pp
    done = {(a.kind, a.stage, a.microbatch): False for order in orders for a in order}
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                a = orders[rank][position[rank]]
                if a.kind == "F" and a.stage > 0:
                    need, src = ("F", a.stage - 1, a.microbatch), (a.stage - 1) % pp
                elif a.kind == "B" and a.stage < num_stages - 1:
                    need, src = ("B", a.stage + 1, a.microbatch), (a.stage + 1) % pp
                else:
                    need = None
                if a.kind == "B" and not done[("F", a.stage, a.microbatch)]:
                    raise ValueError(f"rank {rank}: {a} runs before its forward")
                if a.kind == "W" and not done.get(("B", a.stage, a.microbatch)):
                    raise ValueError(f"rank {rank}: {a} runs before its input-gradient backward B")
                if need is not None:
                    channel = (a.kind, src, rank)
                    queue, head = sent.get(channel, []), received.get(channel, 0)
                    if head >= len(queue):
                        break  # blocked: the message has not been sent yet
                    if queue[head] != need[1:]:
                        raise ValueError(f"rank {rank}: {a} expects {need[1:]} but channel {channel} delivers {queue[head]}")
                    received[channel] = head + 1
                done[(a.kind, a.stage, a.microbatch)] = True
                nxt = a.stage + (1 if a.kind == "F" else -1)
                if a.kind != "W" and 0 <= nxt < num_stages:  # a W sends nothing
                    sent.setdefault((a.kind, a.stage % pp, nxt % pp), []).append((a.stage, a.microbatch))
                position[rank] += 1
                progress = True
    stuck = [r for r in range(pp) if position[r] < len(orders[r])]
    if stuck:
        raise ValueError(f"schedule deadlocks: ranks {stuck} blocked at {[orders[r][position[r]] for r in stuck]}")


def _check_content(orders: list[tuple[Action, ...]], num_stages: int, num_microbatches: int, train: bool) -> None:
    pp = len(orders)
    kinds = "FBW" if train else "F"
    for rank, order in enumerate(orders):
        for a in order:
            if a.kind not in kinds:
                raise ValueError(f"rank {rank}: {a} is not an action of a {'training' if train else 'forward-only'} schedule")
            if not (0 <= a.stage < num_stages and 0 <= a.microbatch < num_microbatches):
                raise ValueError(
                    f"rank {rank}: {a} is out of range: {num_stages} stages and {num_microbatches} micro-batches"
                )
            if a.stage % pp != rank:
                raise ValueError(f"rank {rank}: {a} runs stage {a.stage}, which lives on rank {a.stage % pp}")
    counts = Counter((a.kind, a.stage, a.microbatch) for order in orders for a in order)
    repeated = sorted(key for key, n in counts.items() if n > 1)
    if repeated:
        raise ValueError(f"schedule runs {_describe(repeated)} more than once")
    missing = [
        (kind, stage, mb)
        for kind in kinds.replace("W", "")  # W is optional: a B without one is the whole backward
        for stage in range(num_stages)
        for mb in range(num_microbatches)
        if (kind, stage, mb) not in counts
    ]
    if missing:
        raise ValueError(f"schedule never runs {_describe(missing)}")


def _describe(keys: list[tuple[str, int, int]], limit: int = 8) -> str:
    shown = ", ".join(repr(Action(*key)) for key in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
