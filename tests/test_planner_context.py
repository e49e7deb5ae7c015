"""Context parallelism and the interleaved zero-bubble schedule in the planner's search (docs/planner.md, "Context
parallelism" and "Zero bubble"): each term against its value derived here from the inputs, where the search offers
and picks them, and that their plans round-trip through the YAML into the strategy. Synthetic profile
(tests/data/profiles/gpt_synthetic.json: GPT, 8 blocks, hidden 1024, 16 heads, lengths 256-2048) on the CPU."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import lightning_3d.recipes  # noqa: F401  (registers the GPT and T5 recipes with the planner)
from lightning_3d.costs import ClusterSpec, ProfiledCostModel, device_spec, layer_parameters
from lightning_3d.costs.memory import in_flight
from lightning_3d.pipeline.schedules import build_schedule
from lightning_3d.pipeline.timing import simulate
from lightning_3d.planner import SearchOptions, Workload, context, plan, predict, search, simulate_candidate
from lightning_3d.planner.api import emit, workload_from_config
from lightning_3d.planner.communication import dp_allreduce, dp_link, send_times
from lightning_3d.planner.model import Candidate, pipeline_time, weight_grad_fraction, weight_grad_seconds
from lightning_3d.planner.search import skeletons
from lightning_3d.strategies.compressed_3d import Compressed3DStrategy

PROFILE = Path(__file__).resolve().parent / "data" / "profiles" / "gpt_synthetic.json"
NVLINK = ClusterSpec(1, 4, device_spec("h100"), 300e9, 25e9)
H100 = device_spec("h100")
ATT_RATE = H100.peak_flops * H100.gemm_efficiency * 0.75  # costs/analytic.py: ATTENTION_EFFICIENCY of the GEMM rate


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _workload(cluster: ClusterSpec = NVLINK, seq: int = 2048, batch: int = 2, **kw) -> Workload:
    cm = ProfiledCostModel(PROFILE, derive_tp=True)
    return Workload(cm.shape, seq, batch, cm, cluster, memory_reserve=0.0, **kw)


def _config(seq: int = 2048, **model) -> dict:
    """A fit config whose GPT is the synthetic profile's shape."""
    args = dict(preset_name="tiny", num_layers=8, hidden_size=1024, num_heads=16, ffn_hidden_size=4096,
                vocab_size=32768, tie_embeddings=False, **model)
    return {"trainer": {"precision": "bf16-mixed", "strategy": {"class_path": "lightning_3d.Compressed3DStrategy"}},
            "model": {"class_path": "lightning_3d.recipes.GPT", "init_args": args},
            "data": {"class_path": "lightning_3d.recipes.data.CausalLMDataModule",
                     "init_args": {"seq_length": seq, "batch_size": 2}}}


# ----- the terms ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp, link", [(2, 300e9), (4, 300e9), (4, 3.8e9)])
def test_ring_terms_are_the_rings_steps_and_its_unhidden_transfers(cp, link) -> None:
    w = _workload(ClusterSpec(1, 4, H100, link, link))
    mbs, tp, S, ad, lat = 1, 1, 2048, 16 * 64, 10e-6
    elements = mbs * (S / cp) * ad  # one of q, k, v on a rank
    t_att = 4 * mbs * (S / cp) ** 2 * ad * 0.5 / ATT_RATE  # one ring step: causal attention of S / cp tokens
    kv, dkv = 2 * elements * 2 / link + lat, 2 * elements * 4 / link + lat  # K and V in bf16; dK and dV in fp32
    fwd = (cp - 1) * max(0.0, kv - t_att)
    b = 2.5 * t_att
    bwd = max(0.0, kv - b) + (cp - 2) * max(0.0, kv + dkv - b) + max(0.0, dkv - b) + dkv
    assert context.ring_exposed(w, mbs, tp, cp) == pytest.approx((fwd, bwd), rel=1e-12)
    terms = context.block_terms(w, mbs, tp, cp, "ring")
    assert terms.compute_forward == pytest.approx((cp - 1) * t_att, rel=1e-12)  # the other ranks' keys
    assert terms.compute_backward == pytest.approx(2.5 * (cp - 1) * t_att, rel=1e-12)
    assert terms.forward == pytest.approx((cp - 1) * t_att + fwd, rel=1e-12)
    assert terms.backward == pytest.approx(2.5 * (cp - 1) * t_att + bwd, rel=1e-12)
    assert terms.transient == pytest.approx(elements * (5 * 4 + 4 * 2), rel=1e-12)
    # The last dK/dV is never hidden: the backward exposes at least it.
    assert terms.comm_backward >= dkv


