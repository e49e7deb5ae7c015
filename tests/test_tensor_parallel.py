"""Tensor parallelism on local tensors: the f/g operators and the layers against their definition, and the GPT and T5
stages against torch's DTensor plan (world 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_scenario
from tests.tolerance import gpt_tolerance


def test_operators_and_layers_match_their_definition(tmp_path: Path) -> None:
    report = run_scenario(2, "tensor_parallel", ["--world", "2"], tmp_path / "report.json", timeout=600)
    for rank, result in enumerate(report["ranks"]):
        assert all(result["mappings"].values()), (rank, result["mappings"])
        for sp, layers in result["layers"].items():
            where = (rank, f"sequence_parallel={sp}")
            for key in ("qkv_out", "qkv_input_grad", "qkv_weight_grads"):
                assert layers[key] <= layers["tolerance"], (where, key, layers)
            for key in ("mlp_out", "mlp_input_grad", "mlp_param_grads"):
                assert layers[key] <= layers["mlp_tolerance"], (where, key, layers)
            for key in ("qkv_grads_are_shard0_dtensors", "norm_grad_placement", "weights_placements"):
                assert layers[key], (where, key)
        gpt = result["gpt"]
        for sp in (False, True):
            assert gpt[f"sp{sp}_loss"] <= gpt["tolerance"] and gpt[f"sp{sp}_grads"] <= gpt["tolerance"], (rank, gpt)
            assert gpt[f"sp{sp}_selected"], (rank, gpt)
        assert "'fast'" in gpt["bad_value_error"] and "L3D_TP_IMPLEMENTATION" in gpt["bad_value_error"], gpt
        assert all(result["autocast_and_optimizer"].values()), (rank, result["autocast_and_optimizer"])
        compiled = result["compiled"]
        for sp in (False, True):
            assert compiled[f"sp{sp}_loss"] <= compiled["tolerance"], (rank, sp, compiled)
            # Under torch 2.11 the in-place sequence all-gather / reduce-scatter of a compiled backward lost its
            # result (zero gradients for sp=True, scaled error 1.0): hence the functional collectives in graphs.
            assert compiled[f"sp{sp}_grads"] <= compiled["tolerance"], (rank, sp, compiled)
            # One graph for both blocks, unbroken (a graph break per parameter lookup would split it).
            assert compiled[f"sp{sp}_graphs"] == 1 and compiled[f"sp{sp}_graph_breaks"] == 0, (rank, sp, compiled)
            # Compiled blocks hand their gradients over through the local leaves as eager ones do: 2 micro-batches
            # times the leaves the stage reads (a DTensor input to the graph would bypass them, fewer hand-overs).
            assert compiled[f"sp{sp}_handed_compiled"] == compiled[f"sp{sp}_handed_eager"] > 0, (rank, sp, compiled)
            # The graph reads the staged local leaves and no DTensor parameter (the row bias's None test read one).
            assert compiled[f"sp{sp}_dtensor_graph_inputs"] == 0, (rank, sp, compiled)
            # Nor guards on one (the row bias's `self.bias is None` made its DTensor guarded on every call).
            assert compiled[f"sp{sp}_guard_lines"] > 0 and compiled[f"sp{sp}_parameter_guards"] == [], compiled
            assert compiled[f"sp{sp}_staged_are_leaves"] and compiled[f"sp{sp}_staged_are_graph_inputs"], compiled
        _check_t5(rank, result["t5"], result["t5_compiled"])
        _check_overlap(rank, result["overlap"])


def _check_overlap(rank: int, overlap: dict) -> None:
    """tests/scenarios/tensor_parallel.py check_overlap: column_parallel_linear against the synchronous path."""
    from tests.scenarios.tensor_parallel import B, H, S

    for sp, regather in ((False, False), (True, False), (True, True)):
        for autocast in (False, True):
            for layer in ("fc", "qkv"):
                key = f"sp{sp}{'_regather' if regather else ''}_autocast{autocast}_{layer}"
                # The same operations in another order: outputs and every gradient equal to the bit.
                assert overlap[f"{key}_equal"], (rank, key, overlap)
                # dgrad GEMM, collective launched, wgrad GEMM and bias sum while it runs, then its wait (with
                # regather the input's all-gather in flight during the dgrad GEMM); the synchronous path after both.
                assert overlap[f"{key}_overlap_order"], (rank, key, overlap[f"{key}_events"])
                assert overlap[f"{key}_sync_order"], (rank, key, overlap)
                assert overlap[f"{key}_saved_bytes"] and overlap[f"{key}_saved_bytes_sync"], (rank, key, overlap)
                # With regather the saved input is this rank's chunk, not the gathered sequence: (tp - 1) / tp of
                # B x S x H elements fewer (world 2), in the GEMM's dtype (bf16 under autocast); by default the
                # gathered input, the synchronous path's bytes.
                elem = 2 if autocast else 4
                assert overlap[f"{key}_saved_bytes_saving"] == (B * S * H * elem // 2 if regather else 0), (rank, key)
    for key in ("compiled_spFalse", "compiled_spTrue", "compiled_spTrue_regather"):
        # Compiled: the same order in the backward graph, the waits graph ops of their own after the work they
        # overlap; aot_eager runs the same kernels and collectives, so equal to the bit.
        assert overlap[f"{key}_order"], (rank, key, overlap[f"{key}_events"])
        assert overlap[f"{key}_equal"], (rank, key, overlap)
    assert overlap["default_on"] and overlap["zero_off"], (rank, overlap)
    assert "L3D_TP_OVERLAP='yes'" in overlap["bad_value_error"] and "or 0" in overlap["bad_value_error"], overlap
    assert overlap["regather_default_off"] and overlap["regather_one_on"], (rank, overlap)
    error = overlap["regather_bad_value_error"]
    assert "L3D_TP_SP_REGATHER='chunk'" in error and "or 1" in error, overlap


def _check_t5(rank: int, t5: dict, compiled: dict) -> None:
    """tests/scenarios/t5_tensor_parallel.py: the T5 stage on local tensors against torch's DTensor plan and a single
    process, and its compiled blocks against eager ones."""
    runs = [f"v11{v11}_sp{sp}_split{split}" for v11 in (False, True) for sp in (False, True)
            for split in ((False, True) if v11 else (False,))]
    for run in runs:
        assert t5[f"{run}_loss"] <= t5["tolerance"] and t5[f"{run}_grads"] <= t5["tolerance"], (rank, run, t5)
        assert t5[f"{run}_reference_loss"] <= t5["tolerance"], (rank, run, t5)
        assert t5[f"{run}_reference_grads"] <= t5["tolerance"], (rank, run, t5)
        for key in ("selected", "same_placements", "same_state_dict_keys"):
            assert t5[f"{run}_{key}"], (rank, run, key, t5)
        # The pipeline boundary carries this rank's sequence chunk under SP, and this rank's heads of the bias table.
        if run.endswith("splitTrue"):
            assert t5[f"{run}_boundary_ok"], (rank, run, t5)
    assert all(t5[f"v11{v11}_sp{sp}_dtensor_selected"] for v11 in (False, True) for sp in (False, True)), t5
    assert "'fast'" in t5["bad_value_error"] and "L3D_TP_IMPLEMENTATION" in t5["bad_value_error"], t5
    assert "num_heads=3" in t5["bad_heads_error"] and "tensor_parallel_size=2" in t5["bad_heads_error"], t5
    for sp in (False, True):
        assert compiled[f"sp{sp}_loss"] <= compiled["tolerance"], (rank, sp, compiled)
        assert compiled[f"sp{sp}_grads"] <= compiled["tolerance"], (rank, sp, compiled)
        # One graph per block kind (encoder, decoder), unbroken.
        assert compiled[f"sp{sp}_graphs"] == 2 and compiled[f"sp{sp}_graph_breaks"] == 0, (rank, sp, compiled)
        # Compiled blocks hand their gradients over through the local leaves, as eager ones: 2 micro-batches times
        # the 52 leaves of the tiny v1.1 stage (46 in its blocks; embedding, 2 bias tables, 2 final norms, head).
        assert compiled[f"sp{sp}_handed_compiled"] == compiled[f"sp{sp}_handed_eager"] == 104, (rank, sp, compiled)
        assert compiled[f"sp{sp}_dtensor_grads"], (rank, sp, compiled)


def test_host_time_benchmark_times_both_plans_and_compiles_blocks_both_ways(tmp_path: Path) -> None:
    """benchmarks/parallel/tp_host_time.py, one run (one process group) for both of its modes: both plans train the same model
    to the same loss, each timed step recorded; --compile: eager, compiled on the local leaves and compiled on the
    DTensor parameters train the same model to the same loss (the compiled variants are the local layers')."""
    import json
    import subprocess
    import sys

    from tests.conftest import clean_env
    from tests.launch import ROOT

    out = tmp_path / "tp.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/parallel/tp_host_time.py"), "--presets", "tiny", "--sequence-parallel", "on",
           "--implementations", "dtensor", "local", "--compile", "off", "leaves", "module", "--seq-length", "16",
           "--steps", "2", "--warmup", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, env=clean_env(OMP_NUM_THREADS="1"), cwd=ROOT, timeout=300, capture_output=True)
    results = json.loads(out.read_text())["results"]
    assert [(r["implementation"], r["sequence_parallel"], r["compile"]) for r in results] == [
        ("dtensor", True, "off"), ("local", True, "off"), ("local", True, "leaves"), ("local", True, "module")]
    # The same weights and tokens through two summation orders: the tiny GPT's chain bound (4 blocks, the widest
    # reduction its 4096-token vocabulary) on the loss, relative.
    assert results[0]["loss_last"] == pytest.approx(results[1]["loss_last"], rel=gpt_tolerance(4, 4096))
    assert all(r[k]["n"] == 2 for r in results for k in ("wall_s", "cpu_s", "forward_backward_cpu_s"))
    # Compiled: the same kernels through aot_eager; the bound is the eager comparison's (two summation orders at most).
    for r in results[2:]:
        assert r["loss_last"] == pytest.approx(results[1]["loss_last"], rel=gpt_tolerance(4, 4096))


