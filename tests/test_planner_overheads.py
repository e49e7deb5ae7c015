"""The cost terms of profile version 2 (docs/planner.md, "Host time and fixed overheads"): the host's issue time as a
floor of each layer's time, the per-micro-batch and per-step overheads, compiled grids, and how version-1 profiles
are read. All on the checked-in synthetic profile (tests/data/profiles/gpt_synthetic.json, version 1), upgraded
here by adding the version-2 fields, plus one CPU run of the profiler."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from lightning_3d.costs import ClusterSpec, ProfiledCostModel, device_spec
from lightning_3d.planner.model import Candidate, Workload, pipeline_time, predict, send_times, simulate_candidate, stage_costs

PROFILE = Path(__file__).parent / "data" / "profiles" / "gpt_synthetic.json"
LAYERS = 8  # the synthetic model's blocks
SEQ = 1024  # a grid length of the synthetic profile
MBS_AXIS = [1, 2, 4, 8]


def _v1() -> dict:
    return json.loads(PROFILE.read_text())


def _v2(host: float | None = None, microbatch: float = 0.0, step: float = 0.0) -> dict:
    """The synthetic profile as version 2: every grid's host times ``host`` seconds per pass (None: no host grids),
    and the two overheads."""
    doc = _v1()
    doc["version"] = 2
    if host is not None:
        for entries in doc["layers"].values():
            for e in entries:
                e["host_forward"] = [[host] * len(e["seq_len"]) for _ in e["microbatch_size"]]
                e["host_backward"] = [[host] * len(e["seq_len"]) for _ in e["microbatch_size"]]
    doc["overheads"] = {"microbatch_seconds": microbatch, "step_seconds": step}
    return doc


def _model(doc: dict, **kw) -> ProfiledCostModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ProfiledCostModel(doc, derive_tp=True, **kw)


def _workload(cm: ProfiledCostModel, batch: int = 8, gpus: int = 4) -> Workload:
    return Workload(cm.shape, SEQ, batch, cm, ClusterSpec(1, gpus, device_spec("h100"), 300e9, 25e9), memory_reserve=0.0)


def _one_gpu(mbs: int, m: int, ckpt: bool = False) -> Candidate:
    return Candidate(1, 1, 1, mbs, m, "1f1b", 1, (LAYERS,), (ckpt,), False)


def _device_sum(cm: ProfiledCostModel, mbs: int, ckpt: bool = False) -> float:
    """One micro-batch's forward + backward through every layer, from the profile's (device) grids."""
    total = 0.0
    for kind in cm.shape.layer_kinds():
        f, b = cm.layer_time(kind, mbs, SEQ, recompute=ckpt and kind == "block")
        total += float(f) + float(b)
    return total


def test_a_host_bound_step_is_the_sum_of_the_host_times() -> None:
    # Host times far above every device time: each layer costs its host time, a micro-batch the host sum.
    host = 0.05
    cm = _model(_v2(host=host))
    assert host > max(_device_sum(cm, 8), 0) / (2 * (LAYERS + 2))  # host-bound indeed, at every layer on average
    for mbs, m in ((1, 8), (2, 4), (8, 1)):
        p = predict(_one_gpu(mbs, m), _workload(cm))
        host_sum = (LAYERS + 2) * 2 * host  # embedding, blocks, head; forward and backward
        assert p.pipeline_time == pytest.approx(m * host_sum, rel=1e-12)
        assert p.step_time == pytest.approx(m * host_sum + p.optimizer_time, rel=1e-12)


def test_host_times_below_the_device_times_change_nothing() -> None:
    plain, with_host = _model(_v1()), _model(_v2(host=1e-9))
    for c in (_one_gpu(2, 4), _one_gpu(4, 2, ckpt=True), Candidate(1, 2, 2, 2, 4, "1f1b", 1, (4, 4), (False, True), False)):
        assert predict(c, _workload(with_host)).step_time == pytest.approx(predict(c, _workload(plain)).step_time, rel=1e-12)


def test_a_tensor_parallel_shard_keeps_the_whole_layers_host_time() -> None:
    # The profile has tp = 1 and 2; tp = 4 is derived: its compute shrinks, its launches do not.
    cm = _model(_v2(host=3e-3))
    f4, b4 = cm.layer_time("block", 4, SEQ, tp=4)
    hf4, hb4 = cm.layer_host_time("block", 4, SEQ, tp=4)
    assert float(hf4) == float(hb4) == pytest.approx(3e-3)
    assert float(f4) < 3e-3  # the derived device time alone would be below the host's
    w = _workload(cm)
    blocks, _, _ = w.layer_costs(4, 4, False)
    tp_comm = w.tp_comm("block", 4, 4)
    # The all-reduces run on the device (the host only launches them): the floor against the device's span plus them.
    assert float(f4) + tp_comm < 3e-3
    np.testing.assert_allclose(blocks[0], 3e-3, rtol=1e-12)
    np.testing.assert_allclose(blocks[5], float(f4) + tp_comm, rtol=1e-12)


@pytest.mark.parametrize("schedule,pp,v,m", [("1f1b", 1, 1, 4), ("1f1b", 2, 1, 4), ("gpipe", 2, 1, 3),
                                             ("interleaved_1f1b", 2, 2, 4)])
def test_the_microbatch_overhead_is_paid_by_every_stage_for_every_microbatch(schedule, pp, v, m) -> None:
    x = 7e-3
    base, over = _model(_v2()), _model(_v2(microbatch=x))
    stages = pp * v
    c = Candidate(1, pp, 1, 2, m, schedule, v, (LAYERS // stages,) * stages, (False,) * stages, False)
    p0, p1 = predict(c, _workload(base, gpus=pp)), predict(c, _workload(over, gpus=pp))
    assert [b - a for a, b in zip(p0.stage_forward, p1.stage_forward)] == pytest.approx([x / 2] * stages, rel=1e-9)
    assert [b - a for a, b in zip(p0.stage_backward, p1.stage_backward)] == pytest.approx([x / 2] * stages, rel=1e-9)
    # The schedule's closed form runs on those longer stages; one GPU pays m·x.
    fs, bs = send_times(c, _workload(over, gpus=pp))
    assert p1.pipeline_time == pytest.approx(pipeline_time(schedule, pp, v, m, p1.stage_forward, p1.stage_backward, fs, bs),
                                             rel=1e-12)
    if pp == 1:
        assert p1.pipeline_time - p0.pipeline_time == pytest.approx(m * x, rel=1e-9)
    # The simulator sees the same stage costs.
    s0, s1 = simulate_candidate(c, _workload(base, gpus=pp)), simulate_candidate(c, _workload(over, gpus=pp))
    assert s1.step_time > s0.step_time


def test_the_microbatch_overhead_in_a_1f1b_pipeline_of_equal_stages_adds_fill_plus_steady_state() -> None:
    x, pp, m = 5e-3, 4, 8
    base, over = _model(_v2()), _model(_v2(microbatch=x))
    c = Candidate(1, pp, 1, 2, m, "1f1b", 1, (2, 2, 2, 2), (False,) * pp, False)
    w0, w1 = _workload(base, gpus=pp), _workload(over, gpus=pp)
    # Equal stages except the end ones (embedding, head): the simulator's makespan grows by at least (pp + m - 1)·x
    # (every forward and backward on the critical path is x/2 longer) and the closed form by exactly that where the
    # slowest stage sets the cycle.
    d_sim = simulate_candidate(c, w1).pipeline_time - simulate_candidate(c, w0).pipeline_time
    d_closed = predict(c, w1).pipeline_time - predict(c, w0).pipeline_time
    assert d_closed == pytest.approx((pp + m - 1) * x, rel=1e-9)
    assert d_sim >= (pp + m - 1) * x * (1 - 1e-9)


def test_the_step_overhead_is_added_once_per_step() -> None:
    s = 0.012
    base, over = _model(_v2()), _model(_v2(step=s))
    for c in (_one_gpu(2, 4), Candidate(2, 2, 1, 2, 2, "1f1b", 1, (4, 4), (False, False), False)):
        p0, p1 = predict(c, _workload(base)), predict(c, _workload(over))
        assert p1.step_time - p0.step_time == pytest.approx(s, rel=1e-9)
        assert p1.overhead_time == s and p1.summary()["step_overhead_s"] == pytest.approx(s)
        assert p1.pipeline_time == p0.pipeline_time


@pytest.mark.parametrize("pp, v, split, busiest", [(1, 1, (8,), 8), (2, 1, (4, 4), 4), (2, 1, (5, 3), 5),
                                                     (2, 2, (1, 3, 2, 2), 3 + 2), (4, 1, (2, 2, 2, 2), 2)])
def test_the_step_overhead_grows_with_the_busiest_ranks_blocks(pp, v, split, busiest) -> None:
    """step_seconds + step_seconds_per_block * (blocks of the rank with the most - step_blocks): a rank holds the
    virtual stages r, r + pp, ... (interleaved: rank 0 holds stages 0 and 2 of (1, 3, 2, 2), 3 blocks, rank 1 holds
    3 + 2)."""
    s, k, tiny_blocks = 0.002, 0.0004, 1
    doc = _v2(step=s)
    doc["overheads"].update(step_seconds_per_block=k, step_blocks=tiny_blocks)
    base, over = _model(_v2(step=s)), _model(doc)
    assert over.step_overhead_per_block_seconds == k and over.step_overhead_blocks == tiny_blocks
    c = Candidate(1, pp, 1, 2, 4, "interleaved_1f1b" if v > 1 else "1f1b", v, split, (False,) * len(split), False)
    p0, p1 = predict(c, _workload(base, gpus=pp)), predict(c, _workload(over, gpus=pp))
    assert p1.overhead_time == pytest.approx(s + k * (busiest - tiny_blocks), rel=1e-12)
    assert p1.step_time - p0.step_time == pytest.approx(k * (busiest - tiny_blocks), rel=1e-9)
    assert p1.pipeline_time == p0.pipeline_time


@pytest.mark.parametrize("field, value", [("step_seconds_per_block", -1e-3), ("step_seconds_per_block", "0.1"),
                                          ("step_blocks", -1), ("step_blocks", 1.5), ("step_blocks", True),
                                          ("step_seconds_per_block", 1e-4)])  # a growth without its base count
def test_a_bad_per_block_step_overhead_is_refused_by_name(field, value) -> None:
    doc = _v2(step=0.002)
    doc["overheads"][field] = value
    with pytest.raises(ValueError, match=r"'overheads.step_seconds_per_block' must be non-negative seconds and"
                                         r" 'overheads.step_blocks' a non-negative count of blocks, given with it"
                                         r" \(got .*\); profile again"):
        _model(doc)
    doc["overheads"].update(step_seconds_per_block=1e-4, step_blocks=1)  # both, well formed: read
    assert _model(doc).step_overhead_per_block_seconds == 1e-4


def test_a_tiny_steps_tail_is_timed_once_per_step_inside_the_step() -> None:
    """A tail for every timed step and none for the warm-up, each shorter than its step, with several micro-batches
    and activation checkpointing (the engine's recomputing backward): Lightning's on_after_backward reaches the
    profiler's timer under the strategy's engine."""
    import torch

    import lightning_3d.recipes  # noqa: F401
    from lightning_3d.costs import recipe_costs
    from lightning_3d.planner import train_tiny

    tiny = recipe_costs("lightning_3d.recipes.GPT").tiny
    tails: dict = {}
    steps = train_tiny(tiny, dict(tiny.model_args, num_layers=2, activation_checkpointing=True), tiny.data_args,
                       torch.device("cpu"), "32-true", 3, 1, 3, tails_out=tails)
    assert sorted(tails) == sorted(steps) == [1, 3]
    for m in (1, 3):
        assert len(tails[m]) == len(steps[m]) == 3
        assert all(0 < t < s for t, s in zip(tails[m], steps[m])), (m, tails[m], steps[m])


def test_the_step_seconds_per_block_come_from_the_tails_of_the_tiny_steps() -> None:
    """The medians of the steps' tails (last backward to the step's end), each less its model's optimizer step: the
    deep model's excess over the one-layer model's, per block beyond the tiny model's."""
    from lightning_3d.costs import ModelShape
    from lightning_3d.planner import step_seconds_at_depth

    tiny = ModelShape(family="gpt", num_layers=1, hidden_size=128, num_heads=4, ffn_hidden_size=512, vocab_size=512)
    real = ModelShape(family="gpt", num_layers=25, hidden_size=1024, num_heads=16, ffn_hidden_size=4096,
                      vocab_size=50257)
    tails = {"tail_seconds": [0.003, 0.0025, 0.1, 0.0025], "deep_tail_seconds": [0.012, 0.5, 0.0122, 0.0118, 0.012],
             "deep_optimizer_seconds": 0.001}
    out = step_seconds_at_depth(0.002, tiny, real, tails, 0.0005)
    # medians 0.00275 and 0.012; less the optimizers: 0.00225 and 0.011; 24 blocks beyond the tiny model's one
    assert out["step_seconds_per_block"] == pytest.approx((0.011 - 0.00225) / 24, rel=1e-9)
    assert out["step_blocks"] == 1 and out["deep_optimizer_seconds"] == 0.001
    assert out["step_seconds_depth"] == pytest.approx(0.002 + (0.011 - 0.00225), rel=1e-9)
    assert out["tail_seconds"] == tails["tail_seconds"] and out["deep_tail_seconds"] == tails["deep_tail_seconds"]
    # A deep tail shorter than the one-layer model's (noise): no growth, never a negative one; no tails: none.
    short = dict(tails, deep_tail_seconds=[0.001])
    assert step_seconds_at_depth(0.002, tiny, real, short, 0.0005)["step_seconds_per_block"] == 0.0
    assert step_seconds_at_depth(0.002, tiny, real, {}, 0.0005)["step_seconds_per_block"] == 0.0
    # T5: the tiny model's two blocks (one encoder, one decoder) are the base.
    t5_tiny = ModelShape(family="t5", num_layers=1, num_decoder_layers=1, hidden_size=128, num_heads=4,
                         ffn_hidden_size=512, vocab_size=512)
    t5 = ModelShape(family="t5", num_layers=24, num_decoder_layers=24, hidden_size=1024, num_heads=16,
                    ffn_hidden_size=2816, vocab_size=32128)
    t5_out = step_seconds_at_depth(0.002, t5_tiny, t5, tails, 0.0005)
    assert t5_out["step_blocks"] == 2 and t5_out["step_seconds_per_block"] == pytest.approx(0.00875 / 46, rel=1e-9)


