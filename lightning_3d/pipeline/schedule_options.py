"""The schedule options of a run (schedule name, pipeline size, virtual stages, micro-batch count) checked against
the schedule registry (``schedules.py``) before any process group exists: the constraints are each schedule's own
data (``ScheduleSpec``), so a registered schedule brings its checks with it. docs/extending.md.
"""

from __future__ import annotations

from lightning_3d.pipeline.schedules import schedule_spec


def resolve_schedule_options(schedule: str, pipeline_parallel_size: int, virtual_stages: int | None, num_microbatches: int) -> int:
    """Validate the pipeline schedule options before any process group exists; returns ``virtual_stages`` resolved
    (2 for an interleaved schedule unless given, else 1). Names and constraints come from the schedule registry."""
    spec = schedule_spec(schedule)
    for name, value in (("num_microbatches", num_microbatches), ("pipeline_parallel_size", pipeline_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}={value!r}` must be a positive integer.")
    if virtual_stages is None:
        virtual_stages = 2 if spec.interleaved else 1
    spec.check_interleaving(pipeline_parallel_size, virtual_stages)
    spec.check_microbatches(pipeline_parallel_size, num_microbatches)
    minimum = spec.min_microbatches(pipeline_parallel_size)
    if num_microbatches < minimum:
        raise ValueError(
            f"The {spec.title or schedule} schedule with num_microbatches={num_microbatches} < {minimum} at"
            f" pipeline_parallel_size={pipeline_parallel_size}: {spec.min_microbatches_reason or 'too few micro-batches'};"
            f" use at least {minimum} micro-batches."
        )
    return virtual_stages
