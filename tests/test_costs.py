"""Cost models: the analytic model's FLOP and byte terms, recompute and tensor parallelism; the profiled model's
file format (safe, versioned), interpolation (exact at grid points, linear between, inf outside and where the
profiler ran out of memory), derived tp; known devices, cluster files and model_shape."""

from __future__ import annotations

import json
import math
import pickle
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import lightning_3d.costs.analytic as analytic
from lightning_3d.costs import (
    AnalyticCostModel,
    ClusterSpec,
    CostModel,
    DeviceSpec,
    ModelShape,
    ProfiledCostModel,
    device_spec,
    model_shape,
)

PROFILE = Path(__file__).parent / "data" / "profiles" / "gpt_synthetic.json"
GPT = ModelShape("gpt", num_layers=4, hidden_size=256, num_heads=4, ffn_hidden_size=1024, vocab_size=1024)
# Infinite bandwidth: only FLOP terms remain (slow enough to stay above the launch floor), so they isolate the FLOPs.
FLOPS_ONLY = DeviceSpec("flops-only", peak_flops=1e10, memory_bandwidth=math.inf, memory_bytes=1e10, gemm_efficiency=0.5)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_analytic_block_time_is_its_flops_at_the_gemm_rate() -> None:
    m = AnalyticCostModel(GPT, FLOPS_ONLY)
    s, h, f = 128, 256, 1024
    f1, b1 = m.layer_time("block", 1, s)
    f2, b2 = m.layer_time("block", 2, s)
    rate = 1e10 * 0.5
    gemm = 2 * s * h * 4 * h + 2 * s * h * f * 2  # q, k, v, out; two FFN matrices (per sequence)
    attn = 4 * s * s * h * 0.5  # causal
    assert f2 - f1 == pytest.approx(gemm / rate + attn / (rate * analytic.ATTENTION_EFFICIENCY), rel=1e-12)
    assert b2 - b1 == pytest.approx(2 * gemm / rate \
        + analytic.BACKWARD_ATTENTION * attn / (rate * analytic.ATTENTION_EFFICIENCY), rel=1e-12)


def test_analytic_recompute_adds_a_forward_and_keeps_only_the_input() -> None:
    m = AnalyticCostModel(GPT)
    b, s = np.array([1, 2, 4]), np.array([[64], [128]])  # broadcast to (2, 3)
    f, bwd = m.layer_time("block", b, s)
    fr, bwdr = m.layer_time("block", b, s, recompute=True)
    assert f.shape == (2, 3)
    np.testing.assert_allclose(fr, f)
    np.testing.assert_allclose(bwdr, bwd + f)
    stored, _ = m.layer_memory("block", b, s, recompute=True)
    np.testing.assert_array_equal(stored, b * s * GPT.hidden_size * GPT.bytes_per_element)
    full, _ = m.layer_memory("block", b, s)
    assert np.all(full > 10 * stored)  # everything else is recomputed


def test_analytic_tensor_parallel_halves_gemms_and_adds_two_allreduces_per_pass() -> None:
    plain = AnalyticCostModel(GPT, FLOPS_ONLY)
    linked = AnalyticCostModel(GPT, FLOPS_ONLY, tp_link_bandwidth=1e9, tp_latency=0.0)
    assert plain.layer_time("block", 1, 256, tp=2)[0] > analytic.KERNELS["block"][0] * analytic.LAUNCH_S  # above the floor
    s = 256
    (f1a, _), (f1b, _) = plain.layer_time("block", 1, s, tp=1), plain.layer_time("block", 2, s, tp=1)
    (f2a, _), (f2b, _) = plain.layer_time("block", 1, s, tp=2), plain.layer_time("block", 2, s, tp=2)
    assert f2b - f2a == pytest.approx((f1b - f1a) / 2, rel=1e-12)
    fl, bl = linked.layer_time("block", 1, s, tp=2)
    fp, bp = plain.layer_time("block", 1, s, tp=2)
    ring = 2 * (2 - 1) / 2 * s * GPT.hidden_size * 2 / 1e9
    assert fl - fp == pytest.approx(2 * ring) and bl - bp == pytest.approx(2 * ring)