def test_a_version_1_profile_reads_with_the_new_terms_absent() -> None:
    v1, v2 = _model(_v1()), _model(_v2())
    assert v1.version == 1 and v1.microbatch_overhead_seconds == 0.0 and v1.step_overhead_seconds == 0.0
    hf, hb = v1.layer_host_time("block", np.array([1, 2]), SEQ)
    assert np.all(hf == 0) and np.all(hb == 0)
    for c in (_one_gpu(2, 4), _one_gpu(8, 1, ckpt=True)):
        assert predict(c, _workload(v1)).step_time == predict(c, _workload(v2)).step_time


def test_unknown_versions_and_bad_overheads_are_refused_by_name() -> None:
    doc = _v1()
    doc["version"] = 3
    with pytest.raises(ValueError, match=r"profile version 3; this lightning_3d reads versions \[1, 2\]\. Re-run"):
        _model(doc)
    bad = _v2()
    bad["overheads"]["step_seconds"] = -1.0
    with pytest.raises(ValueError, match="'overheads' must hold microbatch_seconds and step_seconds as non-negative"):
        _model(bad)
    half = _v2(host=1e-3)
    del half["layers"]["block"][0]["host_backward"]
    with pytest.raises(ValueError, match=r"layers.block\[0\] has one of host_forward/host_backward without the other"):
        _model(half)


