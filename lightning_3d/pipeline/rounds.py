"""The order of a pipeline step's communication: every rank's actions placed on one global clock of rounds.

A schedule says in which order each rank runs its actions; it does not say when the ranks communicate. The
transport (``p2p``) needs that too: one communicator carries a pipeline's messages in both directions, and its
operations must be issued in the same order on both ends of every link (docs/architecture.md, "Pipeline
transport"). ``lockstep_rounds`` simulates the schedule on a clock: in round ``t`` every rank runs its next action
if the message it needs was sent in an earlier round (as soon as possible, like ``check_schedule``'s simulation).
Each rank then ends round ``t`` with one batch of point-to-point operations: the message its own action produced
and the receives of every message a neighbour sent in round ``t``. The two ends of a message therefore post it in
the same round, and every rank's sequence of batches, restricted to one neighbour, equals that neighbour's with
sends and receives swapped. This is the time-step grid of ``torch.distributed.pipelining``'s
``PipelineScheduleMulti``, derived here from any per-rank action lists (explicit per-step orders included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from lightning_3d.pipeline.schedules import Action

Message = tuple[str, int, int]  # (kind "F"/"B", sending stage, micro-batch)


@dataclass(frozen=True)
class Round:
    """One round of one rank: its action (None: idle) and the messages it receives at the end of the round."""

    index: int
    action: Action | None
    receives: tuple[Message, ...]


def destination(kind: str, stage: int, num_stages: int, pp: int) -> int | None:
    """Pipeline rank that receives what ``stage`` sends after its ``kind`` action (None: nothing is sent; a W never
    sends)."""
    if kind == "W":
        return None
    nxt = stage + (1 if kind == "F" else -1)
    return nxt % pp if 0 <= nxt < num_stages else None


def lockstep_rounds(orders: Sequence[Sequence[Action]], num_stages: int) -> tuple[tuple[Round, ...], ...]:
    """Each rank's rounds, skipping those in which it neither runs an action nor receives. ``orders`` must have
    passed ``check_schedule`` (which rejects deadlocks), so the simulation ends."""
    return _rounds(tuple(tuple(order) for order in orders), num_stages)


@lru_cache(maxsize=64)
def _rounds(orders: tuple[tuple[Action, ...], ...], num_stages: int) -> tuple[tuple[Round, ...], ...]:
    pp = len(orders)
    sent: dict[Message, int] = {}  # message -> round in which it was sent
    position = [0] * pp
    rounds: list[list[Round]] = [[] for _ in range(pp)]
    t = 0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        ran: list[Action | None] = [None] * pp
        for rank in range(pp):
            if position[rank] < len(orders[rank]):
                a = orders[rank][position[rank]]
                need = _needs(a, num_stages)
                if need is None or sent.get(need, t) < t:
                    ran[rank] = a
        if not any(ran):
            raise ValueError(f"schedule deadlocks at round {t}: {[o[p] if p < len(o) else None for o, p in zip(orders, position)]}")
        incoming: list[list[Message]] = [[] for _ in range(pp)]
        for rank, a in enumerate(ran):
            if a is None:
                continue
            position[rank] += 1
            dst = destination(a.kind, a.stage, num_stages, pp)
            if dst is not None:
                sent[(a.kind, a.stage, a.microbatch)] = t
                incoming[dst].append((a.kind, a.stage, a.microbatch))
        for rank in range(pp):
            if ran[rank] is not None or incoming[rank]:
                # Each neighbour sends at most one message per round, so the order of receives only has to be fixed.
                rounds[rank].append(Round(t, ran[rank], tuple(sorted(incoming[rank]))))
        t += 1
    return tuple(tuple(r) for r in rounds)


def _needs(a: Action, num_stages: int) -> Message | None:
    """The message an action consumes (None: it consumes none)."""
    if a.kind == "F" and a.stage > 0:
        return ("F", a.stage - 1, a.microbatch)
    if a.kind == "B" and a.stage < num_stages - 1:
        return ("B", a.stage + 1, a.microbatch)
    return None
