"""``planner.add_compiled`` (and ``benchmarks/tools/compiled_grids.py``): compiled grids added to a profile that lacks
them, the eager grids and other sections kept, older compiled grids replaced, another model's profile refused."""

from __future__ import annotations

import copy
import json

import pytest

import lightning_3d.planner.profile as profile_mod
import lightning_3d.recipes  # noqa: F401  (registers the recipes)
from lightning_3d.planner import add_compiled

CFG = {"model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {"preset_name": "tiny", "seq_length": 32}},
       "data": {"init_args": {"seq_length": 32}}, "trainer": {"precision": "32-true"}}


def _entry(value: float, compiled: bool) -> dict:
    grid = [[value]]
    return {"tp": 1, "recompute": False, "microbatch_size": [1], "seq_len": [32], "target_len": None,
            **{q: grid for q in ("forward", "backward", "host_forward", "host_backward", "stored", "peak")},
            **({"compiled": True} if compiled else {})}


@pytest.fixture
def eager_doc() -> dict:
    from lightning_3d.planner.layers import grid_lengths

    shape, _, _ = grid_lengths(CFG, [32], None)
    import dataclasses

    return {"model": dataclasses.asdict(shape), "layers": {k: [_entry(1.0, False)] for k in ("embedding", "block", "head")},
            "overheads": {"microbatch_seconds": 0.5}, "sustained": {"kinds": {}}, "gradient_accumulation_fusion": "auto"}


@pytest.fixture
def fake_profile(monkeypatch):
    calls = []

    def fake(cfg, **kw):
        calls.append(kw)
        if calls[0].get("fail_head"):  # the head's compile failed: no compiled head grid, the error recorded
            return {"layers": {"block": [_entry(0.5, True)], "head": []}, "compile_errors": ["head: boom"]}
        return {"layers": {"block": [_entry(0.5, True)], "head": [_entry(0.25, True)]}}

    monkeypatch.setattr(profile_mod, "profile_model", fake)
    return calls


def test_compiled_grids_join_the_eager_ones_and_replace_older_compiled(eager_doc, fake_profile) -> None:
    eager_doc["call_overhead"] = {"forward_seconds": 3e-4, "backward_seconds": 5e-4}
    before = copy.deepcopy(eager_doc)
    eager_doc["layers"]["block"].append(_entry(9.0, True))  # an older compiled grid: replaced
    doc = add_compiled(eager_doc, CFG, microbatch_sizes=[1, 2], seq_lens=[16, 32])
    assert doc is eager_doc
    assert doc["layers"]["block"] == [_entry(1.0, False), _entry(0.5, True)]
    assert doc["layers"]["head"] == [_entry(1.0, False), _entry(0.25, True)]
    assert doc["layers"]["embedding"] == before["layers"]["embedding"]
    assert doc["overheads"] == before["overheads"] and doc["sustained"] == before["sustained"]
    (kw,) = fake_profile
    # Only compiled grids, on the sizes given, with the fusion the profile's eager grids were measured under.
    assert kw["compile"] is True and kw["eager"] is False and kw["compile_microbatch_sizes"] == [1, 2]
    assert kw["seq_lens"] == [16, 32] and kw["fuse_gradients"] == "auto" and kw["overheads"] is False
    # ... and the profile's per-call cost taken off their single timings, the rule of its eager grids.
    assert kw["call_overhead"] == before["call_overhead"] and doc["call_overhead"] == before["call_overhead"]


def _profile_with_call_cost(monkeypatch, **kw) -> dict:
    """The real profiler loop (``profile_layers``) on the tiny GPT with ``time_point`` replaced: blocks chain with a
    per-call cost of (10, 20) us, the embedding and head hold single timings of (1, 2) ms."""
    import torch

    import lightning_3d.planner.layers as layers_mod

    def fake_time_point(module, make_inputs, run, *, chained, **_):
        if chained:
            return {"forward": 1e-4, "backward": 2e-4, "host_forward": 0.0, "host_backward": 0.0, "stored": 1,
                    "peak": 1}, (1e-5, 2e-5)
        return {"forward": 1e-3, "backward": 2e-3, "host_forward": 0.0, "host_backward": 0.0, "stored": 1,
                "peak": 1}, None

    monkeypatch.setattr(layers_mod, "time_point", fake_time_point)
    monkeypatch.setattr(layers_mod, "_time_optimizer", lambda *a, **k: None)
    return layers_mod.profile_layers(CFG, torch.device("cpu"), microbatch_sizes=[1], seq_lens=[32], recompute=(False,),
                                     warmup=0, repeats=1, log=lambda *a: None, **kw)


