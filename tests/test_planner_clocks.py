"""The sustained-clock term: the profile's ``sustained`` section (``planner.clocks``) and how ``ProfiledCostModel``
applies it to the grids' device seconds (docs/planner.md, "The sustained clock")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_3d.costs import DeviceSpec, ModelShape, ProfiledCostModel, new_profile
from lightning_3d.costs.profiled import check_profile
from lightning_3d.planner.clocks import MAX_TOKENS, pick_points

SHAPE = ModelShape("gpt", num_layers=4, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=512)
T5 = ModelShape("t5", num_layers=4, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=512)
SIZES, LENGTHS = [1, 2, 4, 8], [256, 1024]


def _grid(b, s, scale):
    return (scale * 1e-6 * np.asarray(b, float)[:, None] * np.asarray(s, float)[None, :]).tolist()


def _doc(sustained: dict | None) -> dict:
    doc = new_profile(SHAPE, DeviceSpec("synthetic", 1e15, 1e12, 80 * 2**30))
    for kind, scale in (("embedding", 0.1), ("block", 1.0), ("head", 2.0)):
        fwd = _grid(SIZES, LENGTHS, scale)
        doc["layers"][kind] = [{"tp": 1, "recompute": False, "microbatch_size": SIZES, "seq_len": LENGTHS,
                                "forward": fwd, "backward": (2 * np.asarray(fwd)).tolist(), "stored": fwd, "peak": fwd}]
    if sustained is not None:
        doc["sustained"] = {"seconds": 1.0, "kinds": sustained}
    return doc


CURVE = {"block": {"tokens": [1024, 4096, 8192], "ratio": [1.02, 1.10, 1.20]},
         "head": {"tokens": [2048], "ratio": [1.3]}}


def test_the_grids_device_seconds_scale_by_the_ratio_interpolated_in_log_tokens() -> None:
    plain, held = ProfiledCostModel(_doc(None)), ProfiledCostModel(_doc(CURVE))
    b, s = np.array([1, 4, 8, 2, 1, 8]), np.array([1024, 1024, 1024, 1024, 256, 1024])
    f0, b0 = plain.layer_time("block", b, s)
    f1, b1 = held.layer_time("block", b, s)
    # at the measured tokens the ratio itself; 2048 tokens half-way in log between 1024 and 4096; 256 tokens below
    # the smallest measurement: its ratio; 8192: the last
    expected = np.array([1.02, 1.10, 1.20, (1.02 + 1.10) / 2, 1.02, 1.20])
    np.testing.assert_allclose(f1 / f0, expected, rtol=1e-12)
    np.testing.assert_allclose(b1 / b0, expected, rtol=1e-12)
    np.testing.assert_allclose(held.clock_ratio("block", 2, 1024), (1.02 + 1.10) / 2, rtol=1e-12)
    # one point: the same ratio everywhere; a kind without a measurement keeps its grid
    np.testing.assert_allclose(held.layer_time("head", b, s)[0] / plain.layer_time("head", b, s)[0], 1.3, rtol=1e-12)
    np.testing.assert_array_equal(held.layer_time("embedding", b, s)[0], plain.layer_time("embedding", b, s)[0])
    # memory and host times are not the clock's
    np.testing.assert_array_equal(held.layer_memory("block", b, s)[0], plain.layer_memory("block", b, s)[0])
    # the switch: the grids' burst times
    np.testing.assert_array_equal(ProfiledCostModel(_doc(CURVE), sustained_clock=False).layer_time("block", b, s)[0], f0)


def test_a_ratio_below_one_reads_as_one_and_an_unmeasured_kind_keeps_its_grid() -> None:
    doc = _doc({"block": {"tokens": [1024, 8192], "ratio": [0.97, 1.1]}, "head": {"error": "RuntimeError: capture"}})
    m, plain = ProfiledCostModel(doc), ProfiledCostModel(_doc(None))
    np.testing.assert_allclose(m.clock_ratio("block", 1, 1024), 1.0)
    np.testing.assert_allclose(m.clock_ratio("block", 8, 1024), 1.1)
    np.testing.assert_array_equal(m.layer_time("head", 4, 1024)[0], plain.layer_time("head", 4, 1024)[0])


def test_t5_decoder_and_head_ratios_are_read_by_target_tokens() -> None:
    doc = new_profile(T5, DeviceSpec("synthetic", 1e15, 1e12, 80 * 2**30))
    doc["sustained"] = {"seconds": 1.0, "kinds": {"encoder_block": {"tokens": [512, 4096], "ratio": [1.0, 1.2]},
                                                  "decoder_block": {"tokens": [128, 1024], "ratio": [1.0, 1.2]}}}
    doc["layers"]["encoder_block"] = [{"tp": 1, "recompute": False, "microbatch_size": [1, 8], "seq_len": [512],
                                       "forward": [[1.0], [8.0]], "backward": [[2.0], [16.0]], "stored": [[0], [0]],
                                       "peak": [[0], [0]]}]
    m = ProfiledCostModel(doc)
    # the decoder at 8 x 128 target tokens: its last ratio, whatever the (encoder) sequence length
    np.testing.assert_allclose(m.clock_ratio("decoder_block", 8, 512, target_len=128), 1.2)
    np.testing.assert_allclose(m.clock_ratio("encoder_block", 8, 512, target_len=128), 1.2)
    np.testing.assert_allclose(m.clock_ratio("encoder_block", 1, 512, target_len=128), 1.0)


@pytest.mark.parametrize("section, fragment", [
    ({"kinds": []}, "'sustained' must hold 'kinds'"),
    ([1.1], "'sustained' must hold 'kinds'"),
    ({"kinds": {"block": {"tokens": [1024], "ratio": [1.1, 1.2]}}}, "sustained.kinds.block must hold 'tokens'"),
    ({"kinds": {"block": {"tokens": [0], "ratio": [1.1]}}}, "sustained.kinds.block must hold 'tokens'"),
    ({"kinds": {"block": {"tokens": [1024], "ratio": [math.inf]}}}, "positive finite factors"),
    ({"kinds": {"block": {"tokens": [1024], "ratio": ["1.1"]}}}, "positive finite factors"),
    ({"kinds": {"block": "fast"}}, "sustained.kinds.block must be a mapping"),
])
def test_a_malformed_sustained_section_is_refused_by_name(section, fragment) -> None:
    doc = _doc(None)
    doc["sustained"] = section
    with pytest.raises(ValueError, match=fragment):
        check_profile(doc, "p.json")
    with pytest.raises(ValueError, match=fragment):
        ProfiledCostModel(doc)


def test_points_spread_in_log_tokens_prefer_long_sequences_and_stop_at_the_cap() -> None:
    assert pick_points([1, 2, 4, 8], [1024]) == [(1, 1024), (2, 1024), (4, 1024), (8, 1024)]
    many = pick_points([1, 2, 4, 8, 16, 32, 64, 128], [16, 32, 64, 128, 256, 512, 1024, 2048])
    tokens = [b * s for b, s in many]
    assert tokens == sorted(tokens) and tokens[0] == 16 and tokens[-1] == MAX_TOKENS and len(many) == 5
    assert (32, 2048) in many and (64, 1024) not in many  # equal tokens: the longer sequence
    steps = np.diff(np.log(tokens))
    assert steps.max() / steps.min() < 1.5  # evenly spread
    assert pick_points([4], [512], points=3) == [(4, 512)]


def test_the_profile_refuses_bad_sustained_seconds_and_the_cpu_profile_has_no_clock(capsys) -> None:
    import lightning_3d.recipes  # noqa: F401  (registers the recipes' costs)
    from lightning_3d.planner import profile_model
    from lightning_3d.planner.profile import profile_main

    for bad in (-1.0, math.nan, "1"):
        with pytest.raises(ValueError, match=f"sustained_seconds={bad!r}: give the seconds"):
            profile_model("gpt_tiny", device="cpu", sustained_seconds=bad)
    with pytest.raises(SystemExit):
        profile_main(["--config", "gpt_tiny", "--device", "cpu", "--sustained-seconds", "-2"])
    assert "--sustained-seconds=-2.0: give non-negative seconds" in capsys.readouterr().err
    cfg = {"trainer": {"precision": "32-true"},
           "model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {"preset_name": "tiny", "vocab_size": 256,
                                                                              "num_layers": 1}},
           "data": {"init_args": {"seq_length": 16}}}
    doc = profile_model(cfg, device="cpu", microbatch_sizes=[1], seq_lens=[16], warmup=0, repeats=1, recompute=(False,),
                        collectives=False, overheads=False, sustained_seconds=1.0, log=lambda *a: None)
    assert "sustained" not in doc  # a clock under a power limit is a GPU's; the CPU profile leaves it out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs on a GPU")
def test_on_a_gpu_each_kind_gets_a_ratio_per_point_and_the_cost_model_reads_them() -> None:
    import lightning_3d.recipes  # noqa: F401
    from lightning_3d.planner import profile_model

    cfg = {"trainer": {"precision": "bf16-mixed"},
           "model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {"preset_name": "125m", "vocab_size": 4096,
                                                                              "num_layers": 2}},
           "data": {"init_args": {"seq_length": 512}}}
    doc = profile_model(cfg, microbatch_sizes=[1, 4], seq_lens=[256, 512], warmup=1, repeats=2, recompute=(False,),
                        collectives=False, overheads=False, sustained_seconds=0.2, log=lambda *a: None)
    kinds = doc["sustained"]["kinds"]
    assert set(kinds) == {"block", "head"}, kinds
    for entry in kinds.values():
        assert "error" not in entry, entry
        assert entry["tokens"] == [b * s for b, s, _ in entry["shape"]] and entry["tokens"] == sorted(entry["tokens"])
        for iso, held, r in zip(entry["isolated_seconds"], entry["sustained_seconds"], entry["ratio"]):
            assert iso > 0 and held > 0 and r == pytest.approx(held / iso, rel=1e-6)
            # a power limit slows a layer by tens of percent; outside (0.5, 3) the replays did not time the same work
            assert 0.5 < r < 3.0
    m = ProfiledCostModel(doc)
    b, s, _ = kinds["block"]["shape"][-1]
    assert m.clock_ratio("block", b, s) == pytest.approx(max(kinds["block"]["ratio"][-1], 1.0))


def test_adding_the_clock_to_an_older_profile_is_refused_off_a_gpu() -> None:
    from lightning_3d.planner.layers import add_sustained

    with pytest.raises(ValueError, match=r"the sustained clock is a GPU's \(device cpu\); the CPU profile has none"):
        add_sustained(_doc(None), {"model": {"class_path": "lightning_3d.recipes.GPT"}}, device="cpu")


def test_a_point_out_of_memory_is_left_out_and_a_failed_capture_names_its_error(monkeypatch) -> None:
    """``measure_sustained``'s bookkeeping, with the GPU's measurement replaced: the points and tokens it records, a
    point that runs out of memory left out, a kind whose capture fails recorded with its error, and the section read
    back by the cost model (the failed kind at its grid's times)."""
    from lightning_3d.planner import clocks

    def fake(module, inputs, run, *, device, dtype, seconds):
        tokens = inputs[0].shape[0] * inputs[0].shape[1]
        if module.name == "head":
            raise RuntimeError("operation not permitted when stream is capturing")
        if tokens > 4096:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"ratio": 1.0 + tokens / 1e5, "isolated_seconds": 1e-3, "sustained_seconds": 1e-3 * (1 + tokens / 1e5)}

    monkeypatch.setattr(clocks, "sustained_ratio", fake)

    def layer(name):
        module = torch.nn.Linear(2, 2)
        module.name = name
        return module, lambda b, s, t, dtype: (torch.zeros(b, s),), None

    logs: list[str] = []
    section = clocks.measure_sustained({"block": layer("block"), "head": layer("head")}, ["block", "head"], SIZES,
                                       LENGTHS, None, device=torch.device("cpu"), dtype=None, seconds=0.1,
                                       log=logs.append)
    block = section["kinds"]["block"]
    chosen = [(b, s) for b, s in pick_points(SIZES, LENGTHS) if b * s <= 4096]
    assert block["shape"] == [[b, s, s] for b, s in chosen] and block["tokens"] == [b * s for b, s in chosen]
    assert block["ratio"] == [pytest.approx(1 + t / 1e5) for t in block["tokens"]]
    assert section["kinds"]["head"] == {"error": "RuntimeError: operation not permitted when stream is capturing"}
    assert any("out of memory, left out" in m for m in logs) and any("head not measured" in m for m in logs)
    doc = _doc(None)
    doc["sustained"] = section
    m = ProfiledCostModel(doc)
    assert set(m.sustained) == {"block"}
    np.testing.assert_allclose(m.clock_ratio("block", 8, 1024), 1 + block["tokens"][-1] / 1e5)  # beyond: the last