def test_compiled_grids_are_read_on_request_and_missing_ones_named() -> None:
    doc = _v2()
    fast = copy.deepcopy(doc["layers"]["block"][0])
    fast["compiled"] = True
    fast["forward"] = [[None if v is None else v / 2 for v in row] for row in fast["forward"]]
    doc["layers"]["block"].append(fast)
    eager, compiled = _model(doc), _model(doc, compiled=True)
    fe, _ = eager.layer_time("block", 2, SEQ)
    fc, _ = compiled.layer_time("block", 2, SEQ)
    assert float(fc) == pytest.approx(float(fe) / 2, rel=1e-12)
    # Head and embedding have no compiled grid here: the eager ones serve.
    assert compiled.layer_time("head", 2, SEQ) == eager.layer_time("head", 2, SEQ)
    # The compiled model has no checkpointed block grid: inf (never picked), not the eager one.
    assert math.isinf(float(compiled.layer_time("block", 2, SEQ, recompute=True)[0]))
    with pytest.raises(ValueError, match=r"has no compiled grid for \['block'\]: profile with `lightning-3d profile --compile`"):
        _model(_v2(), compiled=True)


def _compiled_over(doc: dict, kind: str, lens: list[int], speedup: list[float], host: bool = False) -> dict:
    """``doc`` with a compiled grid of ``kind`` at ``lens`` only (a subset of the eager lengths): every quantity the
    eager one's at those lengths times ``speedup[j]`` (the j-th length's)."""
    eager = doc["layers"][kind][0]
    cols = [eager["seq_len"].index(n) for n in lens]
    fast = {"tp": eager["tp"], "recompute": eager["recompute"], "compiled": True,
            "microbatch_size": eager["microbatch_size"], "seq_len": lens, "target_len": None}
    for q in ("forward", "backward", "stored", "peak", *(("host_forward", "host_backward") if host else ())):
        fast[q] = [[None if row[c] is None else row[c] * f for c, f in zip(cols, speedup)] for row in eager[q]]
    doc["layers"][kind].append(fast)
    return doc


