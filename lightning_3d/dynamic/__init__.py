"""Dynamic micro-batching (DynaPipe-style) for variable-length and multi-task data: each global batch is cut into
micro-batches of different sizes and lengths by a dynamic program over a cost model, balanced over data-parallel
replicas and ordered in a memory-aware pipeline schedule checked by the timed simulator. docs/dynamic.md explains
the design and when to use it; ``DynamicMicroBatcher`` is the data-loader entry point, ``plan_step`` the planner,
``plan_packed_step`` the planner over packed rows and ``choose_step`` the per-step choice among micro-batchings.
"""

from lightning_3d.dynamic.batcher import DynamicMicroBatcher, input_length, labels_length
from lightning_3d.dynamic.choice import StepChoice, choose_step, default_candidates
from lightning_3d.dynamic.consistency import RECOMPUTE_KEY, check_same_plan, plan_digest, with_microbatch_checkpointing
from lightning_3d.dynamic.handoff import PlannedMicroBatches, PlanWaits, background
from lightning_3d.dynamic.packed_plan import plan_packed_step
from lightning_3d.dynamic.plan import MicroBatchPlan, ReplicaPlan, StepPlan, default_cost_model, plan_step

__all__ = [
    "RECOMPUTE_KEY", "DynamicMicroBatcher", "MicroBatchPlan", "PlanWaits", "PlannedMicroBatches", "ReplicaPlan",
    "StepChoice", "StepPlan", "background", "check_same_plan", "choose_step", "default_candidates", "default_cost_model",
    "input_length", "labels_length", "plan_digest", "plan_packed_step", "plan_step", "with_microbatch_checkpointing",
]
