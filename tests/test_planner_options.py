"""The search's options that change speed or memory, each with its cost term, on the synthetic profile
(tests/data/profiles/gpt_synthetic.json) and analytic costs: the zero-bubble schedule, compression decided by the
links as the strategy decides it, sequence parallelism and the sharded optimizer (docs/planner.md, "The performance
model"). Every emitted option is checked by the strategy's constructor (``api.emit``)."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_3d.costs import ClusterSpec, ProfiledCostModel, device_spec, layer_parameters
from lightning_3d.planner import SearchOptions, Workload, predict, search, simulate_candidate
from lightning_3d.planner.api import emit, strategy_options
from lightning_3d.planner.communication import dp_allreduce, param_allgather, send_times
from lightning_3d.planner.model import Candidate, pipeline_time, sharded_state_bytes, weight_grad_fraction
from lightning_3d.planner.search import skeletons
from lightning_3d.strategies.compressed_3d import Compressed3DStrategy

PROFILE = Path(__file__).resolve().parent / "data" / "profiles" / "gpt_synthetic.json"
NVLINK = ClusterSpec(1, 4, device_spec("h100"), 300e9, 25e9)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _workload(cluster: ClusterSpec = NVLINK, batch: int = 8, **kw) -> Workload:
    cm = ProfiledCostModel(PROFILE, derive_tp=True)
    return Workload(cm.shape, 1024, batch, cm, cluster, memory_reserve=0.0, **kw)


def _emit(p, w: Workload, gpus: int) -> dict:
    cfg = {"model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {}}, "data": {"init_args": {}}}
    return strategy_options(emit(cfg, p, w.cluster, gpus, w.global_batch_size))


def test_zero_bubble_closed_form_is_the_papers_bubble_and_bounds_the_simulator() -> None:
    # Equal F = 1, B = 2, W = 1 (ranks > 0 split; rank 0 keeps whole backwards of 3): 1F1B takes (m + pp - 1)(F+B+W)
    # = 44, ZB-H1 m(F+B+W) + (pp - 1)(F+B-W) = 38 (Qi et al.; pipeline/zero_bubble.py).
    pp, m = 4, 8
    one = pipeline_time("1f1b", pp, 1, m, [1.0] * 4, [3.0] * 4, [0.0] * 3, [0.0] * 3)
    zb = pipeline_time("zb_h1", pp, 1, m, [1.0] * 4, [3.0] * 4, [0.0] * 3, [0.0] * 3, [0.0, 1.0, 1.0, 1.0])
    assert (one, zb) == (44.0, 38.0)
    w = _workload()
    c = Candidate(1, 4, 1, 2, 8, "1f1b", 1, (2, 2, 2, 2), (False,) * 4, False)
    z = replace(c, schedule="zb_h1")
    sim_1f1b, sim_zb, closed_zb = simulate_candidate(c, w), simulate_candidate(z, w), predict(z, w)
    assert sim_zb.pipeline_time <= closed_zb.pipeline_time * (1 + 1e-12)  # the closed form never under-predicts
    assert sim_zb.pipeline_time < sim_1f1b.pipeline_time
    # Memory: every rank holds pp micro-batches (1F1B's first rank's count), simulated and closed form alike.
    assert sim_zb.stage_memory == pytest.approx(closed_zb.stage_memory, rel=1e-12)
    assert closed_zb.stage_memory[0] == pytest.approx(predict(c, w).stage_memory[0], rel=1e-12)


def test_the_weight_gradient_share_is_the_weight_gemms_over_the_backward() -> None:
    w = _workload()
    s = w.shape
    h, f = s.hidden_size, s.ffn_hidden_size
    gemm = 2 * (4 * h * h + 2 * h * f)  # q, k, v, o and the two FFN projections, forward FLOPs per token
    attention = 4 * 1024 * h * 0.5  # causal scores and values per token
    assert weight_grad_fraction(w) == pytest.approx(gemm / (2 * gemm + 2.5 * attention / 0.75), rel=1e-12)


def test_the_search_picks_zero_bubble_over_1f1b_and_the_strategy_accepts_it() -> None:
    w = _workload()
    opts = SearchOptions(pipeline_parallel_sizes=(4,), tensor_parallel_sizes=(1,), schedules=("1f1b", "zb_h1"),
                         microbatch_sizes=(1,), compression=(False,), top_k=2, model_error=0.0)
    best = search(w, 4, opts).top[0]
    assert best.candidate.schedule == "zb_h1" and best.candidate.num_microbatches == 8
    assert _emit(best, w, 4)["schedule"] == "zb_h1"
    no_zb = search(w, 4, replace(opts, schedules=("1f1b",))).top[0]
    assert best.step_time < no_zb.step_time
    assert not any(s[5] == "zb_h1" and s[1] == 1 for s in skeletons(w, 4, SearchOptions()))  # needs a pipeline


def test_compression_is_offered_only_where_cb_or_sc_would_run() -> None:
    fast = _workload()
    assert not any(s[7] for s in skeletons(fast, 4, SearchOptions()))  # NVLink everywhere: the exact run
    two = _workload(ClusterSpec(2, 2, device_spec("h100"), 300e9, 5e9))  # dp or pp across nodes at 5 GB/s
    offered = {(s[0], s[1], s[2], s[11]) for s in skeletons(two, 4, SearchOptions()) if s[7]}
    # On two nodes of two every layout of four GPUs has a group across the nodes: each is offered compression. With
    # context parallelism SC runs over the dp x cp group (the strategy's data-parallel group), which spans the nodes
    # in every cp layout here (cp ranks are tp apart in the mesh: cp 2 x tp 2 pairs ranks 0 and 2).
    assert offered == {(4, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (1, 4, 1, 1), (1, 2, 2, 1), (1, 1, 1, 4),
                       (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2)}
    # (2, 2, 1): the pipeline inside a node (NVLink, CB off), dp across (SC on); (1, 2, 2): the pipeline across (CB on).
    dp_across = Candidate(2, 2, 1, 2, 4, "1f1b", 1, (4, 4), (False, False), True)
    pp_across = Candidate(1, 2, 2, 2, 8, "1f1b", 1, (4, 4), (False, False), True)
    assert send_times(dp_across, two) == send_times(replace(dp_across, compression=False), two)
    assert send_times(pp_across, two)[1][0] < send_times(replace(pp_across, compression=False), two)[1][0]
    # SC runs on its default stages, all pipeline ranks but the last: the last all-reduces as without compression.
    c = Candidate(2, 2, 1, 2, 4, "1f1b", 1, (4, 4), (False, False), False)
    on = replace(c, compression=True)
    off_ar, on_ar = dp_allreduce(c, two, [1e8, 1e8], [[0], [1]]), dp_allreduce(on, two, [1e8, 1e8], [[0], [1]])
    assert on_ar[0] < off_ar[0] and on_ar[1] == off_ar[1]
    mem_off, mem_on = predict(c, two).stage_memory, predict(on, two).stage_memory
    assert mem_on[1] == mem_off[1] and mem_on[0] > mem_off[0]  # error feedback on rank 0 only


def test_sequence_parallelism_buys_memory_at_the_same_time() -> None:
    w = _workload()
    c = Candidate(2, 1, 2, 2, 2, "1f1b", 1, (8,), (False,), False)
    sp = replace(c, sequence_parallel=True)
    a, b = predict(c, w), predict(sp, w)
    assert a.step_time == b.step_time and b.peak_memory < a.peak_memory
    # The blocks' stored activations: a tp = 1 block's at seq_len / tp tokens (costs/memory.py's rule).
    cm = w.cost_model
    tp1, _ = cm.layer_memory("block", 2, 512, tp=1)
    tp2, _ = cm.layer_memory("block", 2, 1024, tp=2)
    # One micro-batch in flight (1F1B at pp = 1: min(pp, m)), eight blocks.
    assert a.peak_memory - b.peak_memory == pytest.approx(8 * (float(tp2) - float(tp1)), rel=1e-9)
    # Kept only where it is faster than the plain layout: with memory to spare, never; tight, instead of checkpointing.
    opts = SearchOptions(tensor_parallel_sizes=(2,), pipeline_parallel_sizes=(1,), microbatch_sizes=(2,),
                         compression=(False,), shard_optimizer_state=(False,), top_k=1, model_error=0.0)
    assert not search(w, 4, opts).top[0].candidate.sequence_parallel
    tight = _workload(replace(NVLINK, memory_per_gpu=(a.peak_memory + b.peak_memory) / 2))
    best = search(tight, 4, opts).top[0]
    assert best.candidate.sequence_parallel and not any(best.candidate.stage_checkpointing)
    assert _emit(best, tight, 4)["sequence_parallel"] is True


def test_the_sharded_optimizer_shards_state_and_optimizer_and_adds_the_all_gather() -> None:
    assert sharded_state_bytes(16.0, 4) == 10.0 and sharded_state_bytes(8.0, 4) == 7.0
    w = _workload()
    c = Candidate(4, 1, 1, 2, 1, "1f1b", 1, (8,), (False,), False)
    z = replace(c, shard_optimizer_state=True)
    a, b = predict(c, w), predict(z, w)
    params = sum(layer_parameters(w.shape, k, 1) for k in w.shape.layer_kinds())
    if w.shape.tied_embeddings:
        params -= layer_parameters(w.shape, "embedding", 1)
    assert a.peak_memory - b.peak_memory == pytest.approx(params * (8 - 8 / 4), rel=1e-9)
    assert b.optimizer_time == pytest.approx(a.optimizer_time / 4, rel=1e-12)
    gather = (4 - 1) / 4 * params * 4 / 300e9 + max(1.0, params * 4 / (25 * 2**20)) * w.cluster.latency
    assert param_allgather(z, w, [params]) == pytest.approx(gather, rel=1e-9)
    reduce_scatter, all_reduce = dp_allreduce(z, w, [params], [[0]])[0], dp_allreduce(c, w, [params], [[0]])[0]
    latency = max(1.0, params * 4 / (25 * 2**20)) * w.cluster.latency
    assert reduce_scatter - latency == pytest.approx((all_reduce - latency) / 2, rel=1e-9)
    assert b.exposed_dp_time == pytest.approx(reduce_scatter + gather, rel=1e-9)  # pp = 1: nothing hides the sync
    assert send_times(z, w) == send_times(c, w)
    init = _emit(b, w, 4)  # emit passes it to the strategy's constructor first
    assert init["shard_optimizer_state"] is True and init["data_parallel_size"] == 4
    Compressed3DStrategy(**{k: v for k, v in init.items()})