def test_a_compiled_grid_prices_lengths_outside_it_by_the_eager_grid_and_the_nearest_ratio() -> None:
    doc = _v2(host=1e-4)
    block = doc["layers"]["block"][0]
    for q in ("forward", "backward", "host_forward", "host_backward"):  # times that grow with the length, so that
        # "eager there x ratio" differs from "the compiled value at the nearest length"
        block[q] = [[None if v is None else v * n / 256 for v, n in zip(row, block["seq_len"])] for row in block[q]]
    doc = _compiled_over(doc, "block", [512, 1024], [0.5, 0.25], host=True)
    doc["layers"]["block"][-1]["stored"][3][1] = None  # the compiled block ran out of memory at 8 x 1024
    eager = _model(doc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = ProfiledCostModel(doc, compiled=True, derive_tp=True)
        compiled.layer_time("block", 2, 2048)
        compiled.layer_memory("block", 2, 256)  # the same kind again: no second warning
    assert [str(w.message) for w in caught] == [
        "The profile's compiled 'block' grid holds seq_len 512..1024: shapes outside it are priced as its eager grid"
        " times the compiled-to-eager ratio at the nearest compiled length. For measured prices, profile with compiled"
        " grids over the lengths you train (`lightning-3d profile --compile`, or `planner.add_compiled` on this"
        " profile)."]
    assert caught[0].filename == __file__  # attributed to the caller, not to the cost model
    sizes = np.array([1, 2, 4])
    for name in ("layer_time", "layer_memory", "layer_host_time"):
        got_of, want_of = getattr(compiled, name), getattr(eager, name)
        for length, ratio in ((256, 0.5), (384, 0.5), (2048, 0.25), (768, None)):
            got, want = got_of("block", sizes, length), want_of("block", sizes, length)
            if ratio is None:  # inside the compiled lengths: the compiled grid's own interpolation, as measured
                at512, at1024 = want_of("block", sizes, 512), want_of("block", sizes, 1024)
                want, ratio = tuple((0.5 * a + 0.25 * b) / 2 for a, b in zip(at512, at1024)), 1.0
            for g, w in zip(got, want):  # outside: the eager price times the ratio at the nearest compiled length
                np.testing.assert_allclose(g, w * ratio, rtol=1e-12)
    # A tensor-parallel degree derived from the tp = 1 grids extrapolates the same way (the shard's ratio on top).
    for length in (256, 768):
        derived = compiled.layer_time("block", 2, length, tp=2)
        assert all(np.isfinite(x) and x > 0 for x in map(float, derived))
    # An out-of-memory cell inside the compiled lengths stays out of memory; outside, the eager grid's holes stay too.
    assert math.isinf(float(compiled.layer_memory("block", 8, 1024)[0]))
    assert math.isinf(float(compiled.layer_time("block", 8, 2048)[0]))
    # Lengths outside the eager grid too are unpriced, as in any grid.
    assert math.isinf(float(compiled.layer_time("block", 1, 4096)[0]))
    # An eager model reads the eager grid only, and warns of nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ProfiledCostModel(doc).layer_time("block", 2, 2048)


def test_an_unpriced_ratio_times_a_zero_cell_is_unpriced_not_nan() -> None:
    """0 x inf: an eager cell of zero bytes outside the compiled lengths, whose nearest compiled cell is out of memory.
    NaN would pass a memory budget's comparison; the price is inf."""
    doc = _compiled_over(_v2(), "block", [512, 1024], [0.5, 0.25])
    doc["layers"]["block"][0]["stored"][1][0] = 0.0  # eager: 2 x 256 stores nothing
    doc["layers"]["block"][-1]["stored"][1][0] = None  # compiled: 2 x 512 ran out of memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the extrapolation's own notice
        warnings.simplefilter("error", RuntimeWarning)  # no "invalid value" from 0 x inf
        stored, _ = ProfiledCostModel(doc, compiled=True).layer_memory("block", 2, 256)
    assert math.isinf(float(stored))


def test_in_situ_floor_holds_for_eager_blocks_only() -> None:
    # The in-situ host times come from eager tiny models: a compiled block's host time is its own grid's.
    doc = _with_in_situ(_v2(host=1e-6), 0.02, 0.03, 0.025, 0.07)
    fast = copy.deepcopy(doc["layers"]["block"][0])
    fast["compiled"] = True
    doc["layers"]["block"].append(fast)
    assert tuple(float(x) for x in _model(doc).layer_host_time("block", 2, SEQ)) == (0.02, 0.03)
    assert tuple(float(x) for x in _model(doc, compiled=True).layer_host_time("block", 2, SEQ)) == (1e-6, 1e-6)


def test_marginal_layer_time_is_clamped_to_one_call() -> None:
    from lightning_3d.planner.timing import marginal as _marginal

    assert _marginal(1.0, 2.6, 3) == pytest.approx(0.8)  # T(1) = 0.2 fixed + 0.8, T(3) = 0.2 + 2.4
    assert _marginal(1.0, 0.9, 3) == 0.0  # noise: T(3) < T(1)
    assert _marginal(1.0, 5.0, 3) == 1.0  # noise: more than a call of its own


def test_the_microbatch_overhead_prices_the_layers_by_the_max_rule() -> None:
    from lightning_3d.costs.host import microbatch_overhead_from

    layers = [{"forward": 2.0, "backward": 1.0, "host_forward": 1.0, "host_backward": 3.0},
              {"forward": 2.0, "backward": 1.0, "host_forward": 0.5, "host_backward": 1.0}]
    # forward device-bound (4 > 1.5), backward host-bound (4 > 2): 8 of the 10 seconds are the layers'.
    assert microbatch_overhead_from(10.0, layers) == 2.0
    assert microbatch_overhead_from(7.0, layers) == 0.0  # less than its layers: noise, clamped
    assert microbatch_overhead_from(1.5, []) == 1.5


def test_the_cpu_profile_is_version_2_with_host_times_and_overheads(tmp_path) -> None:
    import lightning_3d.recipes  # noqa: F401
    from lightning_3d.planner import profile_model

    cfg = {"trainer": {"precision": "32-true"},
           "model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {"preset_name": "tiny", "vocab_size": 512,
                                                                              "num_layers": 2}},
           "data": {"init_args": {"seq_length": 32}}}
    doc = profile_model(cfg, device="cpu", microbatch_sizes=[1, 2], seq_lens=[32], warmup=1, repeats=2,
                        collectives=False, log=lambda *a: None)
    # The strategy's default fusion ("auto"): the tiny model's weights are all below the threshold, none fused.
    assert doc["version"] == 2 and doc["gradient_accumulation_fusion"] == "auto"
    assert doc["fused_weights"] == {"embedding": 0, "block": 0, "head": 0}
    with pytest.raises(ValueError, match=r"`fuse_gradients='yes'` must be True \(every fusable nn.Linear\), False \(none\) or 'auto'"):
        profile_model(cfg, device="cpu", fuse_gradients="yes")
    block = doc["layers"]["block"][0]
    for q in ("host_forward", "host_backward"):
        assert all(v is not None and v >= 0 for row in block[q] for v in row)
    o = doc["overheads"]
    assert o["microbatch_seconds"] >= 0 and o["step_seconds"] >= 0 and o["microbatches"] == [1, 4]
    assert o["in_situ_rounds"] == 1  # one round of fits on the CPU (three by default on a GPU)
    # The per-micro-batch overhead: the tiny model's measured micro-batch less its layers priced as the planner
    # prices a pass (the blocks' host at its in-situ time), from the stored seconds.
    from lightning_3d.costs.host import microbatch_overhead_from

    one, many = o["measured_step_seconds"]
    kinds = ["embedding", "block", "head"]
    assert set(o["tiny_layers"]) == set(kinds) and o["tiny_layers"]["block"]["host_forward"] == o["host_layers"][
        "block"]["forward"] and o["tiny_layers"]["block"]["host_backward"] == o["host_layers"]["block"]["backward"]
    assert o["microbatch_seconds"] == microbatch_overhead_from(max(0.0, (many - one) / 3),
                                                               [o["tiny_layers"][k] for k in kinds])
    # The in-situ host terms: the tiny model at the real depth (2 blocks), without and with checkpointing.
    assert set(o["host_microbatch_seconds"]) == {"depth_1", "depth", "depth_recompute"}
    assert len(o["host_scale"]) == 2 and min(o["host_scale"]) >= 0.0
    assert set(o["host_layers_isolated"]) == {"block"} and o["host_tiny_blocks"] == {"block": 1}
    # The terms are the isolated times scaled as the depth equations solved (scales at least 0: on a loaded CPU one
    # more tiny block can measure as nothing, so the values themselves are not asserted positive).
    (s, s_rc), iso = o["host_scale"], o["host_layers_isolated"]["block"]
    assert set(o["host_layers"]) == {"block"} and o["host_layers"]["block"] == pytest.approx(
        {"forward": s * iso["forward"], "backward": s * iso["backward"],
         "recompute_forward": s_rc * iso["recompute_forward"], "recompute_backward": s_rc * iso["recompute_backward"]},
        rel=1e-12)
    assert all(v > 0 for v in iso.values())  # a block's isolated host time: the host always takes some
    # The step's growth per block: the tails of every timed step (the one-layer model's two fits, the two deep
    # models' two fits each, the same steps per fit), the deep model (2 blocks) against the one-layer model, each
    # less its optimizer step, recomputed from the stored seconds.
    import statistics

    assert o["step_blocks"] == 1 and o["deep_optimizer_seconds"] > 0 and o["tiny_optimizer_seconds"] > 0
    assert len(o["tail_seconds"]) > 0 and len(o["deep_tail_seconds"]) == 2 * len(o["tail_seconds"])
    assert all(t > 0 for t in o["tail_seconds"] + o["deep_tail_seconds"])
    growth = ((statistics.median(o["deep_tail_seconds"]) - o["deep_optimizer_seconds"])
              - (statistics.median(o["tail_seconds"]) - o["tiny_optimizer_seconds"]))
    assert o["step_seconds_per_block"] == pytest.approx(max(0.0, growth), rel=1e-12, abs=0.0)
    assert o["step_seconds_depth"] == pytest.approx(o["step_seconds"] + o["step_seconds_per_block"], rel=1e-12)
    assert doc["optimizer"]["parameters"] > 0 and doc["optimizer"]["step_seconds"] > 0
    assert set(doc["call_overhead"]) == {"forward_seconds", "backward_seconds"}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc, allow_nan=False))
    cm = ProfiledCostModel(path)
    assert cm.version == 2 and cm.step_overhead_seconds == o["step_seconds"]
    assert float(cm.layer_host_time("block", 2, 32)[1]) >= o["host_layers"]["block"]["backward"]  # a floor
    p = predict(Candidate(1, 1, 1, 2, 2, "1f1b", 1, (2,), (False,), False),
                Workload(cm.shape, 32, 4, cm, ClusterSpec(1, 1, cm.device, 1e11, 1e10)))
    # One GPU holds both blocks: one more than the tiny model's.
    assert math.isfinite(p.step_time)
    assert p.overhead_time == pytest.approx(o["step_seconds"] + o["step_seconds_per_block"], rel=1e-12)


