"""Tensor-parallel layers measured across GPUs (docs/planner.md, "Measured tensor-parallel layers"): grids marked
``"collectives": true`` replace the derivation from tp = 1 and carry their own collectives and host time; the
profiler's multi-process measurement (gloo on the CPU here); the validation script's before/after of one run."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from lightning_3d.costs import ClusterSpec, ModelShape, ProfiledCostModel, device_spec
from lightning_3d.planner.model import Candidate, Workload, predict

PROFILE = Path(__file__).parent / "data" / "profiles" / "gpt_synthetic.json"
SEQ = 1024
LAYERS = 8


def _doc(measured: bool, host: float | None = None) -> dict:
    """The synthetic profile (tp = 1 and tp = 2 grids); with ``measured`` its tp = 2 block grids are marked as measured
    across two GPUs (their spans hold the all-reduces); ``host``: host seconds per pass of those grids."""
    doc = json.loads(PROFILE.read_text())
    doc["version"] = 2
    for e in doc["layers"]["block"]:
        if e["tp"] == 2:
            if measured:
                e["collectives"] = True
            if host is not None:
                e["host_forward"] = [[host] * len(e["seq_len"]) for _ in e["microbatch_size"]]
                e["host_backward"] = [[host] * len(e["seq_len"]) for _ in e["microbatch_size"]]
    return doc


def _model(doc: dict, **kw) -> ProfiledCostModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ProfiledCostModel(doc, derive_tp=True, **kw)


def _workload(cm: ProfiledCostModel) -> Workload:
    return Workload(cm.shape, SEQ, 8, cm, ClusterSpec(1, 4, device_spec("h100"), 300e9, 25e9), memory_reserve=0.0)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_grid_measured_across_gpus_gets_no_modelled_all_reduce(recompute) -> None:
    cm_measured, cm_plain = _model(_doc(True)), _model(_doc(False))
    assert cm_measured.includes_tp_collectives("block", recompute, 2)
    assert not cm_plain.includes_tp_collectives("block", recompute, 2)
    assert not cm_measured.includes_tp_collectives("embedding", False, 2)  # not marked: derived semantics
    assert not cm_measured.includes_tp_collectives("block", recompute, 1)
    f, b = (float(x) for x in cm_measured.layer_time("block", 4, SEQ, recompute=recompute, tp=2))
    w_m, w_p = _workload(cm_measured), _workload(cm_plain)
    comm = w_p.tp_comm("block", 4, 2)
    assert comm > 0
    blocks_m, emb_m, head_m = w_m.layer_costs(4, 2, recompute)
    blocks_p, emb_p, head_p = w_p.layer_costs(4, 2, recompute)
    # The measured span is the block's whole time; a compute-only grid gets two all-reduces per pass (and the
    # recomputed forward's two more in the backward).
    np.testing.assert_allclose(blocks_m[5], f, rtol=1e-12)
    np.testing.assert_allclose(blocks_m[6], b, rtol=1e-12)
    np.testing.assert_allclose(blocks_p[5], f + comm, rtol=1e-12)
    np.testing.assert_allclose(blocks_p[6], b + comm + (comm if recompute else 0.0), rtol=1e-12)
    # The embedding and head grids are not marked: both models add their all-reduce alike.
    assert emb_m[5] == emb_p[5] and head_m[6] == head_p[6]


def test_link_bandwidth_comm_is_not_added_to_a_measured_grid() -> None:
    cm = _model(_doc(True), tp_link_bandwidth=100e9)
    bare = _model(_doc(True))
    assert float(cm.layer_time("block", 2, SEQ, tp=2)[0]) == float(bare.layer_time("block", 2, SEQ, tp=2)[0])
    assert float(cm.layer_time("embedding", 2, SEQ, tp=2)[0]) > float(bare.layer_time("embedding", 2, SEQ, tp=2)[0])


def test_a_measured_tp_grids_host_time_is_its_own_floor() -> None:
    # The shard's host time measured across GPUs (its collectives' launches, the tp layers' Python) above the
    # device's: a one-stage tp = 2 step is the host sum of the blocks plus the embedding and head.
    host = 0.02
    cm = _model(_doc(True, host=host))
    hf, hb = cm.layer_host_time("block", 4, SEQ, tp=2)
    assert float(hf) == float(hb) == host
    w = _workload(cm)
    c = Candidate(1, 1, 2, 4, 2, "1f1b", 1, (LAYERS,), (False,), False)
    p = predict(c, w)
    blocks, emb, head = w.layer_costs(4, 2, False)
    # Per pass, a stage takes max(device sum, host sum) over its layers (stage_costs).
    per_mb = sum(max(float(blocks[d].sum()) + emb[d] + head[d], LAYERS * host + emb[h] + head[h])
                 for d, h in ((5, 7), (6, 8)))
    assert LAYERS * host > float(blocks[5].sum()) + emb[5] + head[5]  # host-bound indeed
    assert p.pipeline_time == pytest.approx(2 * per_mb, rel=1e-12)


def test_tp_degrees_are_the_powers_of_two_that_divide_the_heads() -> None:
    from lightning_3d.planner import tp_degrees

    shape = ModelShape.__new__(ModelShape)
    base = json.loads(PROFILE.read_text())["model"]
    assert tp_degrees(ModelShape(**base), 4) == [2, 4]
    assert tp_degrees(ModelShape(**base), 8) == [2, 4, 8]
    assert tp_degrees(ModelShape(**dict(base, num_heads=6, hidden_size=768)), 8) == [2]
    assert tp_degrees(ModelShape(**base), 1) == []
    del shape


def test_the_profiler_measures_tp_blocks_across_processes_on_cpu() -> None:
    import lightning_3d.recipes  # noqa: F401
    from lightning_3d.planner import measure_tp_layers

    cfg = {"trainer": {"precision": "32-true"},
           "model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {"preset_name": "tiny", "vocab_size": 512}},
           "data": {"init_args": {"seq_length": 32}}}
    out = measure_tp_layers(cfg, 2, device="cpu", microbatch_sizes=[1, 2], warmup=1, repeats=1)
    assert set(out) == {"tp_layers"} and set(out["tp_layers"]) == {"block"}  # embedding and head stay derived
    (entry,) = out["tp_layers"]["block"]
    assert (entry["tp"], entry["recompute"], entry["collectives"]) == (2, False, True)
    assert entry["microbatch_size"] == [1, 2] and entry["seq_len"] == [32]
    for q in ("forward", "backward", "host_forward", "host_backward"):
        assert all(row[0] > 0 for row in entry[q]), q
    assert all(row[0] == 0.0 for row in entry["stored"])  # the CPU measures no memory
    doc = json.loads(PROFILE.read_text())
    doc["model"] = dict(doc["model"], hidden_size=128, num_heads=4, ffn_hidden_size=512)
    doc["layers"]["block"].append(copy.deepcopy(entry))
    cm = _model(doc)
    assert cm.includes_tp_collectives("block", False, 2)
    # Read as every grid is: non-decreasing in micro-batch size (a CPU's noisy timings may fall).
    from lightning_3d.costs.profiled import monotone_in_microbatch

    expected = monotone_in_microbatch(np.array(entry["forward"], dtype=float))[1][0]
    assert float(cm.layer_time("block", 2, 32, tp=2)[0]) == pytest.approx(expected, rel=1e-9)


def _validate_module():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "planner" / "planner_validate.py"
    spec = importlib.util.spec_from_file_location("planner_validate_tp", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_validation_reports_the_derived_prediction_beside_the_measured_one() -> None:
    v = _validate_module()
    doc = _doc(True)
    assert v.has_tp_grids(doc) and not v.has_tp_grids(v.without_tp_grids(doc))
    assert len(v.without_tp_grids(doc)["layers"]["block"]) == 2  # the tp = 1 grids stay
    m = v.Model("gpt", "synthetic", 32768, SEQ, None, 8, [])
    cluster = ClusterSpec(1, 4, device_spec("h100"), 300e9, 300e9)
    tp2 = v.Config(4, 2, layout=(1, 1, 2))
    p, derived = v.predict_both(m, tp2, doc, cluster, _model(doc))
    ref = predict(v.candidate(m, tp2, _model(_doc(False))), Workload(
        _model(_doc(False)).shape, SEQ, 8, _model(_doc(False)), cluster))
    assert derived.step_time == pytest.approx(ref.step_time, rel=1e-12)
    assert p.step_time < derived.step_time  # the same grid without the modelled all-reduces
    assert v.predict_both(m, v.Config(4, 2), doc, cluster, _model(doc))[1] is None  # tp = 1: nothing derived
    rows = [{"config": "a", "predicted_step_s": 1.0, "step_s": 1.0, "time_error": 0.0, "derived_step_s": 0.5,
             "derived_time_error": -0.5},
            {"config": "b", "predicted_step_s": 2.0, "step_s": 2.5, "time_error": -0.2}]
    s = v.summarize(rows)
    assert s["time_mape"] == pytest.approx(0.1)
    assert s["derived_time_mape"] == pytest.approx((0.5 + 0.2) / 2)


def test_a_configuration_starts_only_with_its_launch_and_steps_left(monkeypatch) -> None:
    import argparse

    v = _validate_module()
    assert v.seconds_needed([], 40.0, 11, 0.5) == pytest.approx(40.0 + 3 * 11 * 0.5)
    assert v.seconds_needed([30.0, 50.0, 34.0], 40.0, 11, 0.2) == pytest.approx(34.0 + 3 * 11 * 0.2)
    seen = []  # the script's parser is built inside main: its actions, caught at parse time

    def capture(self, args=None, namespace=None):
        seen.extend(self._actions)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        v.main([])
    defaults = {a.dest: a.default for a in seen}
    assert (defaults["steps"], defaults["warmup"], defaults["launch_s"]) == (8, 3, 40.0)


def test_measuring_processes_past_their_deadline_are_stopped() -> None:
    import time

    from lightning_3d.planner.multi_gpu import _spawn

    t0 = time.monotonic()
    # time.sleep(rank): the last of three ranks sleeps 2 s, past a 0.3 s deadline (its start alone takes longer).
    with pytest.raises(TimeoutError, match="3 measuring processes did not finish within 0 s"):
        _spawn(time.sleep, (), 3, 0.3)
    assert time.monotonic() - t0 < 30


def test_a_noisy_chains_single_timing_loses_the_median_fixed_cost() -> None:
    from lightning_3d.planner.timing import subtract_fixed as _subtract_fixed

    grid = {"forward": [[1.0e-3], [0.2e-3], [5.0e-3]], "backward": [[2.0e-3], [0.1e-3], [6.0e-3]]}
    fixed = {"forward": [0.3e-3, 0.5e-3, 0.4e-3], "backward": [0.2e-3]}
    _subtract_fixed(grid, [(0, 0), (1, 0)], fixed)  # the third point's chain was consistent: left alone
    assert grid["forward"] == [[pytest.approx(0.6e-3)], [0.2e-3], [5.0e-3]]  # 0.2 ms is not above 0.4 ms: stands
    assert grid["backward"] == [[pytest.approx(1.8e-3)], [0.1e-3], [6.0e-3]]
    untouched = {"forward": [[1.0e-3]], "backward": [[2.0e-3]]}
    _subtract_fixed(untouched, [(0, 0)], {"forward": [], "backward": []})  # no consistent chain: nothing known
    assert untouched == {"forward": [[1.0e-3]], "backward": [[2.0e-3]]}


def test_validation_reports_the_host_runahead_prediction_of_pipelines() -> None:
    from lightning_3d.planner.model import simulate_candidate

    v = _validate_module()
    doc = _doc(False)
    cm = _model(doc)
    m = v.Model("gpt", "synthetic", 32768, SEQ, None, 8, [])
    cluster = ClusterSpec(1, 4, device_spec("h100"), 300e9, 300e9)
    piped = v.Config(2, 4, layout=(1, 2, 1))
    ref = simulate_candidate(v.candidate(m, piped, cm), Workload(cm.shape, SEQ, 8, cm, cluster, host_runahead=True))
    assert v.runahead_prediction(m, piped, cm, cluster).step_time == ref.step_time
    rows = [{"config": "a", "predicted_step_s": 1.0, "step_s": 1.0, "time_error": 0.0, "runahead_step_s": 0.8},
            {"config": "b", "predicted_step_s": 2.0, "step_s": 2.5, "time_error": -0.2}]
    s = v.summarize(rows)
    assert s["runahead_time_mape"] == pytest.approx((0.2 + 0.2) / 2)
    assert s["runahead_spearman"] is None  # fewer than three rows
