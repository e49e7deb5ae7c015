"""``choose_step``: per global batch, the cheapest of several micro-batchings under one cost model.

Candidates (docs/dynamic.md, "Choosing per step"): ``dynamic`` (``plan_step``, DynaPipe's partition of padded
samples), ``packed_dynamic`` (``plan_packed_step``: the same partition over packed rows), ``packing@N`` (each
replica's share packed first-fit-decreasing into rows of ``max_seq_len`` tokens, N rows per micro-batch, as the
data module's ``packing`` runs it) and ``token_budget@N`` (each replica's share sorted by length and grouped while a
micro-batch holds at most N padded tokens, as ``token_budget`` runs it). Every candidate is costed the same way:
per-stage times and memory of each of its micro-batches from the cost model (packed rows as what their attention
computes, ``packed.py``), the pipeline simulated under the schedule it will run (the dynamic ones: their searched
orders; the fixed ones: the named schedule in their own order), the step's time the slowest replica's makespan. A
candidate whose simulated peak memory exceeds the budget on any rank is out. The cheapest wins, ties to the earlier
candidate in the list. Like ``plan_step`` this is a pure function of the lengths, the cost model, the layout and
the seed, so every rank chooses the same without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_3d.costs.model import CostModel, ModelShape
from lightning_3d.dynamic.adaptive import check_adaptive
from lightning_3d.dynamic.packed import attention_ratio, dense_mask_bytes, first_fit_decreasing, packed_groups_to_multiple
from lightning_3d.dynamic.packed_plan import check_packed_row_length, plan_packed_step
from lightning_3d.dynamic.plan import (
    MicroBatchPlan,
    ReplicaPlan,
    StepPlan,
    check_layout,
    check_sample_lengths,
    default_cost_model,
    plan_step,
)
from lightning_3d.dynamic.stage_costs import StageCosts, evaluate, stage_layers
from lightning_3d.pipeline.schedules import build_schedule, schedule_spec
from lightning_3d.pipeline.timing import simulate

KINDS = ("dynamic", "packed_dynamic", "packing", "token_budget")


@dataclass(frozen=True)
class StepChoice:
    """What ran and why: ``chosen`` (a candidate's name), its ``plan``, and ``predicted``: every candidate's
    simulated step seconds (``inf`` where it does not fit the memory budget; ``refused`` says why)."""

    chosen: str
    plan: StepPlan
    predicted: dict[str, float]
    refused: dict[str, str]


def default_candidates(longest: int) -> tuple[str, ...]:
    """The candidates ``microbatching="auto"`` compares when none are given: both dynamic partitions, packing at 1,
    2, 4, 8, 16 and 32 rows per micro-batch, token budgets of 1, 2, 4, 8 and 16 times the longest sample
    (``longest``: the model's sequence length, plus the target length for T5). The larger sizes are there for short
    rows and compiled blocks, whose best fixed batching can be that large; the memory budget refuses those that do
    not fit, and pricing a fixed candidate is cheap next to the dynamic searches."""
    return ("dynamic", "packed_dynamic", *(f"packing@{n}" for n in (1, 2, 4, 8, 16, 32)),
            *(f"token_budget@{k * longest}" for k in (1, 2, 4, 8, 16)))


def parse_candidates(names: Sequence[str], longest: int) -> tuple[tuple[str, int | None], ...]:
    """``("dynamic", "packing@2", ...)`` as (kind, size) pairs; ValueError naming the bad entry and the fix.
    ``longest``: the longest possible sample (a token budget below it cannot hold that sample)."""
    if isinstance(names, str) or not names:
        raise ValueError(f"candidates={names!r}: give a non-empty list such as ['dynamic', 'packing@2',"
                         f" 'token_budget@{2 * longest}'].")
    out = []
    for name in names:
        kind, _, size = str(name).partition("@")
        if kind not in KINDS:
            raise ValueError(f"candidate {name!r}: use one of dynamic, packed_dynamic, packing@N (N rows per"
                             " micro-batch) or token_budget@N (N padded tokens per micro-batch).")
        if kind in ("dynamic", "packed_dynamic"):
            if size:
                raise ValueError(f"candidate {name!r}: {kind} takes no size (its cost model sizes its micro-batches).")
            out.append((kind, None))
            continue
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"candidate {name!r}: {kind} needs a positive size after @, e.g. {kind}@2.")
        if kind == "token_budget" and int(size) < longest:
            raise ValueError(f"candidate {name!r}: a token budget below the longest sample ({longest} tokens) cannot"
                             f" hold it; use token_budget@{longest} or more.")
        out.append((kind, int(size)))
    if len({k for k in out}) != len(out):
        raise ValueError(f"candidates={list(names)!r} names a candidate twice; list each once.")
    return tuple(out)


def token_budget_groups(lengths: Sequence[tuple[int, int]], budget: int) -> list[list[int]]:
    """Samples sorted by length (longest first, ties by position) and grouped greedily while the padded micro-batch
    holds at most ``budget`` tokens: ``count x (longest input + longest target)``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i][0], -lengths[i][1], i))
    groups: list[list[int]] = []
    for i in order:
        if sum(lengths[i]) > budget:
            raise ValueError(f"A sample of {lengths[i][0]} + {lengths[i][1]} tokens does not fit token_budget={budget};"
                             f" raise token_budget to at least {sum(lengths[i])}.")
        if groups:
            group = groups[-1] + [i]
            if len(group) * (max(lengths[j][0] for j in group) + max(lengths[j][1] for j in group)) <= budget:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def choose_step(
    input_lengths: Sequence[int], *, target_lengths: Sequence[int] | None = None, candidates: Sequence[str],
    cost_model: CostModel | None = None, shape: ModelShape, dp: int, pp: int, virtual_stages: int = 1,
    schedule: str = "1f1b", memory_budget: float, round_to: int = 8, max_seq_len: int, max_target_len: int | None = None,
    tp: int = 1, seed: int = 0, layer_split: Sequence[int] | None = None, packed_attention: str = "dense",
    adaptive_schedule: str = "auto", packed_row_length: str = "fill",
) -> StepChoice:
    """The cheapest candidate for one global batch (module docstring). ``packed_attention``: what GPT's packed rows
    run on the device (``"flex"`` or ``"dense"``); ``packed_row_length``: the packed_dynamic candidate's rows
    (``plan_packed_step``; the packing candidates' rows are always full); ``adaptive_schedule`` applies to the dynamic candidates' order
    search (``plan_step``), the fixed ones run the named schedule. Raises ValueError, naming every candidate's reason, when none
    fits the memory budget."""
    targets = target_lengths is not None
    longest = max_seq_len + ((max_target_len or 0) if targets else 0)
    parsed = parse_candidates(candidates, longest)
    check_packed_row_length(packed_row_length)
    inputs, tgts = check_sample_lengths(input_lengths, target_lengths, max_seq_len, max_target_len)
    check_layout(len(inputs), dp, pp, virtual_stages, schedule, memory_budget, round_to)
    check_adaptive(adaptive_schedule, schedule)
    cost_model = cost_model if cost_model is not None else default_cost_model(shape)
    common = dict(target_lengths=target_lengths, cost_model=cost_model, shape=shape, dp=dp, pp=pp,
                  virtual_stages=virtual_stages, schedule=schedule, memory_budget=memory_budget, round_to=round_to,
                  max_seq_len=max_seq_len, max_target_len=max_target_len, tp=tp, seed=seed, layer_split=layer_split,
                  adaptive_schedule=adaptive_schedule)
    layout = Layout(cost_model, stage_layers(shape, pp * virtual_stages, layer_split), shape.family == "gpt", pp,
                     virtual_stages, schedule, tp, memory_budget, packed_attention)
    predicted, refused, plans = {}, {}, {}
    for kind, size in parsed:
        name = kind if size is None else f"{kind}@{size}"
        try:
            if kind == "dynamic":
                plan = plan_step(input_lengths, **common)
            elif kind == "packed_dynamic":
                plan = plan_packed_step(input_lengths, packed_attention=packed_attention,
                                        packed_row_length=packed_row_length, **common)
            else:
                plan = _fixed(kind, size, inputs, tgts, dp, max_seq_len, max_target_len, layout)
        except ValueError as err:
            predicted[name], refused[name] = float("inf"), str(err)
            continue
        predicted[name], plans[name] = plan.makespan, plan
    if not plans:
        reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
        raise ValueError(f"No micro-batching candidate fits memory_budget={memory_budget:.4g} bytes ({reasons}). Raise"
                         " the memory budget, shorten the samples or use more pipeline or tensor parallelism.")
    chosen = min(plans, key=lambda name: predicted[name])  # dicts keep the list's order: ties go to the earlier
    return StepChoice(chosen, plans[chosen], predicted, refused)