def _validate_module():
    spec = importlib.util.spec_from_file_location("planner_validate",
                                                  Path(__file__).parent.parent / "benchmarks" / "planner" / "planner_validate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("planner_validate", module)  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_validation_prints_the_step_seconds_growth_per_block() -> None:
    v = _validate_module()
    doc = {"overheads": {"microbatch_seconds": 4e-4, "step_seconds": 3.06e-3, "step_seconds_per_block": 1.95e-4,
                         "step_blocks": 1}, "optimizer": {"step_seconds": 0.0127}}
    assert "step 3.06 ms + 0.195 ms per block beyond 1, call" in v._overheads(doc)
    del doc["overheads"]["step_seconds_per_block"]
    assert "step 3.06 ms, call" in v._overheads(doc)


def test_validation_summary_mape_rank_correlation_and_choice() -> None:
    v = _validate_module()
    rows = [{"config": "a", "predicted_step_s": 1.0, "step_s": 1.25, "time_error": 1.0 / 1.25 - 1, "memory_error": 0.05},
            {"config": "b", "predicted_step_s": 2.0, "step_s": 2.0, "time_error": 0.0, "memory_error": -0.08},
            {"config": "c", "predicted_step_s": 3.0, "step_s": 1.0, "time_error": 2.0, "memory_error": None},
            {"config": "d", "predicted_step_s": 0.5, "error": "timed out"}]
    s = v.summarize(rows)
    assert s["measured"] == 3 and s["configs"] == 4
    assert s["time_mape"] == pytest.approx((0.2 + 0.0 + 2.0) / 3)
    assert s["spearman"] == pytest.approx(-0.5)  # ranks (1, 2, 3) against (2, 3, 1)
    assert s["memory_max_abs_error"] == pytest.approx(0.08)
    assert (s["planner_choice"], s["best_measured"]) == ("a", "c")
    assert s["choice_vs_best_measured"] == pytest.approx(1.0 / 1.25)


def test_validation_summary_prices_the_rows_at_the_burst_clock_beside() -> None:
    v = _validate_module()
    rows = [{"config": "a", "predicted_step_s": 1.1, "burst_step_s": 1.0, "step_s": 1.2, "time_error": 1.1 / 1.2 - 1},
            {"config": "b", "predicted_step_s": 2.0, "step_s": 2.0, "time_error": 0.0}]  # no section: its prediction
    s = v.summarize(rows)
    assert s["burst_time_mape"] == pytest.approx((0.2 / 1.2 + 0.0) / 2)
    assert s["time_mape"] == pytest.approx((0.1 / 1.2) / 2)
    assert v.burst_prediction(None, None, {"layers": {}}, None) is None  # a profile without the term: none


def test_validation_suites_are_the_sizes_the_issue_asks() -> None:
    v = _validate_module()
    one = [c for m in v.ONE.values() for c in m.configs]
    assert len(one) >= 10 and set(v.ONE) == {"gpt_350m", "gpt_1.3b", "t5_770m"}
    assert any(c.ckpt for c in one) and any(c.compile for c in one) and len({c.mbs for c in one}) >= 4
    four = [c for m in v.FOUR.values() for c in m.configs]
    assert len(four) >= 12
    layouts = {c.layout for c in four}
    assert layouts == {(dp, pp, tp) for dp in (1, 2, 4) for pp in (1, 2, 4) for tp in (1, 2, 4) if dp * pp * tp == 4}
    assert {c.layout for c in four[:len(layouts)]} == layouts  # measured first: a budget cut keeps every layout
    assert {c.schedule for c in four} == {"gpipe", "1f1b", "interleaved_1f1b"} and any(c.split for c in four)
    for model in v.FOUR.values():
        for c in model.configs:  # one global batch per model, and splits that cover the layers
            assert c.layout[0] * c.mbs * c.m == model.batch, c.label()
            if c.split:
                assert len(c.split) == c.layout[1] * c.v and sum(c.split) == 24
    for model in v.ONE.values():
        assert all(c.mbs * c.m == model.batch for c in model.configs)


def test_compiled_grids_profiled_alone_join_an_eager_profile(monkeypatch) -> None:
    import lightning_3d.recipes  # noqa: F401
    from lightning_3d.planner import profile_model

    monkeypatch.setenv("L3D_COMPILE_BACKEND", "aot_eager")  # the recipes' switch: no C++ build on CI
    cfg = {"trainer": {"precision": "32-true"},
           "model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {"preset_name": "tiny", "vocab_size": 512,
                                                                              "num_layers": 2}},
           "data": {"init_args": {"seq_length": 32}}}
    kw = dict(device="cpu", seq_lens=[32], warmup=1, repeats=1, collectives=False, overheads=False, log=lambda *a: None)
    eager = profile_model(cfg, microbatch_sizes=[1, 2], **kw)
    compiled = profile_model(cfg, microbatch_sizes=[2], compile=True, compile_microbatch_sizes=[2], eager=False, **kw)
    assert not compiled.get("compile_errors")
    assert {k: [e.get("compiled") for e in v] for k, v in compiled["layers"].items()} == {"block": [True], "head": [True]}
    for kind, entries in compiled["layers"].items():
        eager["layers"][kind].extend(entries)
    cm = ProfiledCostModel(eager, compiled=True)
    f, b = cm.layer_time("block", 2, 32)
    assert 0 < float(f) < math.inf and 0 < float(b) < math.inf
    assert math.isinf(float(cm.layer_time("block", 1, 32)[0]))  # compiled only at micro-batch 2
    assert float(cm.layer_time("embedding", 1, 32)[0]) > 0  # eager embedding serves the compiled model


def test_a_stage_overlaps_host_and_device_across_its_layers() -> None:
    # Half the layers host-bound, half device-bound: the stage's pass is max(Σ device, Σ host), not Σ max.
    doc = _v2(host=None)
    cm = _model(doc)
    dev_f, dev_b = (float(x) for x in cm.layer_time("block", 2, SEQ))
    doc = _v2(host=None)
    for e in doc["layers"]["block"]:
        e["host_forward"] = [[2 * dev_f] * len(e["seq_len"]) for _ in e["microbatch_size"]]
        e["host_backward"] = [[0.0] * len(e["seq_len"]) for _ in e["microbatch_size"]]
    for kind in ("embedding", "head"):
        for e in doc["layers"][kind]:
            e["host_forward"] = [[0.0] * len(e["seq_len"]) for _ in e["microbatch_size"]]
            e["host_backward"] = [[0.0] * len(e["seq_len"]) for _ in e["microbatch_size"]]
    cm = _model(doc)
    w = _workload(cm)
    ends_f = sum(float(cm.layer_time(k, 2, SEQ)[0]) for k in ("embedding", "head"))
    ends_b = sum(float(cm.layer_time(k, 2, SEQ)[1]) for k in ("embedding", "head"))
    fwd, bwd, *_ = stage_costs(_one_gpu(2, 1), w)
    # forward: host 2·dev_f per block against the device's dev_f per block plus the ends
    assert fwd[0] == pytest.approx(max(LAYERS * 2 * dev_f, LAYERS * dev_f + ends_f), rel=1e-12)
    assert bwd[0] == pytest.approx(LAYERS * dev_b + ends_b, rel=1e-12)  # host 0: the device's sum


