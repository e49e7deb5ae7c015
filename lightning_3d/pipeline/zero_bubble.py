"""Zero-bubble schedules: each backward split into B (input gradient) and W (weight gradients), W moved into bubbles.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): a stage's backward has two parts. B computes the gradient
of the stage's input, which the previous stage is waiting for; W computes the gradients of the stage's weights, which
nothing in the pipeline waits for until the optimizer step. Sending B's result first and running W later takes W off
the critical path, so the idle time of 1F1B's warm-up and drain, (pp - 1)(T_F + T_B + T_W) per rank, shrinks to
(pp - 1)(T_F + T_B - T_W): a third of it when the three parts cost the same.

``zb_h1`` is the paper's ZB-H1, 1F1B's order with W deferred on rank r by r micro-batches: rank r runs the same
warm-up forwards as 1F1B (pp - r - 1), then F, B and (from the r-th pair on) the oldest pending W, drains with B
and W alternating, and ends with the W's still pending. Rank r thus holds the activations of at most pp - r forwards
plus r backwards awaiting their W: pp micro-batches, the peak of 1F1B's first rank (docs/extending.md has the
memory rule). Stage 0's input gradient goes nowhere, so rank 0 keeps its backwards whole. torch's
``ScheduleInterleavedZeroBubble`` / ``ScheduleZBVZeroBubble`` use the same split (``stage_backward_input`` /
``stage_backward_weight``); how this runtime splits a backward is in ``weight_grad.py``.
"""

from __future__ import annotations

from collections import deque

from lightning_3d.pipeline.schedules import Action, ScheduleSpec, register_schedule


def _zb_h1(rank: int, pp: int, v: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    order = [Action("F", rank, i) for i in range(warmup)]
    pending: deque[int] = deque()

    def backward(i: int) -> None:
        order.append(Action("B", rank, i))
        if rank > 0:  # on rank 0 nothing waits for B's result: splitting would only add work
            pending.append(i)

    for i in range(m - warmup):
        order.append(Action("F", rank, warmup + i))
        backward(i)
        if i >= rank and pending:  # W deferred by `rank` micro-batches in the steady state
            order.append(Action("W", rank, pending.popleft()))
    for i in range(m - warmup, m):  # the drain: a W fills the wait for the next gradient
        backward(i)
        if pending:
            order.append(Action("W", rank, pending.popleft()))
    order += [Action("W", rank, i) for i in pending]
    return order


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