@dataclass(frozen=True)
class Layout:
    """How micro-batches are costed: the cost model, the stages' layers and the layout they run under."""

    cost_model: CostModel
    stages: list
    gpt: bool
    pp: int
    v: int
    schedule: str
    tp: int
    budget: float
    attention: str


def _fixed(kind: str, size: int, inputs: np.ndarray, targets: np.ndarray | None, dp: int, max_seq_len: int,
           max_target_len: int | None, layout: Layout) -> StepPlan:
    """A fixed micro-batching as the data module runs it: replica r takes samples r, r + dp, ...; its micro-batches in
    their own order under the named schedule."""
    replicas = []
    for r in range(dp):
        share = list(range(r, len(inputs), dp))
        lengths = [(int(inputs[i]), int(targets[i]) if targets is not None else 0) for i in share]
        if kind == "packing":
            rows = [[share[i] for i in row] for row in first_fit_decreasing(lengths, (max_seq_len, max_target_len or 0))]
            groups = [rows[k : k + size] for k in range(0, len(rows), size)]
            if schedule_spec(layout.schedule).microbatch_multiple_of_pp:  # as the data module splits them
                tokens = inputs + (targets if targets is not None else 0)
                try:
                    groups = packed_groups_to_multiple(groups, tokens, layout.pp)
                except ValueError as err:
                    raise ValueError(f"schedule={layout.schedule!r} needs a multiple of {layout.pp} micro-batches per"
                                     f" replica: {err}") from None
            mbs = [MicroBatchPlan(tuple(i for row in group for i in row), max_seq_len,
                                  max_target_len if targets is not None else None, False, tuple(map(tuple, group)))
                   for group in groups]
        else:
            mbs = _to_multiple([MicroBatchPlan(tuple(share[i] for i in g), max(lengths[i][0] for i in g),
                                               max(lengths[i][1] for i in g) if targets is not None else None, False)
                                for g in token_budget_groups(lengths, size)], layout)
        replicas.append(_simulated(mbs, inputs, layout))
    makespan = max(p.makespan for p in replicas)
    peak = max(max(p.peak_memory) for p in replicas)
    if peak > layout.budget:
        raise ValueError(f"its simulated peak of {peak:.4g} bytes of activations exceeds memory_budget="
                         f"{layout.budget:.4g}.")
    return StepPlan(tuple(replicas), makespan, peak, makespan, False,
                    str(getattr(layout.cost_model, "source", type(layout.cost_model).__name__)))


