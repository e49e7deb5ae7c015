"""Dynamic micro-batching's planner on CPU: the partition against brute force, replica balancing, the simulated
schedules of the plans, determinism across processes, recomputation, and the errors for bad inputs."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lightning_3d.dynamic import plan_step
from lightning_3d.dynamic.ordering import in_flight, limited_1f1b, order_microbatches
from lightning_3d.dynamic.partition import NoPartition, best_partition, karmarkar_karp, objective, range_shapes, round_up, sample_order
from lightning_3d.dynamic.stage_costs import evaluate, stage_layers
from lightning_3d.pipeline.schedules import build_schedule, check_schedule
from lightning_3d.pipeline.timing import simulate
from tests.launch import ROOT
from tests.scenarios.dynamic_costs import T5_TINY, TINY, ToyCostModel

TOY = ToyCostModel()


def brute_force(time: np.ndarray, pp: int, v: int, dp: int) -> float:
    """The best objective over all 2^(n-1) partitions of the order into contiguous ranges of finite time."""
    n = time.shape[0]
    best = np.inf
    for mask in range(1 << (n - 1)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        if all(np.isfinite(time[a, b]) for a, b in zip(cuts[:-1], cuts[1:])):
            best = min(best, objective(time, cuts, pp, v, dp))
    return best


def toy_time(lengths, limit: float, pp: int = 2, targets=None) -> np.ndarray:
    """The (start, stop) time matrix the planner builds for the ordered samples, with ranges over ``limit`` bytes
    (per stage, stored + transient) made infeasible."""
    order = sample_order(round_up(lengths, 8), round_up(targets, 8) if targets is not None else None)
    rin = round_up(np.asarray(lengths)[order], 8)
    rtg = round_up(np.asarray(targets)[order], 8) if targets is not None else None
    size, seq, tgt = range_shapes(rin, rtg)
    s, e = np.nonzero(size)
    shape = T5_TINY if targets is not None else TINY
    c = evaluate(TOY, stage_layers(shape, pp), size[s, e], seq[s, e], tgt[s, e] if tgt is not None else None,
                 recompute=False, tp=1)
    t = (c.forward + c.backward).max(axis=0)
    fits = (c.stored + c.transient).max(axis=0) <= limit
    time = np.full(size.shape, np.inf)
    time[s[fits], e[fits]] = t[fits]
    return time


@pytest.mark.parametrize("seed", range(6))
def test_partition_equals_brute_force_on_small_batches(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 13))
    pp, v, dp = int(rng.integers(1, 5)), int(rng.integers(1, 3)), int(rng.integers(1, 4))
    # long-tailed lengths, some memory limit that excludes the longest ranges
    lengths = np.minimum(rng.lognormal(3, 1, n).astype(int) + 1, 512)
    targets = rng.integers(1, 64, n) if seed % 2 else None
    time = toy_time(lengths, limit=float(rng.uniform(2e5, 2e6)), targets=targets)
    if not np.isfinite(brute_force(time, pp, v, dp)):  # a sample fits no micro-batch: the program says so too
        with pytest.raises(NoPartition):
            best_partition(time, pp, v, dp)
        time = toy_time(lengths, limit=np.inf, targets=targets)
    cuts, estimate = best_partition(time, pp, v, dp)
    assert cuts[0] == 0 and cuts[-1] == n and all(np.isfinite(time[a, b]) for a, b in zip(cuts[:-1], cuts[1:]))
    assert estimate == pytest.approx(brute_force(time, pp, v, dp), rel=1e-12)
    # random cost matrices with random infeasible ranges (no structure for the program to rely on)
    random = rng.uniform(1, 10, (n, n + 1)) * (np.arange(n + 1)[None, :] - np.arange(n)[:, None]).clip(0)
    random[(random == 0) | (rng.uniform(size=random.shape) < 0.3)] = np.inf
    random[np.arange(n), np.arange(n) + 1] = rng.uniform(1, 10, n)  # every sample fits on its own
    assert best_partition(random, pp, v, dp)[1] == pytest.approx(brute_force(random, pp, v, dp), rel=1e-12)


def test_karmarkar_karp_balances_and_covers_every_microbatch() -> None:
    groups = karmarkar_karp([4, 5, 6, 7, 8], 2)
    assert sorted(sum(([4, 5, 6, 7, 8][i] for i in g), 0) for g in groups) == [15, 15]  # the optimum, KK alone: 14 / 16
    rng = np.random.default_rng(0)
    for _ in range(20):
        costs = rng.lognormal(0, 1, int(rng.integers(3, 9))).tolist()
        k = int(rng.integers(2, min(4, len(costs)) + 1))
        groups = karmarkar_karp(costs, k)
        assert sorted(i for g in groups for i in g) == list(range(len(costs))) and all(groups)
        best = min(max(sum(costs[i] for i in range(len(costs)) if a[i] == j) for j in range(k))
                   for a in itertools.product(range(k), repeat=len(costs)))
        assert max(sum(costs[i] for i in g) for g in groups) <= 4 / 3 * best + 1e-12  # LPT's bound, met on these
    assert karmarkar_karp(costs, 2) == karmarkar_karp(costs, 2)


def lengths_batch(seed: int, n: int = 48, cap: int = 256) -> np.ndarray:
    return np.minimum(np.random.default_rng(seed).lognormal(3.5, 1.0, n).astype(int) + 1, cap)


@pytest.mark.parametrize("layout", [dict(dp=2, pp=2), dict(dp=3, pp=1), dict(dp=1, pp=4),
                                    dict(dp=2, pp=2, virtual_stages=2, schedule="interleaved_1f1b")])
def test_plans_cover_every_sample_once_and_their_schedules_simulate_within_memory(layout: dict) -> None:
    lengths = lengths_batch(1)
    budget = 4e6
    plan = plan_step(lengths, cost_model=TOY, shape=TINY, memory_budget=budget, max_seq_len=256, **layout)
    pp, v = layout["pp"], layout.get("virtual_stages", 1)
    assert len(plan.replicas) == layout["dp"]
    seen = sorted(i for r in plan.replicas for mb in r.microbatches for i in mb.samples)
    assert seen == list(range(len(lengths)))
    stages = stage_layers(TINY, pp * v)
    for replica in plan.replicas:
        m = len(replica.microbatches)
        assert m >= 1 and (v == 1 or m % pp == 0)
        for mb in replica.microbatches:
            assert mb.seq_len % 8 == 0 and mb.seq_len >= max(lengths[list(mb.samples)]) and not mb.recompute
        check_schedule(list(replica.orders), pp * v, m, train=True)
        c = evaluate(TOY, stages, np.array([len(mb.samples) for mb in replica.microbatches]),
                     np.array([mb.seq_len for mb in replica.microbatches]), None, recompute=False, tp=1)
        timeline = simulate(replica.orders, pp * v, lambda a: (c.forward if a.kind == "F" else c.backward)[a.stage, a.microbatch],
                            stored=lambda a: c.stored[a.stage, a.microbatch], transient=lambda a: c.transient[a.stage, a.microbatch])
        assert timeline.makespan == pytest.approx(replica.makespan) and timeline.peak_memory == pytest.approx(replica.peak_memory)
        assert max(timeline.peak_memory) <= budget
    assert plan.makespan == max(r.makespan for r in plan.replicas)
    if layout["dp"] > 1:  # unequal token counts across replicas are expected and handled by the runtime
        assert len({sum(lengths[list(mb.samples)].sum() for mb in r.microbatches) for r in plan.replicas}) > 1


def test_dynamic_plans_beat_padding_the_whole_batch() -> None:
    lengths = lengths_batch(2, n=64)
    plan = plan_step(lengths, cost_model=TOY, shape=TINY, dp=1, pp=2, memory_budget=1e12, max_seq_len=256)
    padded = plan_step([int(lengths.max())] * len(lengths), cost_model=TOY, shape=TINY, dp=1, pp=2, memory_budget=1e12)
    assert plan.makespan < padded.makespan / 1.5
    assert len({mb.seq_len for mb in plan.replicas[0].microbatches}) > 1


def test_the_order_search_finds_the_best_order_of_a_small_step() -> None:
    # five micro-batches of very different sizes over a 3-stage 1F1B pipeline: every permutation simulated
    sizes, seqs = np.array([1, 4, 2, 8, 3]), np.array([256, 32, 128, 16, 64])
    c = evaluate(TOY, stage_layers(TINY, 3), sizes, seqs, None, recompute=False, tp=1)
    chosen = order_microbatches(c, 3, 1, "1f1b", memory_budget=np.inf, seed=0)
    orders = tuple(build_schedule("1f1b", 3, 1, 5, r) for r in range(3))

    def makespan(perm):
        return simulate(orders, 3, lambda a: (c.forward if a.kind == "F" else c.backward)[a.stage, perm[a.microbatch]]).makespan

    best = min(makespan(p) for p in itertools.permutations(range(5)))
    assert chosen.timeline.makespan == pytest.approx(best)
    assert chosen.timeline.makespan < makespan(list(range(5)))  # the given order is not the best one
    # seven: candidates and pair swaps (no exhaustive search), still better than the given order
    sizes, seqs = np.array([1, 4, 2, 8, 3, 1, 2]), np.array([256, 32, 128, 16, 64, 128, 64])
    c = evaluate(TOY, stage_layers(TINY, 3), sizes, seqs, None, recompute=False, tp=1)
    chosen = order_microbatches(c, 3, 1, "1f1b", memory_budget=np.inf, seed=0)
    orders = tuple(build_schedule("1f1b", 3, 1, 7, r) for r in range(3))
    assert chosen.timeline.makespan < makespan(list(range(7)))


def test_tight_memory_cuts_smaller_microbatches_fewer_warmups_then_recomputation() -> None:
    lengths = lengths_batch(3)
    loose = plan_step(lengths, cost_model=TOY, shape=TINY, dp=1, pp=4, memory_budget=1e9, max_seq_len=256)
    tight = plan_step(lengths, cost_model=TOY, shape=TINY, dp=1, pp=4, memory_budget=2e6, max_seq_len=256)
    assert loose.peak_memory > 2e6 >= tight.peak_memory and not tight.recompute
    assert tight.makespan >= loose.makespan
    # one 256-token sample stores 2 x 256 x 1000 B per stage: 4 in flight on rank 0 need > 2 MB, a 1F1B with fewer
    # warm-up forwards or recomputation (a tenth of it stored) is needed
    assert in_flight("1f1b", 4, 1, 8) == (4, 3, 2, 1)
    assert in_flight("zb_h1", 4, 1, 8) == (4, 4, 4, 4)  # a split backward holds its activations until its W
    check_schedule(list(limited_1f1b(4, 6, 1)), 4, 6, train=True)
    squeezed = plan_step([256] * 8, cost_model=TOY, shape=TINY, dp=1, pp=4, memory_budget=1.6e6, max_seq_len=256)
    assert not squeezed.recompute and squeezed.peak_memory <= 1.6e6
    assert squeezed.replicas[0].orders != tuple(build_schedule("1f1b", 4, 1, 8, r) for r in range(4))
    rc = plan_step([256] * 8, cost_model=TOY, shape=TINY, dp=1, pp=4, memory_budget=7e5, max_seq_len=256)
    assert rc.recompute and all(mb.recompute for mb in rc.replicas[0].microbatches) and rc.peak_memory <= 7e5


def test_t5_samples_are_ordered_by_clusters_of_equal_rounded_lengths() -> None:
    inputs, targets = np.array([100, 9, 98, 10, 300, 12]), np.array([30, 2, 31, 3, 5, 4])
    order = sample_order(round_up(inputs, 8), round_up(targets, 8))
    # (16, 8) x3 from the smallest, then its nearest (104, 32) pair, then (304, 8)
    assert order.tolist() == [1, 3, 5, 0, 2, 4]


def test_t5_plans_pad_inputs_and_targets_separately() -> None:
    rng = np.random.default_rng(4)
    inputs, targets = rng.integers(1, 200, 24), rng.integers(1, 40, 24)
    plan = plan_step(inputs, target_lengths=targets, cost_model=TOY, shape=T5_TINY, dp=2, pp=2, memory_budget=1e7,
                     max_seq_len=200)
    for r in plan.replicas:
        for mb in r.microbatches:
            assert mb.target_len >= max(targets[list(mb.samples)]) and mb.target_len % 8 == 0
            assert mb.seq_len >= max(inputs[list(mb.samples)]) and mb.seq_len <= 200


PLAN_SCRIPT = """
import json, sys
import numpy as np
from lightning_3d.dynamic import plan_step
from tests.scenarios.dynamic_costs import TINY, ToyCostModel
lengths = np.minimum(np.random.default_rng(7).lognormal(3.5, 1.0, 96).astype(int) + 1, 256)
plans = [plan_step(lengths, cost_model=ToyCostModel(), shape=TINY, dp=2, pp=2, memory_budget=3e6, max_seq_len=256)]
# the adaptive schedule's lists (built from the plan's costs alone): one and two stages per rank
plans += [plan_step(lengths, cost_model=ToyCostModel(), shape=TINY, dp=1, pp=pp, virtual_stages=v, schedule=schedule,
                    memory_budget=3e6, max_seq_len=256, adaptive_schedule="only")
          for pp, v, schedule in ((4, 1, "1f1b"), (2, 2, "interleaved_1f1b"))]