def test_ulysses_terms_are_four_exposed_all_to_alls_per_pass() -> None:
    w = _workload()
    cp, mbs, tp = 4, 2, 2
    elements = mbs * 2048 / cp * 1024 / tp
    one = (cp - 1) / cp * elements * 2 / w.cluster.bandwidth(cp, tp) + 10e-6
    terms = context.block_terms(w, mbs, tp, cp, "ulysses")
    assert (terms.comm_forward, terms.comm_backward) == pytest.approx((4 * one, 4 * one), rel=1e-12)
    t_att = 4 * mbs * (2048 / cp) ** 2 * (1024 / tp) * 0.5 / ATT_RATE
    assert terms.compute_forward == pytest.approx((cp - 1) * t_att, rel=1e-12)  # the same pairs as the ring
    assert terms.transient == pytest.approx(2 * elements * 2, rel=1e-12)


def test_a_cp_block_is_the_profile_at_seq_over_cp_plus_its_attention_terms() -> None:
    w = _workload()
    cm = w.cost_model
    for recompute in (False, True):
        blocks, _, _ = w.layer_costs(1, 1, recompute, False, 2, "ring")
        f, b = cm.layer_time("block", 1, 1024, recompute=recompute, tp=1)  # the grid at 2048 / 2 tokens
        st, pk = cm.layer_memory("block", 1, 1024, recompute=recompute, tp=1)
        t = context.block_terms(w, 1, 1, 2, "ring")
        # A checkpointed block runs its forward again in the backward, the ring included.
        assert blocks[5][0] == pytest.approx(float(f) + t.forward, rel=1e-12)
        assert blocks[6][0] == pytest.approx(float(b) + t.backward + (t.forward if recompute else 0.0), rel=1e-12)
        assert blocks[2][0] == pytest.approx(float(st), rel=1e-12)  # stored: the layers at seq / cp
        assert blocks[3][0] == pytest.approx(float(pk) + t.transient, rel=1e-12)
    _, emb, head = w.layer_costs(1, 1, False, False, 2, "ring")  # the ends on the rank's slice, no attention term
    assert emb[5] == pytest.approx(float(cm.layer_time("embedding", 1, 1024)[0]), rel=1e-12)
    assert head[2] == pytest.approx(float(cm.layer_memory("head", 1, 1024)[0]), rel=1e-12)


def test_gradients_reduce_over_dp_times_cp_and_sends_carry_the_slice() -> None:
    w = _workload(ClusterSpec(2, 2, H100, 300e9, 5e9))
    c = Candidate(1, 2, 1, 1, 2, "1f1b", 1, (4, 4), (False, False), False, cp=2)
    size = 1e8 * 4
    buckets = size / (25 * 2**20)
    # Ranks: (pp 0: cp 0, 1) = 0, 1 on node 0; (pp 1) = 2, 3 on node 1. The dp x cp group (2 ranks) is in a node;
    # the pipeline crosses the nodes.
    assert dp_link(c, w) == 300e9
    assert dp_allreduce(c, w, [1e8, 1e8], [[0], [1]]) == pytest.approx([2 * (1 / 2) * size / 300e9 + buckets * 10e-6] * 2)
    assert send_times(c, w)[0] == pytest.approx([1 * (2048 / 2) * 1024 * 2 / 5e9 + 10e-6])
    # cp 2 x tp 2 on two nodes of two: the cp ranks are tp apart (0 and 2), a group across the nodes.
    ctp = Candidate(1, 1, 2, 1, 2, "1f1b", 1, (8,), (False,), False, cp=2)
    assert dp_link(ctp, w) == 5e9 and context.link(w, 2, 2) == 5e9
    # The sharded optimizer's share is 1 / (dp x cp); the optimizer steps that share.
    z = Candidate(1, 1, 1, 1, 2, "1f1b", 1, (8,), (False,), False, shard_optimizer_state=True, cp=4)
    plain = replace(z, shard_optimizer_state=False)
    params = sum(layer_parameters(w.shape, k, 1) for k in w.shape.layer_kinds())
    a, b = predict(plain, _workload()), predict(z, _workload())
    assert a.peak_memory - b.peak_memory == pytest.approx(params * (8 - 8 / 4), rel=1e-9)
    assert b.optimizer_time == pytest.approx(a.optimizer_time / 4, rel=1e-12)


