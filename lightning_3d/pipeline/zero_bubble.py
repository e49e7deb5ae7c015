"""Zero-bubble schedules: each backward split into B (input gradient) and W (weight gradients), W moved into bubbles.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): a stage's backward has two parts. B computes the gradient
of the stage's input, which the previous stage is waiting for; W computes the gradients of the stage's weights, which
nothing in the pipeline waits for until the optimizer step. Sending B's result first and running W later takes W off
the critical path, so the idle time of 1F1B's warm-up and drain, (pp - 1)(T_F + T_B + T_W) per rank, shrinks to
(pp - 1)(T_F + T_B - T_W): a third of it when the three parts cost the same.

Both schedules here keep the forwards and backwards of a 1F1B-family schedule in its order and insert the W's
(``defer_weights``): rank r keeps the W's of its r latest split backwards pending through the steady state (one W
after each F-B pair once r are pending), runs one W after each backward of the drain (filling the wait for the next
gradient) and ends with the W's still pending. Only backwards whose input gradient goes to another stage are split:
stage 0's goes nowhere, so its backward stays whole (splitting would only add work).

* ``zb_h1`` is the paper's ZB-H1: 1F1B's order. Rank r holds the activations of at most pp - r forwards plus r
  backwards awaiting their W: pp micro-batches, the peak of 1F1B's first rank.
* ``zb_interleaved`` is Megatron's interleaved 1F1B order (virtual_stages = v >= 2 looped chunks per rank) with the
  same deferral. Rank r holds at most min(m·v, 2(pp - 1 - r) + (v - 1)·pp + 1 + r) chunk activations: interleaved
  1F1B's warm-up plus one, plus r awaiting their W, never more than interleaved 1F1B's first rank (its peak). Deferring
  by 2r, which that peak would also allow, buys nothing at pp = 4 and loses at pp = 8 in the simulator (the last W's
  then pile up after the drain), hence r. Like interleaved 1F1B, it needs m to be a multiple of pp.

ZB-V (the paper's V-shaped placement: rank r holds chunks r and 2pp - 1 - r, so a micro-batch turns around on the last
rank and the first rank holds both the first and the last stage) is not offered: stage placement here is looped
(stage s on rank s % pp) in the schedule checker, the lockstep rounds, the exchange, the timed simulator, the stage
builder, the memory model and the tied-embedding sync (first and last stage on different ranks), so a V placement is a
change through all of them rather than one schedule file (docs/extending.md, "Split backwards").

docs/extending.md has the memory rule. torch's ``ScheduleInterleavedZeroBubble`` / ``ScheduleZBVZeroBubble`` use the
same split (``stage_backward_input`` / ``stage_backward_weight``); how this runtime splits a backward is in
``weight_grad.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from lightning_3d.pipeline.schedules import Action, ScheduleSpec, interleaved_1f1b, one_f_one_b, register_schedule


def defer_weights(order: Sequence[Action], keep: int) -> list[Action]:
    """``order`` (one rank's forwards and backwards of a 1F1B-family schedule: warm-up forwards, F-B pairs, drain
    backwards) with every backward of a stage > 0 split and its W inserted: at most ``keep`` W's pending through the
    steady state, one W after each backward of the drain, the rest at the end (module docstring)."""
    last_forward = max((i for i, a in enumerate(order) if a.kind == "F"), default=-1)
    out: list[Action] = []
    pending: deque[Action] = deque()

    def weight() -> None:
        b = pending.popleft()
        out.append(Action("W", b.stage, b.microbatch))

    for i, a in enumerate(order):
        out.append(Action(a.kind, a.stage, a.microbatch))  # the epilogue flag is set again by build_schedule
        if a.kind != "B":
            continue
        if a.stage > 0:  # stage 0's input gradient goes nowhere: its backward stays whole
            pending.append(a)
        if i > last_forward:  # the drain: a W fills the wait for the next gradient
            if pending:
                weight()
        else:
            while len(pending) > keep:
                weight()
    while pending:
        weight()
    return out


def _zb_h1(rank: int, pp: int, v: int, m: int) -> list[Action]:
    return defer_weights(one_f_one_b(rank, pp, v, m), keep=rank)


def _zb_interleaved(rank: int, pp: int, v: int, m: int) -> list[Action]:
    return defer_weights(interleaved_1f1b(rank, pp, v, m), keep=rank)


ZB_H1 = register_schedule(
    ScheduleSpec(
        "zb_h1",
        _zb_h1,
        title="ZB-H1 (zero bubble)",
        min_microbatches=lambda pp: pp,
        min_microbatches_reason="fewer leave stages idle most of the step (use schedule='gpipe' for fewer)",
        splits_backward=True,
    )
)
ZB_INTERLEAVED = register_schedule(
    ScheduleSpec(
        "zb_interleaved",
        _zb_interleaved,
        interleaved=True,
        # the forwards and backwards are interleaved 1F1B's, whose warm-up needs whole groups of pp micro-batches
        microbatch_multiple_of_pp=True,
        title="interleaved zero-bubble",
        splits_backward=True,
        single_stage_alternative="zb_h1",
    )
)