def _with_in_situ(doc: dict, f: float, b: float, rf: float, rb: float) -> dict:
    doc["overheads"]["host_layers"] = {"block": {"forward": f, "backward": b, "recompute_forward": rf,
                                                 "recompute_backward": rb}}
    return doc


def test_in_situ_host_times_are_the_eager_blocks_host_time_at_every_size() -> None:
    # The in-situ time replaces the isolated grid, above it or below it.
    cm = _model(_with_in_situ(_v2(host=0.04), 0.02, 0.03, 0.025, 0.07))
    assert tuple(float(x) for x in cm.layer_host_time("block", 2, SEQ)) == (0.02, 0.03)
    assert tuple(float(x) for x in cm.layer_host_time("block", 2, SEQ, recompute=True)) == (0.025, 0.07)
    assert float(cm.layer_host_time("head", 2, SEQ)[0]) == pytest.approx(0.04)  # the ends keep their grids
    f, b = cm.layer_host_time("block", np.array([1, 2, 8]), SEQ)
    assert f.shape == (3,) and list(f) == [0.02] * 3 and list(b) == [0.03] * 3
    cm = _model(_with_in_situ(_v2(host=1e-6), 0.02, 0.03, 0.025, 0.07))
    for mbs in (1, 2, 8):
        assert tuple(float(x) for x in cm.layer_host_time("block", mbs, SEQ)) == (0.02, 0.03)
        assert tuple(float(x) for x in cm.layer_host_time("block", mbs, SEQ, recompute=True)) == (0.025, 0.07)
        assert tuple(float(x) for x in cm.layer_host_time("block", mbs, SEQ, tp=4)) == (0.02, 0.03)
        assert float(cm.layer_host_time("head", mbs, SEQ)[0]) == pytest.approx(1e-6)  # ends keep their grids
    # Host-bound: a one-stage step is m × (blocks' in-situ host + the ends' own) + the fixed terms.
    w = _workload(cm)
    for ckpt, (f, b) in ((False, (0.02, 0.03)), (True, (0.025, 0.07))):
        p = predict(_one_gpu(2, 4, ckpt), w)
        assert LAYERS * (f + b) > 2 * _device_sum(cm, 2, ckpt)  # host-bound indeed
        # per pass: the blocks' in-situ host plus the embedding's and head's host (1e-6 each)
        assert p.pipeline_time == pytest.approx(4 * (LAYERS * (f + b) + 4e-6), rel=1e-12)


def test_in_situ_host_layers_are_checked_by_name() -> None:
    doc = _with_in_situ(_v2(host=1e-6), 0.02, 0.03, 0.025, 0.07)
    doc["overheads"]["host_layers"]["block"]["forward"] = -1.0
    with pytest.raises(ValueError, match="'overheads.host_layers' must map block kinds"):
        _model(doc)
    doc = _with_in_situ(_v2(host=1e-6), 0.02, 0.03, 0.025, 0.07)
    doc["overheads"]["host_layers"]["head"] = doc["overheads"]["host_layers"]["block"]
    with pytest.raises(ValueError, match="re-run `lightning-3d profile`"):
        _model(doc)


def test_the_in_situ_scale_solves_the_depth_equations() -> None:
    from lightning_3d.costs import ModelShape
    from lightning_3d.planner import host_layers_in_situ

    tiny = ModelShape("gpt", 1, 64, 2, 256, 512)
    real = ModelShape("gpt", 24, 1024, 16, 4096, 50304)
    host = {("block", False): (1e-3, 2e-3), ("block", True): (1.5e-3, 4e-3)}
    ends, s, s_rc = 1.2e-3, 1.6, 1.3  # a micro-batch's cost outside the blocks; the loop's scales
    c_1 = ends + s * 3e-3
    deep = {False: ends + s * 24 * 3e-3, True: ends + s_rc * 24 * 5.5e-3}
    out = host_layers_in_situ(host, tiny, real, c_1, deep)
    assert out["host_scale"] == pytest.approx([s, s_rc], rel=1e-12)
    assert out["host_layers"]["block"] == pytest.approx({"forward": s * 1e-3, "backward": s * 2e-3,
                                                         "recompute_forward": s_rc * 1.5e-3,
                                                         "recompute_backward": s_rc * 4e-3}, rel=1e-12)
    assert out["host_layers_isolated"]["block"] == {"forward": 1e-3, "backward": 2e-3, "recompute_forward": 1.5e-3,
                                                    "recompute_backward": 4e-3}
    assert out["host_tiny_blocks"] == {"block": 1}
    # A loop faster than the tight loop's timing of the tiny block: the scales as measured, below 1 too (the loop's
    # seconds are what a step costs; the isolated times only split them among the passes).
    s, s_rc = 0.8, 0.6
    c_1 = ends + s * 3e-3
    slow = host_layers_in_situ(host, tiny, real, c_1, {False: ends + s * 24 * 3e-3, True: ends + s_rc * 24 * 5.5e-3})
    assert slow["host_scale"] == pytest.approx([s, s_rc], rel=1e-12)
    assert slow["host_layers"]["block"]["backward"] == pytest.approx(s * 2e-3, rel=1e-12)
    # No depth cost at all (c_deep = c_1): no in-situ floor; a checkpointed run below the ends: none either.
    flat = host_layers_in_situ(host, tiny, real, c_1, {False: c_1, True: 0.0})
    assert flat["host_scale"] == [0.0, 0.0] and set(flat["host_layers"]["block"].values()) == {0.0}


def _in_situ_seconds(doc: dict, s: float, s_rc: float, ends: float = 1.2e-3, clamped: bool = True) -> dict:
    """``doc`` with the in-situ fields a profile stores for tiny isolated block host times (1, 2; 1.5, 4 ms) and loop
    scales ``s``, ``s_rc``: the seconds of the tiny models at depth 1 and LAYERS; ``clamped``: as profiles before the
    scales were taken as measured wrote them (terms and scales clamped at 1, no isolated times stored)."""
    iso = {"forward": 1e-3, "backward": 2e-3, "recompute_forward": 1.5e-3, "recompute_backward": 4e-3}
    seconds = {"depth_1": ends + s * 3e-3, "depth": ends + s * LAYERS * 3e-3, "depth_recompute": ends + s_rc * LAYERS * 5.5e-3}
    o = doc["overheads"]
    o["host_microbatch_seconds"] = seconds
    if clamped:
        c, c_rc = max(s, 1.0), max(s_rc, 1.0)
        o["host_scale"] = [c, c_rc]
        o["host_layers"] = {"block": {q: v * (c_rc if q.startswith("recompute") else c) for q, v in iso.items()}}
    else:
        o["host_scale"] = [s, s_rc]
        o["host_layers"] = {"block": {q: v * (s_rc if q.startswith("recompute") else s) for q, v in iso.items()}}
        o["host_layers_isolated"], o["host_tiny_blocks"] = {"block": iso}, {"block": 1}
    return doc