def test_activations_per_rank_scale_with_seq_over_cp() -> None:
    w = _workload()
    one = Candidate(2, 1, 1, 1, 1, "1f1b", 1, (8,), (False,), False)
    two = Candidate(1, 1, 1, 1, 2, "1f1b", 1, (8,), (False,), False, cp=2)
    cm = w.cost_model
    stored = lambda s: sum(float(cm.layer_memory(k, 1, s)[0]) for k in w.shape.layer_kinds())  # noqa: E731
    # One micro-batch in flight at pp = 1; the same weights; stored activations of 2048 against 1024 tokens.
    top = lambda s, extra: max(float(cm.layer_memory(k, 1, s)[1]) + (extra if k == "block" else 0.0)  # noqa: E731
                               for k in w.shape.layer_kinds())
    ring = context.transient_bytes(w, 1, 1, 2, "ring")
    diff = (stored(2048) + top(2048, 0.0)) - (stored(1024) + top(1024, ring))
    assert predict(one, w).peak_memory - predict(two, w).peak_memory == pytest.approx(diff, rel=1e-9)


# ----- where the search offers cp, and where it picks it ------------------------------------------------------------


def test_cp_is_offered_only_where_the_strategy_and_the_model_accept_it() -> None:
    offered = lambda w, **kw: {(s[11], s[12]) for s in skeletons(w, 4, SearchOptions(**kw))}  # noqa: E731
    assert offered(_workload()) == {(1, "ring"), (2, "ring"), (2, "ulysses"), (4, "ring"), (4, "ulysses")}
    # Zigzag needs the sequence to be a multiple of 2 cp: 1028 = 4 x 257 takes cp 2, not cp 4.
    assert {cp for cp, _ in offered(_workload(seq=1028))} == {1, 2}
    assert offered(_workload(), context_parallel_sizes=(1,)) == {(1, "ring")}
    assert offered(_workload(), context_parallel_attention=("ring",)) == {(1, "ring"), (2, "ring"), (4, "ring")}
    # Ulysses needs the heads per tp rank divisible by cp.
    twelve = _workload()
    twelve.shape = replace(twelve.shape, num_heads=12)
    assert "not divisible by context_parallel_size=8" in context.refusal(twelve, 8, "ulysses", 1)
    assert context.refusal(twelve, 4, "ulysses", 1) is None and context.refusal(twelve, 4, "ulysses", 2) is not None
    # The recipe's refusal (dropout, data) and an encoder-decoder keep cp out entirely.
    assert offered(_workload(context_parallel_refusal="the GPT's dropout=0.1")) == {(1, "ring")}
    assert offered(_workload(target_len=512)) == {(1, "ring")}
    for s in skeletons(_workload(), 4, SearchOptions()):
        dp, pp, tp, cp = s[0], s[1], s[2], s[11]
        assert dp * pp * tp * cp == 4
        assert not (s[8] and cp > 1)  # no CUDA graphs with cp (the strategy's check_cuda_graphs)
        if s[9] and cp > 1:  # sequence parallelism: each rank's slice divides by tp
            assert (2048 // cp) % tp == 0


def test_the_recipe_rule_reads_dropout_data_and_family_from_the_config() -> None:
    cluster = NVLINK
    assert workload_from_config(_config(), cluster).context_parallel_refusal is None
    assert "dropout=0.1" in workload_from_config(_config(dropout=0.1), cluster).context_parallel_refusal
    multitask = _config()
    multitask["data"]["class_path"] = "lightning_3d.recipes.data.multitask.MultiTaskDataModule"
    assert "MultiTaskDataModule" in workload_from_config(multitask, cluster).context_parallel_refusal
    t5 = {"model": {"class_path": "lightning_3d.recipes.T5", "init_args": {"preset_name": "tiny"}}}
    assert "no context-parallel attention" in workload_from_config(t5, cluster).context_parallel_refusal


def _two_gpu_options(**kw) -> SearchOptions:
    base = dict(tensor_parallel_sizes=(1,), pipeline_parallel_sizes=(1,), microbatch_sizes=(1,), compression=(False,),
                cuda_graphs=(False,), shard_optimizer_state=(False,), allow_checkpointing=False, top_k=1,
                model_error=0.0)
    return SearchOptions(**{**base, **kw})


def test_the_search_picks_cp_where_one_sequence_does_not_fit_and_not_where_it_costs_more() -> None:
    w = _workload(batch=2)
    dp2 = predict(Candidate(2, 1, 1, 1, 1, "1f1b", 1, (8,), (False,), False), w)
    cp2 = predict(Candidate(1, 1, 1, 1, 2, "1f1b", 1, (8,), (False,), False, cp=2), w)
    assert cp2.peak_memory < dp2.peak_memory and cp2.step_time > dp2.step_time
    # Memory to spare: two replicas of whole sequences beat one replica whose ranks exchange keys and values.
    roomy = search(w, 2, _two_gpu_options())
    assert roomy.top[0].candidate.cp == 1 and roomy.top[0].candidate.dp == 2
    # A whole sequence's activations do not fit one GPU, its half does: cp = 2 is the plan.
    tight = _workload(replace(NVLINK, memory_per_gpu=(dp2.peak_memory + cp2.peak_memory) / 2), batch=2)
    best = search(tight, 2, _two_gpu_options()).top[0]
    assert (best.candidate.dp, best.candidate.cp) == (1, 2)
    assert best.step_time == pytest.approx(predict(replace(best.candidate), tight).step_time, rel=1e-12)


def test_a_cp_plan_round_trips_through_the_yaml_and_constructs_the_strategy() -> None:
    cfg = _config()
    dp2 = predict(Candidate(2, 1, 1, 1, 1, "1f1b", 1, (8,), (False,), False), _workload(batch=2))
    cp2 = predict(Candidate(1, 1, 1, 1, 2, "1f1b", 1, (8,), (False,), False, cp=2), _workload(batch=2))
    cluster = ClusterSpec(1, 2, H100, 300e9, 25e9, memory_per_gpu=(dp2.peak_memory + cp2.peak_memory) / 2 + 1.5 * 2**30)
    p = plan(cfg, 2, cluster=cluster, profile=PROFILE, options=_two_gpu_options(context_parallel_attention=("ulysses",)))
    assert p.predictions[0].candidate.cp == 2
    text = p.yaml(0)
    loaded = yaml.safe_load(text)
    init = loaded["trainer"]["strategy"]["init_args"]
    assert init["parallelism"] == {"data_parallel_size": 1, "pipeline_parallel_size": 1, "tensor_parallel_size": 1,
                                   "context_parallel_size": 2, "context_parallel_layout": "zigzag",
                                   "context_parallel_attention": "ulysses"}
    assert loaded["trainer"]["devices"] == 2 and loaded["data"]["init_args"]["batch_size"] == 2
    strategy = Compressed3DStrategy(**init)
    assert strategy.parallelism.context_parallel_size == 2
    assert strategy.parallelism.context_parallel_attention == "ulysses"
    # An input config's own cp is replaced by the plan's choice, not carried over.
    cfg["trainer"]["strategy"]["init_args"] = {"parallelism": {"context_parallel_size": 2,
                                                               "context_parallel_attention": "ulysses"}}
    roomy = plan(cfg, 2, profile=PROFILE, options=_two_gpu_options(), global_batch_size=2)
    par = roomy.configs[0]["trainer"]["strategy"]["init_args"]["parallelism"]
    assert roomy.predictions[0].candidate.cp == 1 and "context_parallel_size" not in par


def test_the_plan_command_passes_its_context_parallel_options_to_the_search(tmp_path, capsys) -> None:
    from lightning_3d.cli import main

    source, out = tmp_path / "model.yaml", tmp_path / "plan.yaml"
    source.write_text(yaml.safe_dump(_config()))
    common = ["plan", "--config", str(source), "--gpus", "2", "--profile", str(PROFILE), "--global-batch-size", "2",
              "--time-budget", "30", "--top-k", "1", "--out", str(out)]
    # Only cp = 2 with Ulysses searched: on two GPUs every candidate is one replica over a cp = 2 Ulysses group.
    main(common + ["--context-parallel-sizes", "2", "--context-parallel-attention", "ulysses"])
    par = yaml.safe_load(out.read_text())["trainer"]["strategy"]["init_args"]["parallelism"]
    assert (par["context_parallel_size"], par["context_parallel_attention"]) == (2, "ulysses")
    # cp = 1 only: no context parallelism in the plan.
    main(common + ["--context-parallel-sizes", "1"])
    assert "context_parallel_size" not in yaml.safe_load(out.read_text())["trainer"]["strategy"]["init_args"]["parallelism"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(common + ["--context-parallel-attention", "flash"])
    assert "context_parallel_attention=('flash',)" in capsys.readouterr().err


def test_emit_refuses_a_cp_plan_the_strategy_would_refuse_at_fit() -> None:
    w = _workload(seq=1028)  # zigzag at cp 4 needs a multiple of 8
    p = predict(Candidate(1, 1, 1, 1, 2, "1f1b", 1, (8,), (False,), False, cp=4), _workload())
    with pytest.raises(ValueError, match="context_parallel_size=4 .*not divisible by 8.*context_parallel_sizes=\\(1,\\)"):
        emit(_config(seq=1028), p, w.cluster, 4, 2, w)


# ----- zb_interleaved -----------------------------------------------------------------------------------------------


def test_zb_interleaved_closed_form_is_interleaveds_less_the_deferred_w_and_equals_the_simulator() -> None:
    # Equal chunks F = 1, B + W = 3 with W = 1 split on every stage but the first: interleaved 1F1B takes
    # m v (F + B + W) + (pp - 1)(F + B + W) = 64 + 12 = 76; deferring W takes 2 (pp - 1) W = 6 off its bubble.
    pp, v, m = 4, 2, 8
    S = pp * v
    zero = [0.0] * (S - 1)
    inter = pipeline_time("interleaved_1f1b", pp, v, m, [1.0] * S, [3.0] * S, zero, zero)
    zb = pipeline_time("zb_interleaved", pp, v, m, [1.0] * S, [3.0] * S, zero, zero, [0.0] + [1.0] * (S - 1))
    assert (inter, zb) == (76.0, 70.0)
    orders = [build_schedule("zb_interleaved", pp, v, m, r) for r in range(pp)]
    split = {(a.stage, a.microbatch) for o in orders for a in o if a.kind == "W"}
    assert {s for s, _ in split} == set(range(1, S))  # rank 0's later chunks split too: only stage 0 keeps whole B

    def duration(a):
        return 1.0 if a.kind == "F" else 1.0 if a.kind == "W" else 2.0 if (a.stage, a.microbatch) in split else 3.0

    assert simulate(orders, S, duration, check=True).makespan == 70.0


def test_zb_interleaved_is_priced_below_interleaved_at_equal_v_and_m() -> None:
    w = _workload(seq=1024, batch=8)
    c = Candidate(1, 4, 1, 1, 8, "interleaved_1f1b", 2, (1,) * 8, (False,) * 8, False)
    z = replace(c, schedule="zb_interleaved")
    frac = weight_grad_fraction(w)
    assert 0.3 < frac < 0.6  # W is a real share of the backward
    bwd = predict(z, w).stage_backward
    assert weight_grad_seconds(z, w, bwd) == pytest.approx([0.0] + [frac * b for b in bwd[1:]], rel=1e-12)
    closed_c, closed_z = predict(c, w), predict(z, w)
    assert closed_c.pipeline_time - closed_z.pipeline_time == pytest.approx(2 * 3 * min(frac * b for b in bwd[1:]),
                                                                            rel=1e-9)
    sim_c, sim_z = simulate_candidate(c, w), simulate_candidate(z, w)
    assert sim_z.pipeline_time < sim_c.pipeline_time and closed_z.step_time < closed_c.step_time
    # Memory: rank r holds interleaved 1F1B's warm-up + 1 + r chunks (2 (pp - 1 - r) + (v - 1) pp + 1 + r), never
    # more than interleaved 1F1B's first rank (tests/test_planner_model.py checks the counts against the simulator);
    # the closed form counts them at the rank's largest stage, an upper bound of the simulated order's peaks.
    assert [in_flight("zb_interleaved", 4, 2, 8, r) for r in range(4)] == [11, 10, 9, 8]
    assert [in_flight("interleaved_1f1b", 4, 2, 8, r) for r in range(4)] == [11, 9, 7, 5]
    assert closed_z.stage_memory[0] == pytest.approx(closed_c.stage_memory[0], rel=1e-12)
    assert all(s <= c * (1 + 1e-12) for s, c in zip(sim_z.stage_memory, closed_z.stage_memory))
    assert sim_z.stage_memory[0] == pytest.approx(closed_z.stage_memory[0], rel=1e-9)


def test_the_search_picks_zb_interleaved_and_its_plan_constructs_the_strategy() -> None:
    w = _workload(seq=1024, batch=8)
    opts = SearchOptions(pipeline_parallel_sizes=(4,), tensor_parallel_sizes=(1,), microbatch_sizes=(1,),
                         schedules=("interleaved_1f1b", "zb_interleaved"), compression=(False,),
                         context_parallel_sizes=(1,), top_k=1, model_error=0.0)
    best = search(w, 4, opts).top[0]
    assert best.candidate.schedule == "zb_interleaved" and best.candidate.virtual_stages >= 2
    offered = {(s[5], s[6]) for s in skeletons(w, 4, opts)}
    assert offered == {(name, v) for name in opts.schedules for v in (2,)}  # 8 blocks over 4 ranks: v = 2 at most
    assert not any(s[5] == "zb_interleaved" and s[1] == 1 for s in skeletons(w, 4, SearchOptions()))
    cfg = _config(seq=1024)
    out = emit(cfg, best, w.cluster, 4, 8, w)
    loaded = yaml.safe_load(yaml.safe_dump(out))
    pipe = loaded["trainer"]["strategy"]["init_args"]["pipeline"]
    assert pipe["schedule"] == "zb_interleaved" and pipe["virtual_stages"] == best.candidate.virtual_stages
    Compressed3DStrategy(**loaded["trainer"]["strategy"]["init_args"])


# ----- bad values ---------------------------------------------------------------------------------------------------


def test_bad_search_options_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match="'zb_v' cannot be searched.*use schedules from"):
        SearchOptions(schedules=("1f1b", "zb_v"))
    with pytest.raises(ValueError, match="context_parallel_attention=\\('flash',\\).*'ring', 'ulysses'"):
        SearchOptions(context_parallel_attention=("flash",))
    with pytest.raises(ValueError, match="context_parallel_sizes=\\(0, 2\\).*positive integers.*\\(1,\\) to search"
                                         " without"):
        SearchOptions(context_parallel_sizes=(0, 2))
    assert SearchOptions(schedules="zb_interleaved").schedules == ("zb_interleaved",)
