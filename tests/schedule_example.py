"""A test-only pipeline schedule, written as a user would add one: this file plus one registry line.

"Reverse GPipe": every forward in micro-batch order, then every backward in reverse micro-batch order (the last
micro-batch's activations, the freshest, are freed first). Its builder returns one pipeline rank's action list; the
simulator (``check_schedule``) proves it deadlock-free and complete, and the strategy accepts it by name once
registered::

    from lightning_3d.pipeline import register_schedule
    from tests.schedule_example import REVERSE_GPIPE

    register_schedule(REVERSE_GPIPE)  # in every process, before the strategy is built
    Compressed3DStrategy(pipeline_parallel_size=2, schedule="reverse_gpipe")

Used by tests/test_schedules.py (simulator, every pp and micro-batch count) and tests/scenarios/layouts.py (trains
exactly like one process at pp = 2). See docs/extending.md.
"""

from __future__ import annotations

from lightning_3d.pipeline import Action, ScheduleSpec


def reverse_gpipe(rank: int, pp: int, virtual_stages: int, num_microbatches: int) -> list[Action]:
    """One stage per rank (not interleaved): F of micro-batches 0..m-1, then B of m-1..0. Every rank reverses the
    same sequence, so each gradient channel delivers in the order its receiver consumes."""
    forwards = [Action("F", rank, i) for i in range(num_microbatches)]
    return forwards + [Action("B", rank, i) for i in reversed(range(num_microbatches))]


REVERSE_GPIPE = ScheduleSpec("reverse_gpipe", reverse_gpipe, title="reverse GPipe")