def test_analytic_says_so_once(monkeypatch) -> None:
    monkeypatch.setattr(analytic, "_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = AnalyticCostModel(GPT)
        AnalyticCostModel(GPT)
    assert first.source == "analytic" and isinstance(first, CostModel)
    assert [str(w.message) for w in caught if "AnalyticCostModel" in str(w.message)].__len__() == 1


def test_analytic_says_so_on_one_channel_and_rank_zero_only(monkeypatch, caplog) -> None:
    """A warning, not also a log line (the CLI printed both); ranks other than 0 stay silent (dynamic micro-batching
    at pp = 2 printed it once per rank and channel)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    for rank, expected in ((1, 0), (0, 1)):
        monkeypatch.setattr(analytic, "_WARNED", False)
        monkeypatch.setattr(rank_zero_only, "rank", rank, raising=False)
        with warnings.catch_warnings(record=True) as caught, caplog.at_level("DEBUG"):
            warnings.simplefilter("always")
            AnalyticCostModel(GPT)
        assert len([w for w in caught if "AnalyticCostModel" in str(w.message)]) == expected, rank
        assert "AnalyticCostModel" not in caplog.text


def test_analytic_t5_decoder_depends_on_both_lengths() -> None:
    t5 = ModelShape("t5", 2, 256, 4, 1024, 1024, num_decoder_layers=2, head_dim=64)
    m = AnalyticCostModel(t5, FLOPS_ONLY)
    f_short, _ = m.layer_time("decoder_block", 2, 128, target_len=32)
    f_long_input, _ = m.layer_time("decoder_block", 2, 512, target_len=32)
    f_long_target, _ = m.layer_time("decoder_block", 2, 128, target_len=128)
    assert f_long_input > f_short and f_long_target > f_short
    with pytest.raises(ValueError, match="Unknown layer kind 'blok'"):
        m.layer_time("blok", 1, 8)


def test_profile_interpolation_exact_on_grid_linear_between_inf_outside_and_oom() -> None:
    m = ProfiledCostModel(PROFILE)
    data = json.loads(PROFILE.read_text())
    block = next(e for e in data["layers"]["block"] if e["tp"] == 1 and not e["recompute"])
    f, b = m.layer_time("block", np.array([1, 2]), np.array([256, 512]))
    np.testing.assert_array_equal(f, [block["forward"][0][0], block["forward"][1][1]])
    mid, _ = m.layer_time("block", 1.5, 256)
    assert mid == pytest.approx((block["forward"][0][0] + block["forward"][1][0]) / 2, rel=1e-12)
    outside = m.layer_time("block", np.array([1, 1]), np.array([4096, 128]))[0]
    assert np.all(np.isinf(outside))  # lengths outside the grid have no price
    # Past the largest profiled micro-batch (8): per sample from there, time and memory; the host time stays.
    top = max(block["microbatch_size"])
    i, j = block["microbatch_size"].index(top), block["seq_len"].index(256)
    f16, b16 = m.layer_time("block", 2 * top, 256)
    assert f16 == pytest.approx(2 * block["forward"][i][j], rel=1e-12)
    assert b16 == pytest.approx(2 * block["backward"][i][j], rel=1e-12)
    assert m.layer_memory("block", 3 * top, 256)[0] == pytest.approx(3 * block["stored"][i][j], rel=1e-12)
    if block.get("host_forward") is not None:
        host = m.layer_host_time("block", 2 * top, 256)[0]
        assert host == pytest.approx(block["host_forward"][i][j], rel=1e-12)
    assert np.isinf(m.layer_time("block", 2 * top, 2048)[0])  # out of memory at the top: larger stays out
    assert np.isinf(m.layer_time("block", 8, 2048)[0]) and np.isinf(m.layer_memory("block", 8, 2048)[0])
    assert np.isfinite(m.layer_time("block", 8, 2048, recompute=True)[0])  # checkpointing fits there
    assert np.isinf(m.layer_time("block", 1, 256, tp=4)[0])  # unprofiled tp
    assert m.source.startswith(f"profile:{PROFILE}#")


def test_profile_derives_missing_tp_from_the_tp1_grid() -> None:
    m = ProfiledCostModel(PROFILE, derive_tp=True)
    ref = AnalyticCostModel(m.shape, m.device)
    f1, _ = m.layer_time("block", 2, 512)
    f4, _ = m.layer_time("block", 2, 512, tp=4)
    a1, _ = ref.layer_time("block", 2, 512)
    a4, _ = ref.layer_time("block", 2, 512, tp=4)
    assert f4 == pytest.approx(f1 * a4 / a1, rel=1e-12)
    # Embedding and head are never recomputed: their recompute=True cost is the profiled one.
    assert m.layer_time("head", 2, 512, recompute=True)[0] == m.layer_time("head", 2, 512)[0]


def test_profile_files_are_checked_and_never_unpickled(tmp_path) -> None:
    bad = tmp_path / "evil.json"
    bad.write_bytes(pickle.dumps({"format": "lightning_3d.profile"}))
    with pytest.raises(ValueError, match="not a profile"):
        ProfiledCostModel(bad)
    data = json.loads(PROFILE.read_text())
    for change, message in ((dict(format="x"), "not a lightning_3d profile"), (dict(version=99), "profile version 99"),
                            (dict(layers={"blok": []}), "unknown layer kind 'blok'")):
        with pytest.raises(ValueError, match=message):
            ProfiledCostModel({**data, **change})
    broken = json.loads(PROFILE.read_text())
    broken["layers"]["block"][0]["forward"] = [[1.0]]
    with pytest.raises(ValueError, match="forward has shape"):
        ProfiledCostModel(broken)


def test_known_devices_and_cluster_files(tmp_path) -> None:
    assert device_spec("NVIDIA H100 80GB HBM3").peak_flops == 989.4e12  # dense bf16 (lightning_3d/utils/peak_flops.py)
    assert device_spec("a100").memory_bandwidth == 2.039e12
    with pytest.raises(ValueError, match="Unknown device 'tpu'"):
        device_spec("tpu")
    f = tmp_path / "cluster.yaml"
    f.write_text("nodes: 2\ngpus_per_node: 8\ndevice: h200\nintra_node_gbps: 400\ninter_node_gbps: 25\n")
    c = ClusterSpec.load(f)
    assert (c.num_gpus, c.intra_node_bandwidth, c.inter_node_bandwidth) == (16, 400e9, 25e9)
    assert c.memory_per_gpu == device_spec("h200").memory_bytes
    assert c.bandwidth(8) == 400e9 and c.bandwidth(2, stride=8) == 25e9
    f.write_text("nodes: 2\ngpus_per_node: 8\nbandwith: 3\n")
    with pytest.raises(ValueError, match=r"unknown keys \['bandwith'\]"):
        ClusterSpec.load(f)
    with pytest.raises(ValueError, match="nodes=0"):
        ClusterSpec.from_dict({"nodes": 0, "gpus_per_node": 8})


def test_model_shape_of_the_recipe_configs() -> None:
    from lightning_3d.recipes.gpt.config import preset as gpt_preset
    from lightning_3d.recipes.t5.config import preset as t5_preset

    g = model_shape(gpt_preset("350m"))
    assert (g.family, g.num_layers, g.hidden_size, g.num_heads, g.ffn_hidden_size, g.vocab_size) == ("gpt", 24, 1024, 16, 4096, 50304)
    t = model_shape(t5_preset("770m"), bytes_per_element=4)
    assert (t.family, t.num_layers, t.num_decoder_layers, t.head_dim, t.gated_ffn, t.bytes_per_element) == ("t5", 24, 24, 64, False, 4)
    assert len(t.layer_kinds()) == 24 + 24 + 2
    with pytest.raises(TypeError, match="has no 'num_layers'"):
        model_shape(replace)


def test_profile_command_writes_a_profile_the_cost_model_reads_and_refuses_without_a_gpu(tmp_path, monkeypatch, capsys) -> None:
    from lightning_3d.cli import main

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["profile", "--config", "t5_tiny", "--out", str(tmp_path / "x.json")])
    assert "measures a GPU and none is visible" in capsys.readouterr().err
    out = tmp_path / "t5.json"
    # --no-overheads: the per-step overheads are most of the command's time (tiny models trained at the config's depth
    # in a fresh interpreter), nothing below reads them, and the command records their failure instead of raising;
    # tests/test_planner_overheads.py measures them.
    main(["profile", "--config", "t5_tiny", "--device", "cpu", "--out", str(out), "--microbatch-sizes", "1,2",
          "--seq-lens", "16", "--target-lens", "8,16", "--warmup", "0", "--repeats", "1", "--no-overheads"])
    m = ProfiledCostModel(out)
    assert m.shape.family == "t5" and m.kinds() == {"embedding", "encoder_block", "decoder_block", "head"}
    f, b = m.layer_time("decoder_block", np.array([1, 2]), 16, target_len=np.array([8, 16]), recompute=True)
    assert np.all(np.isfinite(f)) and np.all(b > 0)
    assert np.isinf(m.layer_time("encoder_block", 1, 32)[0])  # outside the profiled lengths
    assert m.optimizer_seconds_per_parameter > 0


def test_the_planner_reads_only_registered_recipes() -> None:
    from lightning_3d.costs import recipe_costs

    with pytest.raises(ValueError, match="cannot read model.class_path 'my.Model': no recipe registered it"):
        recipe_costs("my.Model")
    import lightning_3d.recipes  # noqa: F401

    shape, seq, target = recipe_costs("lightning_3d.recipes.T5").workload({"preset_name": "770m"}, {"input_length": 512}, 2)
    assert (shape.num_layers, seq, target) == (24, 512, 114)  # span corruption's target length for 512 inputs


def test_analytic_tiny_layers_are_launch_bound() -> None:
    m = AnalyticCostModel(GPT)  # an H100: a 256-wide block of 8 tokens is far below the launch floor
    f, b = m.layer_time("block", np.array([1, 2]), 8)
    np.testing.assert_array_equal(f, analytic.KERNELS["block"][0] * analytic.LAUNCH_S)
    np.testing.assert_array_equal(b, analytic.KERNELS["block"][1] * analytic.LAUNCH_S)


def test_an_unprofiled_neighbour_with_zero_weight_does_not_poison_a_grid_point() -> None:
    m = ProfiledCostModel(PROFILE)  # block, tp 1, no recompute: (8, 2048) is null (out of memory)
    f, _ = m.layer_time("block", np.array([4, 8, 4, 6]), np.array([1024, 1024, 2048, 1536]))
    assert np.all(np.isfinite(f[:3])) and np.isinf(f[3])  # grid points next to it are finite; inside its cell: inf