assert all(r.schedule == "adaptive" for plan in plans[1:] for r in plan.replicas)
print(json.dumps([[[list(mb.samples), mb.seq_len] for mb in r.microbatches] + [repr(r.orders), r.makespan]
                  for plan in plans for r in plan.replicas]))
"""


def test_every_process_derives_the_same_plan() -> None:
    # another interpreter with another hash seed (and this one, whose hash seed is random) plan the same batch alike
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", PLAN_SCRIPT], env=env, capture_output=True, text=True, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    here = {}
    exec(PLAN_SCRIPT.replace("print(", "out = ("), here)  # noqa: S102 - our own constant script
    assert json.loads(result.stdout) == json.loads(here["out"])


@pytest.mark.parametrize("case, message", [
    (dict(input_lengths=[5, 0, 7]), "Sample 1 of the batch has input length 0"),
    (dict(input_lengths=[5, 300, 7], max_seq_len=256), r"Sample 1 of the batch has input length 300 > max_seq_len=256"),
    (dict(input_lengths=[5, 6, 7], target_lengths=[1, 0, 2]), "Sample 1 of the batch has target length 0"),
    (dict(input_lengths=[5, 200, 7], memory_budget=1e4),
     r"memory_budget=1e\+04 bytes fits no micro-batch plan: sample 1 \(length 200\) alone needs .* Raise memory_budget"),
    (dict(input_lengths=[5, 6], dp=4), "holds 2 samples but there are dp=4 replicas"),
    (dict(input_lengths=[5, 6], memory_budget=-1.0), "memory_budget must be a positive number"),
    (dict(input_lengths=[5, 6], schedule="interleaved_1f1b"), "needs virtual_stages >= 2"),
    (dict(input_lengths=[5, 6, 7], pp=2, virtual_stages=2, schedule="interleaved_1f1b"),
     "needs a multiple of pipeline_parallel_size=2 micro-batches per replica, but a replica holds only 1"),
])
def test_bad_inputs_name_the_value_and_the_fix(case: dict, message: str) -> None:
    kwargs = dict(cost_model=TOY, shape=TINY if "target_lengths" not in case else T5_TINY, dp=1, pp=1,
                  memory_budget=1e9)
    kwargs.update(case)
    if kwargs["dp"] == 1 and "interleaved" in kwargs.get("schedule", "") and kwargs.get("virtual_stages") == 2:
        kwargs["dp"] = 3
    with pytest.raises(ValueError, match=message):
        plan_step(kwargs.pop("input_lengths"), **kwargs)


def test_the_batcher_plans_in_dataloader_workers_and_returns_this_replicas_microbatches() -> None:
    import pickle

    import torch
    from torch.utils.data import DataLoader

    from lightning_3d.dynamic import DynamicMicroBatcher
    from lightning_3d.pipeline.microbatch import MicroBatches
    from tests.scenarios.dynamic import Ragged, pad_collate

    data = Ragged(n=32)
    seen = []
    for rank in range(2):
        batcher = DynamicMicroBatcher(pad_collate, shape=TINY, dp=2, pp=2, dp_rank=rank, memory_budget=3e5,
                                      cost_model=TOY, max_seq_len=16)
        first = [data[i] for i in range(16)]
        assert pickle.loads(pickle.dumps(batcher)).plan(first) == batcher.plan(first)  # workers receive a copy
        loader = DataLoader(data, batch_size=16, collate_fn=batcher, num_workers=1, prefetch_factor=2)
        for step, batch in enumerate(loader):
            assert isinstance(batch, MicroBatches) and batch.orders is not None and len(batch.orders) == 2
            expected = batcher.plan([data[i] for i in range(16 * step, 16 * step + 16)]).replicas[rank]
            assert batch.orders == expected.orders and len(batch) == len(expected.microbatches)
            for mb, planned in zip(batch, expected.microbatches):
                assert mb["input_ids"].shape == (len(planned.samples), planned.seq_len)
                for row, i in enumerate(planned.samples):
                    sample = data[16 * step + i]
                    n = len(sample["input_ids"])
                    assert torch.equal(mb["input_ids"][row, :n], sample["input_ids"])
                    assert (mb["labels"][row, n:] == -100).all()
                    seen.append(16 * step + i)
    assert sorted(seen) == list(range(32))  # the replicas' shares make up every global batch exactly once
    with pytest.raises(ValueError, match=r"dp_rank=2 must lie in \[0, dp=2\)"):
        DynamicMicroBatcher(pad_collate, shape=TINY, dp=2, pp=1, dp_rank=2, memory_budget=1e9)


def test_the_planning_benchmark_runs_and_reports_every_layout() -> None:
    from benchmarks.dynamic.dynamic_planning import main

    report = main(["--tokens", "2048", "--repeats", "1", "--layouts", "1,1", "2,2", "1,2,interleaved"])
    assert [(r["dp"], r["pp"], r["schedule"]) for r in report["results"]] == [
        (1, 1, "1f1b"), (2, 2, "1f1b"), (1, 2, "interleaved_1f1b")]
    assert all(r["microbatches_mean"] >= 1 and r["predicted_speedup_over_padding_to_longest"] >= 1 for r in report["results"])


def test_plan_step_defaults_to_the_analytic_cost_model() -> None:
    """Without ``cost_model`` the plan uses the analytic model (FLOPs and bytes) and says so in the plan."""
    import warnings

    from lightning_3d.costs import ModelShape
    from lightning_3d.dynamic import plan_step

    shape = ModelShape("gpt", num_layers=4, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_step([40, 7, 100, 63, 8, 9], shape=shape, dp=2, pp=2, memory_budget=1e9, max_seq_len=128)
    assert plan.cost_source == "analytic"
    covered = sorted(i for r in plan.replicas for mb in r.microbatches for i in mb.samples)
    assert covered == list(range(6))


@pytest.mark.parametrize("n", [3, 5, 7])
def test_interleaved_plans_merge_adjacent_singles_to_a_multiple_of_pp(n: int) -> None:
    """Equal lengths favour single-sample micro-batches (a shorter pipeline fill); an odd number of them cannot be
    split to a multiple of pp, so adjacent ones are merged down to the previous multiple instead of failing."""
    plan = plan_step([64] * n, cost_model=TOY, shape=TINY, dp=1, pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                     memory_budget=1e9)
    mbs = plan.replicas[0].microbatches
    assert len(mbs) % 2 == 0 and len(mbs) == n - 1  # one merge
    assert sorted(i for mb in mbs for i in mb.samples) == list(range(n))
    assert sorted(len(mb.samples) for mb in mbs) == [1] * (n - 2) + [2]
    assert plan.peak_memory <= 1e9