@pytest.mark.parametrize("clamped", [True, False])
def test_in_situ_terms_are_read_from_the_measured_seconds(clamped: bool) -> None:
    # The loop measured 0.8x the tiny block's tight-loop time (1.3x checkpointed): the floor is the loop's seconds,
    # also from a profile whose stored terms were clamped at 1x (re-derived from its stored seconds and scales).
    cm = _model(_in_situ_seconds(_v2(host=1e-6), 0.8, 1.3, clamped=clamped))
    assert cm.host_layers_in_situ["block"] == pytest.approx(
        {"forward": 0.8e-3, "backward": 1.6e-3, "recompute_forward": 1.3 * 1.5e-3, "recompute_backward": 1.3 * 4e-3},
        rel=1e-9)
    for mbs in (1, 4):
        f, b = cm.layer_host_time("block", mbs, SEQ)
        assert (float(f), float(b)) == pytest.approx((0.8e-3, 1.6e-3), rel=1e-9)
    # A host-bound one-stage micro-batch costs the depth's in-loop seconds: LAYERS blocks at 0.8 x 3 ms.
    w = _workload(cm, gpus=1)
    from lightning_3d.planner.model import layer_terms

    t = layer_terms(1, 1, False, w)
    assert t["blocks_host_f"] + t["blocks_host_b"] == pytest.approx(LAYERS * 0.8 * 3e-3, rel=1e-9)


def test_in_situ_scales_split_the_depth_among_block_kinds() -> None:
    # T5: an encoder and a decoder block per tiny model, 3 + 2 at depth; the scales solve the same equations.
    from lightning_3d.costs.host import in_situ_host_layers

    iso = {"encoder_block": {"forward": 1e-3, "backward": 2e-3, "recompute_forward": 1e-3, "recompute_backward": 3e-3},
           "decoder_block": {"forward": 2e-3, "backward": 3e-3, "recompute_forward": 2e-3, "recompute_backward": 5e-3}}
    ends, s, s_rc = 2e-3, 1.4, 0.9
    one, deep = {"encoder_block": 1, "decoder_block": 1}, {"encoder_block": 3, "decoder_block": 2}
    c_1, c_deep = ends + s * 8e-3, ends + s * (3 * 3e-3 + 2 * 5e-3)
    layers, scales = in_situ_host_layers(iso, one, deep, c_1, c_deep, ends + s_rc * (3 * 4e-3 + 2 * 7e-3))
    assert scales == pytest.approx([s, s_rc], rel=1e-12)
    assert layers["decoder_block"] == pytest.approx({"forward": s * 2e-3, "backward": s * 3e-3,
                                                     "recompute_forward": s_rc * 2e-3, "recompute_backward": s_rc * 5e-3},
                                                    rel=1e-12)


@pytest.mark.parametrize("field,value,message", [
    ("host_microbatch_seconds", {"depth_1": 1e-3, "depth": -1.0, "depth_recompute": 1e-3},
     "'overheads.host_microbatch_seconds' must hold non-negative"),
    ("host_tiny_blocks", {"block": 0}, "'overheads.host_tiny_blocks' must map block kinds"),
    ("host_layers_isolated", {"head": {}}, "'overheads.host_layers_isolated' must map block kinds"),
])
def test_in_situ_seconds_are_checked_by_name(field: str, value: object, message: str) -> None:
    doc = _in_situ_seconds(_v2(host=1e-6), 0.8, 1.3, clamped=False)
    doc["overheads"][field] = value
    with pytest.raises(ValueError, match=message):
        _model(doc)


def test_in_situ_terms_without_their_seconds_are_read_as_stored() -> None:
    doc = _with_in_situ(_v2(host=1e-6), 0.02, 0.03, 0.025, 0.07)
    doc["overheads"]["host_scale"] = [1.0, 1.0]  # the seconds absent: nothing to re-derive from
    assert _model(doc).host_layers_in_situ["block"] == {"forward": 0.02, "backward": 0.03, "recompute_forward": 0.025,
                                                        "recompute_backward": 0.07}


def test_grids_are_read_non_decreasing_in_microbatch_size() -> None:
    from lightning_3d.costs.profiled import monotone_in_microbatch

    # Pool adjacent violators: the least-squares non-decreasing fit; unprofiled (inf) cells stay.
    np.testing.assert_allclose(monotone_in_microbatch(np.array([[3.0], [1.0], [5.0], [2.0], [4.0]])).ravel(),
                               [2.0, 2.0, 3.5, 3.5, 4.0], rtol=1e-12)
    np.testing.assert_array_equal(monotone_in_microbatch(np.array([[1.0, 2.0], [3.0, math.inf]])),
                                  [[1.0, 2.0], [3.0, math.inf]])
    mono = np.array([[1.0], [2.0], [2.0], [7.0]])
    np.testing.assert_array_equal(monotone_in_microbatch(mono), mono)  # a monotone grid is kept as it is
    # Read so from a profile: a backward that falls at micro-batch 2 is pooled with micro-batch 1's.
    doc = _v2(host=1e-3)
    e = doc["layers"]["block"][0]
    col = e["microbatch_size"].index(2)
    e["backward"][col] = [x * 1e-3 for x in e["backward"][col]]
    raw1, raw2 = _v1()["layers"]["block"][0]["backward"][col - 1][0], e["backward"][col][0]
    cm = _model(doc)
    b1, b2 = (float(cm.layer_time("block", mbs, e["seq_len"][0])[1]) for mbs in (1, 2))
    assert b1 == pytest.approx((raw1 + raw2) / 2, rel=1e-12) and b2 == pytest.approx(b1, rel=1e-12)


def test_recompute_rebuilds_a_saved_reports_predictions_from_its_profiles(capsys) -> None:
    v = _validate_module()
    results = Path(__file__).parent.parent / "benchmarks" / "results"
    report = results / "2026-11-27_planner_validate_one_1xh200.json"
    names = ("gpt_350m", "gpt_1.3b", "t5_770m")
    out = v.recompute(str(report), {n: str(results / f"2026-11-27_profile_one_{n}_1xh200.json") for n in names})
    saved = json.loads(report.read_text())
    assert out["all"]["old"]["time_mape"] == pytest.approx(saved["all"]["time_mape"], rel=1e-12)
    assert out["all"]["new"]["measured"] == saved["all"]["measured"] == 13
    for name in names:  # the same measured steps, predictions of the current model
        rows = out["models"][name]["rows"]
        assert [r["step_s"] for r in rows] == [r["step_s"] for r in saved["models"][name]["rows"] if "step_s" in r]
        assert all(r["time_error"] == pytest.approx(r["predicted_step_s"] / r["step_s"] - 1) for r in rows)
        # memory too: the current model's peak against the measured one
        assert all(r["memory_error"] == pytest.approx(r["predicted_peak_bytes"] / r["peak_bytes"] - 1) for r in rows)
        # the suite's presets tie their heads (the profiles of that day predate the field: the config says so)
        cm = v.ProfiledCostModel(json.loads((results / f"2026-11-27_profile_one_{name}_1xh200.json").read_text()))
        assert not cm.shape.tied_embeddings and v.shape_of(v.ONE[name], cm).tied_embeddings
    assert "ALL: MAPE old 15.0 %" in capsys.readouterr().out


