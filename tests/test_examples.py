"""The examples in examples/ run and do what they claim (a user's own model through the protocol)."""

from __future__ import annotations

from tests.launch import run_scenario

# As tests/test_distributed.py: fp32 layouts that differ only in summation order, after a few AdamW steps with
# eps=1e-6 (tests/scenarios/common.py explains why that eps keeps rounding differences from being amplified).
TOLERANCE = 1e-5


def test_own_model_matches_one_process_in_3d_layouts(tmp_path):
    report = run_scenario(4, "own_model", ["--world", "4"], tmp_path / "report.json", timeout=900)
    assert [r["layout"] for r in report["results"]] == [[1, 2, 2], [2, 2, 1]]
    for r in report["results"]:
        assert r["loss_err"] <= TOLERANCE and r["param_err"] <= TOLERANCE, r
        # Logged communication is the job's (summed over ranks, the same on every rank), not rank 0's share.
        assert r["bytes_logged"] == r["bytes_job"] == r["bytes_logged_max"] > r["bytes_mine"], r
        # The model summary counts every stage and shard once (the tied head once).
        assert r["counted"] == r["parameters"], r


def test_pipeline_loss_must_be_one_number():
    import pytest
    import torch

    from lightning_3d.pipeline.runtime import scalar_loss

    assert scalar_loss(torch.tensor([2.5])).shape == ()
    with pytest.raises(TypeError, match=r"pipeline_loss returned a tensor of shape \(4, 3\).*return the SUM"):
        scalar_loss(torch.ones(4, 3))
    with pytest.raises(TypeError, match="pipeline_loss returned float"):
        scalar_loss(1.0)