def _to_multiple(mbs: list[MicroBatchPlan], layout: Layout) -> list[MicroBatchPlan]:
    """Interleaved schedules need a multiple of pp micro-batches: halve the padded micro-batch of most samples (the
    data module's ``split_to_multiple``; packed ones go through ``packed_groups_to_multiple``)."""
    if not schedule_spec(layout.schedule).microbatch_multiple_of_pp:
        return mbs
    while len(mbs) % layout.pp:
        big = max(range(len(mbs)), key=lambda k: (len(mbs[k].samples), -k))
        mb = mbs[big]
        if len(mb.samples) < 2:
            raise ValueError(f"schedule={layout.schedule!r} needs a multiple of {layout.pp} micro-batches per replica and"
                             " every micro-batch holds one row.")
        half = len(mb.samples) // 2
        mbs[big : big + 1] = [MicroBatchPlan(p, mb.seq_len, mb.target_len, False)
                              for p in (mb.samples[:half], mb.samples[half:])]
    return mbs


def _rows(mb: MicroBatchPlan) -> int:
    return len(mb.rows) if mb.rows is not None else len(mb.samples)


def microbatch_costs(mbs: Sequence[MicroBatchPlan], inputs: np.ndarray, layout: Layout) -> StageCosts:
    """Per-stage costs of the given micro-batches (padded samples or packed rows), one column each."""
    size = np.array([_rows(mb) for mb in mbs], dtype=np.float64)
    seq = np.array([mb.seq_len for mb in mbs], dtype=np.float64)
    target = np.array([mb.target_len for mb in mbs], dtype=np.float64) if mbs[0].target_len is not None else None
    packed = [mb.rows is not None for mb in mbs]
    ratio = mask = None
    if layout.gpt and any(packed):
        ratio = np.array([attention_ratio([[int(inputs[i]) for i in row] for row in mb.rows], mb.seq_len,
                                          layout.attention) if mb.rows is not None else 1.0 for mb in mbs])
        if layout.attention == "dense":
            mask = np.where(packed, dense_mask_bytes(size, seq), 0.0)
    return evaluate(layout.cost_model, layout.stages, size, seq, target, recompute=False, tp=layout.tp,
                    attention_ratio=ratio, mask_bytes=mask)


def _simulated(mbs: list[MicroBatchPlan], inputs: np.ndarray, layout: Layout) -> ReplicaPlan:
    costs = microbatch_costs(mbs, inputs, layout)
    m, stages = len(mbs), layout.pp * layout.v
    orders = tuple(build_schedule(layout.schedule, layout.pp, layout.v, m, r) for r in range(layout.pp))
    timeline = simulate(orders, stages, lambda a: (costs.forward if a.kind == "F" else costs.backward)[a.stage, a.microbatch],
                        stored=lambda a: costs.stored[a.stage, a.microbatch],
                        transient=lambda a: costs.transient[a.stage, a.microbatch], check=False)
    return ReplicaPlan(tuple(mbs), orders, timeline.makespan, timeline.peak_memory, layout.schedule)
