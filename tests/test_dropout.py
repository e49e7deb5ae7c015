"""Dropout's random streams under data, pipeline and tensor parallelism (scenario tests/scenarios/dropout.py).

What each stream must give (lightning_3d/distributed/rng.py): the same masks where activations are replicated over
tensor-parallel ranks, different masks where they are sharded over them, and different streams on different replicas
and pipeline ranks; runs are reproducible from the seed, and activation checkpointing recomputes the same masks.
"""

from __future__ import annotations

from pathlib import Path

from tests.launch import run_scenario

# Activation checkpointing replays the same fp32 operations on the same masks; only the order in which autograd
# accumulates a tensor's gradient contributions can change, a few fp32 roundings (~1e-7 relative) on sums of a
# handful of terms. A mask recomputed differently changes ~10 % of the dropped entries: O(0.1) relative.
CHECKPOINT_TOLERANCE = 1e-5


def _tensor_parallel(summary: dict) -> None:
    assert summary["probe_consistent"]
    sharded, replicated = summary["tp_sharded_masks"], summary["tp_replicated_masks"]
    assert sharded["total"] > 0 and sharded["equal"] == 0, sharded  # every tp rank its own masks
    assert replicated["total"] > 0 and replicated["equal"] == replicated["total"], replicated
    assert summary["tp_attention_masks"]["total"] > 0
    assert summary["tp_sent_equal"] and all(summary["tp_sent_equal"])  # what a stage sends on (none from the last)
    assert summary["replicated_params"] > 0 and all(summary["tp_replicated_params_equal"])


def test_dropout_streams_under_3d_parallelism(tmp_path: Path) -> None:
    report = run_scenario(4, "dropout", ["--world", "4"], tmp_path / "report.json", timeout=900)
    gpt = report["gpt_122"]
    _tensor_parallel(gpt)
    assert gpt["tp_sent_compared"] > 0 and report["t5_122"]["tp_sent_compared"] > 0
    assert gpt["pp_entry_states_differ"] and all(gpt["pp_entry_states_differ"])
    dp = report["gpt_212"]
    _tensor_parallel(dp)
    assert all(dp["dp_entry_states_differ"]) and dp["dp_masks"]["total"] > 0 and dp["dp_masks"]["equal"] == 0, dp
    sp = report["gpt_122_sp"]  # the residual is sequence-sharded: its masks differ too (it is in "sharded")
    _tensor_parallel({**sp, "tp_sent_equal": [True]})  # the sent activations are sequence shards: not comparable
    assert sp["tp_sharded_masks"]["total"] > gpt["tp_sharded_masks"]["total"]
    _tensor_parallel(report["t5_122"])
    assert report["same_seed_bitwise"]
    assert not report["other_seed_masks_equal"]
    assert report["checkpointing_grads_compared"] > 0
    assert report["checkpointing_grad_diff"] <= CHECKPOINT_TOLERANCE, report["checkpointing_grad_diff"]


def _gpt_gradients(checkpointing: bool, tp_rank: int) -> list:
    import os

    import torch

    from lightning_3d.distributed import rng
    from lightning_3d.recipes.gpt.config import preset
    from lightning_3d.recipes.gpt.model import GPTModel

    config = preset("tiny", vocab_size=300, seq_length=16, num_layers=2, hidden_size=48, num_heads=12, dropout=0.1)
    # L3D_TEST_DEVICE=cuda (as for the scenarios) runs it on a GPU: the region then swaps the CUDA generator.
    device = torch.device(os.environ.get("L3D_TEST_DEVICE", "cpu"))
    rng.seed_parallel_rng(0, 0, tp_rank, device=device, seed=5)
    model = GPTModel(config, 300, activation_checkpointing=checkpointing)
    model.init_weights(1)
    model.to(device)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    model(ids).square().mean().backward()
    return [p.grad for p in model.parameters()]


def test_checkpointing_recomputes_the_tensor_parallel_masks(monkeypatch) -> None:
    """One process: the region's masks under torch.utils.checkpoint equal the first forward's (a tracker with a
    state of its own, which checkpoint does not stash, fails this); a different tp rank's masks give other gradients."""
    import torch

    from lightning_3d.distributed import rng

    # The seeding is process-wide: undo it for the tests that run after this one in the same process.
    monkeypatch.setattr(rng, "_region_key", None)
    monkeypatch.setattr(rng, "_region_device", None)

    plain, checkpointed, other_rank = _gpt_gradients(False, 1), _gpt_gradients(True, 1), _gpt_gradients(False, 0)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))  # the same ops on the same masks
    assert not all(torch.equal(a, b) for a, b in zip(plain, other_rank, strict=True))


def test_bad_global_seed(monkeypatch) -> None:
    import pytest

    from lightning_3d.distributed import rng

    monkeypatch.setattr(rng, "_region_key", None)
    monkeypatch.setattr(rng, "_region_device", None)
    monkeypatch.setenv("PL_GLOBAL_SEED", "seven")
    with pytest.raises(ValueError, match=r"PL_GLOBAL_SEED='seven' is not an integer; set it with"):
        rng.seed_parallel_rng(0, 0, 0)
    with pytest.raises(ValueError, match="supports CPU and CUDA devices, not meta"):
        rng.seed_parallel_rng(0, 0, 0, device="meta", seed=1)