def test_overlap_benchmark_compares_both_paths(tmp_path: Path) -> None:
    """benchmarks/parallel/tp_overlap.py on CPU (gloo): every layer shape with SP off and on through both paths, the same output
    and gradients to the bit, and the bytes each forward saves: under SP the overlapped path with regather keeps this
    rank's sequence chunk of the input where the synchronous one and the default keep the gathered input."""
    import json
    import subprocess
    import sys

    from tests.conftest import clean_env
    from tests.launch import ROOT

    out = tmp_path / "overlap.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/parallel/tp_overlap.py"), "--device", "cpu", "--preset", "tiny",
           "--seq-length", "16", "--micro-batch-size", "2", "--iters", "1", "--warmup", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, env=clean_env(OMP_NUM_THREADS="1"), cwd=ROOT, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    results, world = report["results"], report["world"]
    assert [(r["layer"], r["sequence_parallel"], r["overlap"], r["regather"]) for r in results] == [
        (layer, sp, overlap, regather) for layer in ("qkv", "fc") for sp in (False, True)
        for overlap, regather in ((False, False), (True, False)) + (((True, True),) if sp else ())]
    for r in results:
        assert r["equal_to_sync"] and r["max_abs_diff_to_sync"] == 0.0, r
        tokens = r["tokens"] // world if r["regather"] else r["tokens"]
        weight = r["out_features"] // world * r["in_features"]
        assert r["saved_bytes"] == (tokens * r["in_features"] + weight) * 4, r  # fp32 on CPU


def test_async_tp_needs_compiled_blocks(monkeypatch) -> None:
    """``L3D_TP_ASYNC=1`` with ``compile=False`` is refused when the recipe's module is built, naming both fixes; with
    compile it passes this check (its SP, CUDA and NCCL checks are tests/scenarios/async_tp.py's)."""
    from lightning_3d.recipes.training import check_speed_options

    monkeypatch.setenv("L3D_TP_ASYNC", "1")
    with pytest.raises(ValueError, match=r"L3D_TP_ASYNC=1 .* compile=False: set compile=True, or unset L3D_TP_ASYNC"):
        check_speed_options(False, None, None)
    check_speed_options(True, None, None)
    monkeypatch.setenv("L3D_TP_ASYNC", "0")
    check_speed_options(False, None, None)
