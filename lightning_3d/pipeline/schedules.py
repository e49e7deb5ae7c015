"""Pipeline schedules as explicit per-rank action lists (picotron style: read them top to bottom).

A schedule is, for each pipeline rank, the order in which it runs forwards ``F`` and backwards ``B`` of
(stage, micro-batch) pairs. Stages are placed round-robin ("looped"): stage ``s`` lives on pipeline rank
``s % pp``, so with ``v`` virtual stages per rank, rank ``r`` owns stages ``r, r + pp, ..., r + (v-1)·pp``.

Communication is not part of the list: every F of a non-first stage receives the previous stage's output,
every B of a non-last stage receives the next stage's gradient, in the order the sender produced them.
``check_schedule`` verifies this by simulation, so a schedule that could deadlock is rejected up front.

Why not ``torch.distributed.pipelining``'s schedules: they are bound to ``PipelineStage`` objects whose
receive buffers are sized once from the first micro-batch and whose micro-batch count is fixed at
construction; we need a different count and different shapes at every step (dynamic micro-batching) and a
hook on each send (compressed backpropagation).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Kind = Literal["F", "B"]


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


def stages_of_rank(rank: int, pp: int, virtual_stages: int) -> list[int]:
    return [rank + chunk * pp for chunk in range(virtual_stages)]


@lru_cache(maxsize=256)
def build_schedule(name: str, pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> tuple[Action, ...]:
    """The training action list of one pipeline rank."""
    if name == "gpipe":
        order = _gpipe(rank, pp, num_microbatches)
    elif name == "1f1b":
        order = _one_f_one_b(rank, pp, num_microbatches)
    elif name == "interleaved_1f1b":
        order = _interleaved(rank, pp, virtual_stages, num_microbatches)
    else:
        raise ValueError(f"Unknown schedule {name!r}; choose one of 'gpipe', '1f1b', 'interleaved_1f1b'.")
    return _mark_epilogue(order)


@lru_cache(maxsize=256)
def build_forward_only(pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> tuple[Action, ...]:
    """Evaluation: forwards only, in the forward order of the interleaved schedule (plain order when v = 1)."""
    if virtual_stages == 1:
        return tuple(Action("F", rank, m) for m in range(num_microbatches))
    return tuple(Action("F", *_interleaved_slot(k, rank, pp, virtual_stages, False)) for k in range(num_microbatches * virtual_stages))


def _gpipe(rank: int, pp: int, m: int) -> list[Action]:
    # All forwards, then all backwards: simplest, most activation memory (all M in flight).
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    # Warm up with as many forwards as there are later stages, then alternate, then drain:
    # at most pp - rank micro-batches are in flight on rank `rank`.
    warmup = min(pp - rank - 1, m)
    order = [Action("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", rank, warmup + i), Action("B", rank, i)]
    order += [Action("B", rank, i) for i in range(m - warmup, m)]
    return order


def _interleaved_slot(k: int, rank: int, pp: int, v: int, backward: bool) -> tuple[int, int]:
    """(stage, micro-batch) of the k-th forward (or backward) of a rank in Megatron's interleaved order.

    Micro-batches go in groups of pp through chunk 0, then the same group through chunk 1, and so on;
    backwards visit the chunks in reverse.
    """
    chunk = (k // pp) % v
    if backward:
        chunk = v - 1 - chunk
    microbatch = (k // (pp * v)) * pp + k % pp
    return rank + chunk * pp, microbatch


def _interleaved(rank: int, pp: int, v: int, m: int) -> list[Action]:
    if m % pp != 0:
        raise ValueError(
            f"The interleaved 1F1B schedule needs the number of micro-batches ({m}) to be a multiple of"
            f" pipeline_parallel_size ({pp})."
        )
    total = m * v
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [Action("F", *_interleaved_slot(k, rank, pp, v, False)) for k in range(warmup)]
    for i in range(total - warmup):
        order.append(Action("F", *_interleaved_slot(warmup + i, rank, pp, v, False)))
        order.append(Action("B", *_interleaved_slot(i, rank, pp, v, True)))
    order += [Action("B", *_interleaved_slot(k, rank, pp, v, True)) for k in range(total - warmup, total)]
    return order


def _mark_epilogue(order: list[Action]) -> tuple[Action, ...]:
    last_forward = max((i for i, a in enumerate(order) if a.kind == "F"), default=-1)
    return tuple(
        Action(a.kind, a.stage, a.microbatch, epilogue=(a.kind == "B" and i > last_forward)) for i, a in enumerate(order)
    )


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


def check_schedule(orders: list[tuple[Action, ...]], num_stages: int) -> None:
    """Simulate the schedule with FIFO channels and blocking receives; raise if it deadlocks or misorders.

    Each rank executes its list in order; an F of stage s > 0 needs the activation of (s - 1, m), a B of a
    non-last stage needs the gradient of (s + 1, m), and each message must be the next one in its channel.
    """
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
                if 0 <= nxt < num_stages:
                    sent.setdefault((a.kind, a.stage % pp, nxt % pp), []).append((a.stage, a.microbatch))
                position[rank] += 1
                progress = True
    stuck = [r for r in range(pp) if position[r] < len(orders[r])]
    if stuck:
        raise ValueError(f"schedule deadlocks: ranks {stuck} blocked at {[orders[r][position[r]] for r in stuck]}")
