"""``DynamicMicroBatcher``: the data-loader end of dynamic micro-batching. Given one global batch of samples it plans
the step (``plan_step``) and returns this replica's micro-batches, collated to their planned shapes, as a
``MicroBatches`` list that carries the step's schedule (``orders``), which the strategy's runtime then runs.

It is a plain, picklable object, so it runs in DataLoader worker processes (as ``collate_fn`` with
``batch_size=global batch``, or mapped over batches): planning happens there, ``prefetch_factor`` steps ahead of
training, off the critical path. The step it returns (``PlannedMicroBatches``) crosses to the training process as one
buffer per dtype and carries ``planned_at`` for ``PlanWaits`` (``handoff.py``). Every replica loads the same global
batch and plans it identically (the plan is a
deterministic function of the lengths, the cost model and the seed), then keeps its own share: no communication, no
planning server (docs/dynamic.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from lightning_3d.costs.model import CostModel, ModelShape
from lightning_3d.dynamic.adaptive import check_adaptive
from lightning_3d.dynamic.choice import StepChoice, choose_step, parse_candidates
from lightning_3d.dynamic.consistency import RECOMPUTE_KEY
from lightning_3d.dynamic.handoff import PlannedMicroBatches
from lightning_3d.dynamic.packed_plan import check_packed_row_length
from lightning_3d.dynamic.plan import StepPlan, plan_step

Collate = Callable[[list[Any], int, "int | None"], Any]
CollatePacked = Callable[[list[list[Any]], int, "int | None"], Any]


def input_length(sample: Any) -> int:
    """Default length of a sample: its ``input_ids`` (a mapping) or the sample itself (a sequence)."""
    return len(sample["input_ids"]) if isinstance(sample, Mapping) else len(sample)


def labels_length(sample: Mapping[str, Any]) -> int:
    """A T5 sample's target length: its ``labels`` (pass as ``target_length``; a module-level function pickles into
    spawned workers, a lambda does not)."""
    return len(sample["labels"])


class DynamicMicroBatcher:
    """Plan a global batch and collate this replica's micro-batches (see the module docstring).

    ``collate(samples, seq_len, target_len)`` builds one micro-batch's tensors from its samples, padded to the planned
    lengths (padding labels ignored in the loss). ``dp_rank``: this replica (``trainer.strategy.
    distributed_sampler_kwargs["rank"]``). ``input_length`` / ``target_length``: a sample's lengths (T5: give
    ``target_length``). The other arguments are ``plan_step``'s; ``cost_model=None`` uses the analytic one.

    ``candidates``: choose per step among these micro-batchings (``choose_step``: ``"dynamic"``,
    ``"packed_dynamic"``, ``"packing@N"``, ``"token_budget@N"``) instead of always planning ``plan_step``'s; each
    step then carries ``choice`` (a ``StepChoice``: what ran, every candidate's prediction). Packed candidates need
    ``collate_packed(rows of samples, seq_len, target_len)`` (one micro-batch of packed rows with document ids) and
    ``max_seq_len`` (the row length); ``packed_attention`` is what the model runs for GPT's packed rows on its device
    (``"flex"`` or ``"dense"``), which decides their attention cost; ``packed_row_length`` is the packed_dynamic
    candidate's rows (``"fill"`` or ``"full"``, ``plan_packed_step``: full for a model that compiles its blocks).
    ``adaptive_schedule``: "auto" (the order search also tries the adaptive schedule and keeps it where it simulates
    faster), "off" or "only" (``plan_step``).
    """

    def __init__(
        self, collate: Collate, *, shape: ModelShape, dp: int, pp: int, dp_rank: int, memory_budget: float,
        cost_model: CostModel | None = None, virtual_stages: int = 1, schedule: str = "1f1b", round_to: int = 8,
        max_seq_len: int | None = None, max_target_len: int | None = None, tp: int = 1, seed: int = 0,
        layer_split: Sequence[int] | None = None, input_length: Callable[[Any], int] = input_length,
        target_length: Callable[[Any], int] | None = None, candidates: Sequence[str] | None = None,
        collate_packed: CollatePacked | None = None, packed_attention: str = "dense", adaptive_schedule: str = "auto",
        packed_row_length: str = "fill",
    ) -> None:
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp={dp}).")
        check_adaptive(adaptive_schedule, schedule)
        self.candidates = tuple(candidates) if candidates is not None else None
        if self.candidates is not None:
            if max_seq_len is None or (target_length is not None and max_target_len is None):
                raise ValueError("candidates need max_seq_len (and max_target_len for targets): packed rows and token"
                                 " budgets are sized by the model's lengths.")
            parsed = parse_candidates(self.candidates, max_seq_len + (max_target_len or 0))
            if collate_packed is None and any(kind in ("packing", "packed_dynamic") for kind, _ in parsed):
                raise ValueError(f"candidates={list(self.candidates)} include packed rows: pass collate_packed (rows of"
                                 " samples -> one micro-batch with document ids).")
            if packed_attention not in ("flex", "dense"):
                raise ValueError(f"packed_attention={packed_attention!r}: use 'flex' (FlexAttention's block mask) or"
                                 " 'dense' (SDPA's dense document mask), what the model runs for packed rows.")
        self.collate_packed, self.packed_attention = collate_packed, packed_attention
        self.packed_row_length = check_packed_row_length(packed_row_length)
        self.collate = collate
        self.dp_rank = dp_rank
        self.input_length, self.target_length = input_length, target_length
        self.options = dict(
            shape=shape, dp=dp, pp=pp, memory_budget=memory_budget, cost_model=cost_model,
            virtual_stages=virtual_stages, schedule=schedule, round_to=round_to, max_seq_len=max_seq_len,
            max_target_len=max_target_len, tp=tp, seed=seed, layer_split=layer_split, adaptive_schedule=adaptive_schedule,
        )

    def plan(self, samples: Sequence[Any]) -> StepPlan:
        """The step's plan for every replica (the same on every rank)."""
        targets = [self.target_length(s) for s in samples] if self.target_length is not None else None
        return plan_step([self.input_length(s) for s in samples], target_lengths=targets, **self.options)

    def choose(self, samples: Sequence[Any]) -> StepChoice:
        """The step's choice among ``candidates`` (the same on every rank)."""
        targets = [self.target_length(s) for s in samples] if self.target_length is not None else None
        return choose_step([self.input_length(s) for s in samples], target_lengths=targets, candidates=self.candidates,
                           packed_attention=self.packed_attention, packed_row_length=self.packed_row_length,
                           **self.options)

    def __call__(self, samples: Sequence[Any]) -> PlannedMicroBatches:
        samples = list(samples)
        choice = self.choose(samples) if self.candidates is not None else None
        plan = choice.plan if choice is not None else self.plan(samples)
        mine = plan.replicas[self.dp_rank]
        batches = [self.collate_packed([[samples[i] for i in row] for row in mb.rows], mb.seq_len, mb.target_len)
                   if mb.rows is not None else self.collate([samples[i] for i in mb.samples], mb.seq_len, mb.target_len)
                   for mb in mine.microbatches]
        for mb, batch in zip(mine.microbatches, batches):
            if mb.recompute:  # only then: absent, the model's own setting holds (docs/dynamic.md)
                if not isinstance(batch, MutableMapping):
                    raise TypeError(
                        f"The plan recomputes activations (memory_budget={self.options['memory_budget']:.4g} bytes needs"
                        f" it), which reaches the model as the micro-batch key {RECOMPUTE_KEY!r}, but collate returned a"
                        f" {type(batch).__name__}: return a dict from collate, or raise memory_budget."
                    )
                batch[RECOMPUTE_KEY] = True
        out = PlannedMicroBatches(batches, orders=mine.orders)
        out.plan = plan  # for logging and tests; the runtime reads only the list and ``orders``
        out.choice = choice  # what ran and every candidate's prediction (``PlanWaits`` records it per step)
        out.planned_at = time.monotonic()  # when the step was ready (``PlanWaits`` compares it with the request)
        return out