def test_single_timings_lose_the_given_call_cost_else_the_chains_median(monkeypatch) -> None:
    head = _profile_with_call_cost(monkeypatch)["layers"]["head"][0]
    assert head["forward"] == [[pytest.approx(1e-3 - 1e-5)]] and head["backward"] == [[pytest.approx(2e-3 - 2e-5)]]
    given = {"forward_seconds": 3e-4, "backward_seconds": 5e-4}
    doc = _profile_with_call_cost(monkeypatch, call_overhead=given)
    head = doc["layers"]["head"][0]
    assert head["forward"] == [[pytest.approx(7e-4)]] and head["backward"] == [[pytest.approx(1.5e-3)]]
    assert doc["call_overhead"] == given
    for bad in ({"forward_seconds": 1e-5}, {"forward_seconds": -1e-5, "backward_seconds": 1e-5},
                {"forward_seconds": 1e-5, "backward_seconds": float("nan")}, {"forward_seconds": True, "backward_seconds": 0.0}):
        with pytest.raises(ValueError, match=r"call_overhead=.*: give a profile's call_overhead, non-negative seconds"):
            _profile_with_call_cost(monkeypatch, call_overhead=bad)


def test_profile_model_hands_the_call_cost_to_the_layers_profile(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(profile_mod, "profile_layers", lambda cfg, device, **kw: seen.update(kw) or {"layers": {}})
    given = {"forward_seconds": 3e-4, "backward_seconds": 5e-4}
    profile_mod.profile_model(CFG, device="cpu", microbatch_sizes=[1], seq_lens=[32], collectives=False,
                              overheads=False, call_overhead=given, log=lambda *a: None)
    assert seen["call_overhead"] == given


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size"])
def test_another_models_profile_is_refused_before_any_measurement(eager_doc, fake_profile, field) -> None:
    eager_doc["model"][field] *= 2  # the vocabulary too: the head's grid is timed at the config's
    with pytest.raises(ValueError, match="add compiled grids to a profile of the same model"):
        add_compiled(eager_doc, CFG, microbatch_sizes=[1], seq_lens=[32])
    assert fake_profile == []


def test_a_failed_compile_leaves_no_older_compiled_grid_and_says_so(eager_doc, monkeypatch) -> None:
    eager_doc["layers"]["head"].append(_entry(9.0, True))  # of older code: must not stand in for the failed one
    eager_doc["compile_errors"] = ["block: from an older run"]
    monkeypatch.setattr(profile_mod, "profile_model", lambda cfg, **kw: {
        "layers": {"block": [_entry(0.5, True)], "head": []}, "compile_errors": ["head: boom"]})
    doc = add_compiled(eager_doc, CFG, microbatch_sizes=[1], seq_lens=[32])
    assert doc["layers"]["head"] == [_entry(1.0, False)] and doc["compile_errors"] == ["head: boom"]
    monkeypatch.setattr(profile_mod, "profile_model", lambda cfg, **kw: {
        "layers": {"block": [_entry(0.5, True)], "head": [_entry(0.25, True)]}})
    assert "compile_errors" not in add_compiled(doc, CFG, microbatch_sizes=[1], seq_lens=[32])


def test_the_tool_refuses_bad_grids_and_a_missing_gpu(tmp_path, monkeypatch, capsys) -> None:
    from benchmarks.tools import compiled_grids

    src = tmp_path / "p.json"
    src.write_text(json.dumps({"layers": {}}))
    base = ["--add-to", str(src), "--out", str(tmp_path / "o.json"), "--seq-length", "2048"]
    with pytest.raises(SystemExit, match=r"--sizes '4,2': give increasing positive integers"):
        compiled_grids.main([*base, "--sizes", "4,2"])
    with pytest.raises(SystemExit, match="4096 is longer than --seq-length 2048"):
        compiled_grids.main([*base, "--lens", "1024,4096"])
    with pytest.raises(SystemExit, match="--repeats 0: give a warm-up of 0 or more and at least one repeat"):
        compiled_grids.main([*base, "--repeats", "0"])
    monkeypatch.setattr(compiled_grids.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no GPU is visible"):
        compiled_grids.main(base)


def test_the_tool_writes_the_profile_with_its_compiled_grids(tmp_path, eager_doc, fake_profile) -> None:
    from benchmarks.tools import compiled_grids

    src, out = tmp_path / "p.json", tmp_path / "o.json"
    src.write_text(json.dumps(eager_doc))
    # No --vocab-size: the profile's own (the model check would refuse another).
    compiled_grids.main(["--add-to", str(src), "--out", str(out), "--preset", "tiny", "--seq-length", "32",
                         "--sizes", "1,2", "--lens", "16,32", "--device", "cpu"])
    doc = json.loads(out.read_text())
    assert [e.get("compiled", False) for e in doc["layers"]["block"]] == [False, True]
    assert fake_profile[0]["device"] == "cpu"


def test_the_tool_adds_t5_grids_over_the_decoder_lengths_and_refuses_bad_ones(tmp_path, monkeypatch) -> None:
    import dataclasses

    from benchmarks.tools import compiled_grids
    from lightning_3d.planner.layers import grid_lengths

    t5 = {"model": {"class_path": "lightning_3d.recipes.T5", "init_args": {"preset_name": "tiny"}},
          "data": {"init_args": {"seq_length": 64, "target_length": 32}}, "trainer": {"precision": "32-true"}}
    shape, _, _ = grid_lengths(t5, [64], [32])
    src, out = tmp_path / "p.json", tmp_path / "o.json"
    src.write_text(json.dumps({"model": dataclasses.asdict(shape), "layers": {"decoder_block": [_entry(1.0, False)]},
                               "gradient_accumulation_fusion": "auto"}))
    calls = []
    monkeypatch.setattr(profile_mod, "profile_model", lambda cfg, **kw: calls.append((cfg, kw)) or {
        "layers": {"decoder_block": [_entry(0.5, True)]}})
    base = ["--add-to", str(src), "--out", str(out), "--model", "t5", "--preset", "tiny", "--seq-length", "64",
            "--target-length", "32", "--sizes", "1,2", "--lens", "16,64", "--device", "cpu"]
    # Default decoder lengths: the --lens up to --target-length.
    compiled_grids.main(base)
    (cfg, kw), = calls
    assert cfg["model"]["class_path"] == "lightning_3d.recipes.T5" and cfg["data"]["init_args"]["target_length"] == 32
    assert kw["seq_lens"] == [16, 64] and kw["target_lens"] == [16]
    assert [e.get("compiled", False) for e in json.loads(out.read_text())["layers"]["decoder_block"]] == [False, True]
    compiled_grids.main([*base, "--target-lens", "8,32"])
    assert calls[-1][1]["target_lens"] == [8, 32]
    with pytest.raises(SystemExit, match=r"--target-lens 8,64: give decoder lengths up to --target-length 32"):
        compiled_grids.main([*base, "--target-lens", "8,64"])
    with pytest.raises(SystemExit, match="--lens 64: none is at most --target-length 32; give the decoder's lengths"):
        compiled_grids.main([*base, "--lens", "64"])
    with pytest.raises(SystemExit, match="--target-length/--target-lens are T5's decoder lengths"):
        compiled_grids.main([*base[:4], "--target-length", "32", "--device", "cpu"])
    # A GPT profile is not a T5 one: the model check refuses it before anything is measured.
    gpt_src = tmp_path / "gpt.json"
    gpt_src.write_text(json.dumps({"model": dataclasses.asdict(grid_lengths(CFG, [32], None)[0]), "layers": {}}))
    with pytest.raises(SystemExit, match="add compiled grids to a profile of the same model"):
        compiled_grids.main(["--add-to", str(gpt_src), *base[2:]])
    assert len(calls) == 2