def test_the_overheads_train_and_profile_the_tiny_model_with_the_profiles_fusion(monkeypatch) -> None:
    """The per-micro-batch overhead and the in-situ floor must come from steps that run what the profiled step runs:
    with fuse_gradients=True every linear of the tiny model is fused (a custom op per linear per micro-batch in the
    backward), in its Trainer runs (the strategy is built with that setting) and in its layers' profile alike."""
    import torch

    import lightning_3d.recipes  # noqa: F401
    import lightning_3d.strategies.compressed_3d as c3d
    from lightning_3d.planner import measure_overheads

    built = []

    class Spy(c3d.Compressed3DStrategy):
        def __init__(self, *args, **kwargs) -> None:
            runtime = kwargs.get("runtime")
            built.append(runtime.gradient_accumulation_fusion if runtime is not None else "unset")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(c3d, "Compressed3DStrategy", Spy)
    from lightning_3d.costs import ModelShape

    shape = ModelShape(family="gpt", num_layers=1, hidden_size=128, num_heads=4, ffn_hidden_size=512, vocab_size=512)
    cfg = {"trainer": {"precision": "32-true"}, "model": {"class_path": "lightning_3d.recipes.GPT",
                                                          "init_args": {"preset_name": "tiny"}}}
    out = measure_overheads(cfg, shape, torch.device("cpu"), "32-true", microbatches=2, warmup=1, steps=2,
                            in_situ=False, fuse_gradients=True, fresh_process=False, log=lambda *a: None)
    # in this process (fresh_process=False), where the spy sees the strategies built the fits at 1 and at 2 micro-batches
    assert built == [True, True]
    assert out["gradient_accumulation_fusion"] is True
    # Every nn.Linear of the tiny block fused (q, k, v, output projection and the MLP's two), none of the others.
    assert out["tiny_fused_weights"] == {"embedding": 0, "block": 6, "head": 0}


def test_the_fresh_process_past_its_timeout_is_ended_and_the_error_raised(monkeypatch) -> None:
    # The tiny models' process must not hold a profile up: past FRESH_PROCESS_TIMEOUT_S it is killed and the caller
    # gets subprocess.TimeoutExpired (profile_model records it as "overheads not measured"). Half a second is far
    # less than the new interpreter takes to import torch and Lightning, let alone fit three models.
    import subprocess

    import torch

    import lightning_3d.planner.overheads as prof
    from lightning_3d.costs import ModelShape

    monkeypatch.setattr(prof, "FRESH_PROCESS_TIMEOUT_S", 0.5)
    shape = ModelShape(family="gpt", num_layers=2, hidden_size=128, num_heads=4, ffn_hidden_size=512, vocab_size=512)
    cfg = {"trainer": {"precision": "32-true"}, "model": {"class_path": "lightning_3d.recipes.GPT",
                                                          "init_args": {"preset_name": "tiny"}}}
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        prof.measure_overheads(cfg, shape, torch.device("cpu"), "32-true", microbatches=2, warmup=1, steps=2,
                               log=lambda *a: None)
    assert time.monotonic() - started < 30  # killed at the timeout, not waited for


def test_the_fresh_interpreter_does_not_run_the_callers_main_module(tmp_path) -> None:
    """A script that profiles without an ``if __name__ == "__main__":`` guard runs once: the tiny models' process is a
    new interpreter, not a multiprocessing worker that would import the script again. Its failure (here an unknown
    preset of the registered GPT recipe's tiny model, so that nothing trains) comes back as an error with the worker's
    own message."""
    script = tmp_path / "unguarded.py"
    marker = tmp_path / "runs.txt"
    script.write_text(f"""
from dataclasses import replace
import torch
import lightning_3d.recipes
import lightning_3d.planner.overheads as prof
from lightning_3d.costs import recipe_costs
with open({str(marker)!r}, "a") as f:
    f.write("run\\n")
tiny = replace(recipe_costs("lightning_3d.recipes.GPT").tiny, model_args={{"preset_name": "no_such_preset"}})
args = (tiny, {{}}, torch.device("cpu"), "32-true", 2, 0, 1, True, False)
try:
    prof._tiny_runs_in_fresh_interpreter(args)
except RuntimeError as error:
    assert "the tiny models' process exited with 1" in str(error) and "no_such_preset" in str(error), error
else:
    raise AssertionError("no error")
""")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    subprocess.run([sys.executable, str(script)], check=True, timeout=300, env=env, cwd=tmp_path)
    assert marker.read_text() == "run\n"  # the script ran once


def test_in_situ_rounds_interleave_the_fits_and_pool_their_steps(monkeypatch) -> None:
    from lightning_3d.planner import tiny_runs as runs

    calls = []

    def fake_train_tiny(tiny, model_args, data_args, device, precision, microbatches, warmup, steps, fuse,
                        optimizer_out=None, tails_out=None, adamw=None):
        deep = "activation_checkpointing" in model_args
        label = ("deep", model_args["activation_checkpointing"]) if deep else ("one", None)
        calls.append((label, optimizer_out is not None))
        k = len(calls)  # each fit's steps tell which fit they came from
        if tails_out is not None:
            tails_out.setdefault(microbatches, []).append(k / 1000)
        if optimizer_out is not None:
            optimizer_out["step_seconds"] = 0.5
        return {1: [k + 0.1, k + 0.2], microbatches: [k + 0.3]}

    monkeypatch.setattr(runs, "train_tiny", fake_train_tiny)

    class Tiny:
        model_args, data_args = {"num_layers": 1}, {}

    step_s, deep, tails = runs.tiny_runs(Tiny, {"num_layers": 4}, None, "32-true", 4, 1, 2, True, "auto", rounds=2)
    # Interleaved: one-layer, deep, deep checkpointed, then the same again; the optimizer timed once (first deep fit).
    assert calls == [(("one", None), False), (("deep", False), True), (("deep", True), False),
                     (("one", None), False), (("deep", False), False), (("deep", True), False)]
    assert step_s == {1: [1.1, 1.2, 4.1, 4.2], 4: [1.3, 4.3]}
    assert deep == {False: {1: [2.1, 2.2, 5.1, 5.2], 4: [2.3, 5.3]}, True: {1: [3.1, 3.2, 6.1, 6.2], 4: [3.3, 6.3]}}
    assert tails["tail_seconds"] == [0.001, 0.004] and tails["deep_optimizer_seconds"] == 0.5
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"in-situ rounds={bad!r}: give a positive integer"):
            runs.tiny_runs(Tiny, {"num_layers": 4}, None, "32-true", 4, 1, 2, True, "auto", rounds=bad)


def test_the_profile_command_refuses_a_bad_in_situ_rounds(capsys) -> None:
    from lightning_3d.planner.profile import profile_main

    with pytest.raises(SystemExit):
        profile_main(["--config", "gpt_tiny", "--device", "cpu", "--in-situ-rounds", "0"])
    assert "--in-situ-rounds=0: give a positive integer" in capsys.readouterr().err
