"""The adaptive pipeline schedule (lightning_3d/dynamic/adaptive.py) on CPU: its lists pass the runtime's schedule
check at pp = 2 and 4 (one and two stages per rank), a hand-timed step where it beats 1F1B in the same order, the
memory budget on every rank, its place in the order search and the planner, and its errors. That every process
builds the same lists is part of tests/test_dynamic.py::test_every_process_derives_the_same_plan; training with it
against one process (GPT and T5, pp = 2) is part of tests/scenarios/multitask.py."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_3d.dynamic import plan_step
from lightning_3d.dynamic.adaptive import adaptive_orders, check_adaptive
from lightning_3d.dynamic.ordering import order_microbatches
from lightning_3d.dynamic.stage_costs import StageCosts
from lightning_3d.pipeline.schedules import Action, build_schedule, check_schedule
from lightning_3d.pipeline.timing import simulate
from tests.scenarios.dynamic_costs import T5_TINY, TINY, ToyCostModel


def long_tailed(num_stages: int, m: int, seed: int) -> StageCosts:
    """Per-stage costs of m micro-batches of long-tailed sizes (lognormal), backward twice the forward, activations
    in proportion to the size, a working set of a fifth of it."""
    size = np.random.default_rng(seed).lognormal(0.0, 1.0, m)
    stage = np.linspace(0.8, 1.2, num_stages)[:, None]  # stages a little unequal
    forward = stage * size
    return StageCosts(forward, 2 * forward, size * np.ones((num_stages, 1)), 0.2 * size * np.ones((num_stages, 1)))


def timed(orders, costs: StageCosts, num_stages: int):
    c = costs
    return simulate(orders, num_stages, lambda a: (c.forward if a.kind == "F" else c.backward)[a.stage, a.microbatch],
                    stored=lambda a: c.stored[a.stage, a.microbatch], transient=lambda a: c.transient[a.stage, a.microbatch])


@pytest.mark.parametrize("pp, v", [(2, 1), (4, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_adaptive_lists_pass_the_schedule_check_and_honour_the_budget(pp: int, v: int, m: int) -> None:
    num_stages = pp * v
    for seed in range(3):
        costs = long_tailed(num_stages, m, seed)
        # one micro-batch's reservation on a rank: its activations over the rank's v stages plus its working set
        alone = v * costs.stored.max() + costs.transient.max()
        for budget in (np.inf, 3 * alone, 1.5 * alone, alone):
            orders = adaptive_orders(costs.forward, costs.backward, costs.stored, costs.transient, pp, budget)
            check_schedule(list(orders), num_stages, m, train=True)  # what the runtime runs before any send
            assert all(a.stage % pp == r for r, order in enumerate(orders) for a in order)
            peak = timed(orders, costs, num_stages).peak_memory
            assert max(peak) <= budget * (1 + 1e-12), (pp, v, m, seed, budget, peak)


def test_a_hand_timed_step_where_the_adaptive_schedule_beats_1f1b_in_the_same_order() -> None:
    # pp = 2, equal stages; micro-batch 0 takes 4 time units per forward and per backward, 1, 2, 3 take 1 each;
    # activations as many bytes as units.
    size = np.array([4.0, 1.0, 1.0, 1.0])
    f = np.tile(size, (2, 1))
    costs = StageCosts(f, f.copy(), f.copy(), np.zeros_like(f))
    one_f_one_b = tuple(build_schedule("1f1b", 2, 1, 4, r) for r in range(2))
    # 1F1B: rank 0 F0 [0,4] F1 [4,5], then waits for B0's gradient; rank 1 F0 [4,8] B0 [8,12]; rank 0 B0 [12,16]
    # and only then F2 [16,17] (strict alternation), so rank 1 runs F1 [12,13] B1 [13,14], idles until F2 arrives
    # at 17: F2 [17,18] B2 [18,19]; rank 0 B1 [17,18] F3 [18,19] B2 [19,20]; rank 1 F3 [19,20] B3 [20,21]; rank 0
    # B3 [21,22]. Makespan 22.
    assert timed(one_f_one_b, costs, 2).makespan == 22.0
    # Adaptive with memory to spare: rank 0 runs every forward while no backward is ready (F0..F3 by 7), so rank 1
    # finds each next forward waiting: F0 [4,8] B0 [8,12] F1 [12,13] B1 [13,14] F2 [14,15] B2 [15,16] F3 [16,17]
    # B3 [17,18], and rank 0 runs B0 [12,16] B1 [16,17] B2 [17,18] B3 [18,19]. Makespan 19, rank 0 holding 7.
    orders = adaptive_orders(costs.forward, costs.backward, costs.stored, costs.transient, 2, 10.0)
    assert orders[0] == (Action("F", 0, 0), Action("F", 0, 1), Action("F", 0, 2), Action("F", 0, 3),
                         Action("B", 0, 0, True), Action("B", 0, 1, True), Action("B", 0, 2, True), Action("B", 0, 3, True))
    run = timed(orders, costs, 2)
    assert run.makespan == 19.0 and run.peak_memory == (7.0, 4.0)
    # With 5 units per rank only micro-batches 0 and 1 fit at once (as in 1F1B): F2 waits for B0 and B1 to free
    # rank 0 (B first), and the step takes 23; the order search then keeps 1F1B (22, peak 5).
    tight = adaptive_orders(costs.forward, costs.backward, costs.stored, costs.transient, 2, 5.0)
    run = timed(tight, costs, 2)
    assert run.makespan == 23.0 and max(run.peak_memory) == 5.0
    chosen = order_microbatches(costs, 2, 1, "1f1b", 5.0, seed=0)
    assert chosen.schedule == "1f1b" and chosen.timeline.makespan <= 22.0
    # The search in the same order with room: adaptive, 19 (or better, in another order).
    roomy = order_microbatches(costs, 2, 1, "1f1b", 10.0, seed=0, adaptive="only")
    assert roomy.schedule == "adaptive" and roomy.timeline.makespan <= 19.0


@pytest.mark.parametrize("pp, v, m, schedule", [(2, 1, 7, "1f1b"), (4, 1, 9, "1f1b"), (4, 1, 4, "1f1b"),
                                                (2, 2, 6, "interleaved_1f1b"), (4, 2, 8, "interleaved_1f1b")])
def test_the_order_search_keeps_the_adaptive_schedule_only_where_it_simulates_faster(pp, v, m, schedule) -> None:
    costs = long_tailed(pp * v, m, seed=m)
    budget = 4 * costs.stored.max() * v + costs.transient.max()
    off = order_microbatches(costs, pp, v, schedule, budget, seed=0, adaptive="off")
    auto = order_microbatches(costs, pp, v, schedule, budget, seed=0)
    only = order_microbatches(costs, pp, v, schedule, budget, seed=0, adaptive="only")
    assert off.schedule != "adaptive" and only.schedule == "adaptive"
    assert auto.timeline.makespan <= off.timeline.makespan
    if auto.schedule == "adaptive":
        assert auto.timeline.makespan < off.timeline.makespan or off.peak > budget
    for chosen in (auto, only):
        assert chosen.peak <= budget
        check_schedule(list(chosen.orders), pp * v, m, train=True)


def test_on_a_long_tailed_mix_the_search_picks_the_adaptive_schedule() -> None:
    # one long micro-batch among short ones, 4 stages: 1F1B's fixed warm-up leaves rank 0 waiting behind it
    size = np.array([6.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    f = np.tile(size, (4, 1))
    costs = StageCosts(f, 2 * f, f.copy(), np.zeros_like(f))
    off = order_microbatches(costs, 4, 1, "1f1b", 40.0, seed=0, adaptive="off")
    auto = order_microbatches(costs, 4, 1, "1f1b", 40.0, seed=0)
    assert auto.schedule == "adaptive" and auto.timeline.makespan < off.timeline.makespan
    assert auto.peak <= 40.0


def test_the_planner_runs_the_adaptive_schedule_within_memory_for_gpt_and_t5() -> None:
    rng = np.random.default_rng(3)
    lengths = np.minimum(rng.lognormal(3.5, 1.0, 48).astype(int) + 1, 256)
    for shape, targets in ((TINY, None), (T5_TINY, np.minimum(rng.lognormal(2.5, 0.8, 48).astype(int) + 1, 64))):
        for pp, v, schedule in ((2, 1, "1f1b"), (4, 1, "1f1b"), (2, 2, "interleaved_1f1b")):
            plan = plan_step(lengths, target_lengths=targets, cost_model=ToyCostModel(), shape=shape, dp=2, pp=pp,
                             virtual_stages=v, schedule=schedule, memory_budget=3e6, max_seq_len=256,
                             max_target_len=64, adaptive_schedule="only")
            for replica in plan.replicas:
                assert replica.schedule == "adaptive" and max(replica.peak_memory) <= 3e6
                check_schedule(list(replica.orders), pp * v, len(replica.microbatches), train=True)
            auto = plan_step(lengths, target_lengths=targets, cost_model=ToyCostModel(), shape=shape, dp=2, pp=pp,
                             virtual_stages=v, schedule=schedule, memory_budget=3e6, max_seq_len=256,
                             max_target_len=64)
            off = plan_step(lengths, target_lengths=targets, cost_model=ToyCostModel(), shape=shape, dp=2, pp=pp,
                            virtual_stages=v, schedule=schedule, memory_budget=3e6, max_seq_len=256,
                            max_target_len=64, adaptive_schedule="off")
            assert auto.makespan <= off.makespan * (1 + 1e-12)


def test_bad_adaptive_values_name_the_choices_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"adaptive_schedule='cyclic' is not a choice \('auto'.*'off'.*'only'"):
        check_adaptive("cyclic", "1f1b")
    with pytest.raises(ValueError, match="schedule='zb_h1': the adaptive schedule runs whole backwards"):
        plan_step([5, 6, 7, 8], cost_model=ToyCostModel(), shape=TINY, dp=1, pp=2, schedule="zb_h1",
                  memory_budget=1e9, adaptive_schedule="only")
    # "auto" leaves split-backward schedules as they are
    plan = plan_step([5, 6, 7, 8], cost_model=ToyCostModel(), shape=TINY, dp=1, pp=2, schedule="zb_h1",
                     memory_budget=1e9)
    assert plan.replicas[0].schedule != "adaptive"
    with pytest.raises(ValueError, match="adaptive_schedule=True is not a choice"):
        order_microbatches(long_tailed(2, 3, 0), 2, 1, "1f1b", 1e9, seed=0, adaptive=True)
