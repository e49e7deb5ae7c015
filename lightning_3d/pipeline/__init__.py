"""Pipeline schedules and their execution with variable micro-batch shapes and counts."""

from lightning_3d.pipeline import zero_bubble  # noqa: F401  (registers the zero-bubble schedules)
from lightning_3d.pipeline.codec import BoundaryKey, GradientCodec, IdentityCodec
from lightning_3d.pipeline.microbatch import MicroBatches, split_batch
from lightning_3d.pipeline.schedules import Action, ScheduleSpec, build_forward_only, build_schedule, check_schedule, register_schedule

__all__ = [
    "Action", "BoundaryKey", "GradientCodec", "IdentityCodec", "MicroBatches", "ScheduleSpec",
    "build_forward_only", "build_schedule", "check_schedule", "register_schedule", "split_batch",
]
