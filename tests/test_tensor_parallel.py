"""Tensor parallelism on local tensors: the f/g operators and the layers against their definition, and the GPT stage
against torch's DTensor plan (world 2)."""

from __future__ import annotations

from pathlib import Path

from tests.launch import run_scenario


def test_operators_and_layers_match_their_definition(tmp_path: Path) -> None:
    report = run_scenario(2, "tensor_parallel", ["--world", "2"], tmp_path / "report.json", timeout=300)
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
