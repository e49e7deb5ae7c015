"""Context parallelism (lightning_3d/context): sequence sharding on one process, ring and Ulysses attention in process
groups.

The distributed cases run in one scenario at world 4 (tests/scenarios/context.py): cp=4 over the world, and two cp=2
groups side by side (dp=2 x cp=2), which covers cp=2 on a subgroup (world 2 would only repeat it on the world group).
Each rank compares its slice with full-sequence attention (and a tiny LM's loss and gradients with one process) within
the bounds derived there.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from lightning_3d.context import (
    causal_pairs,
    check_layout,
    check_ring_inputs,
    check_ulysses_heads,
    num_chunks,
    position_ids,
    rank_chunks,
    ring_attention,
    shard_batch,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from tests.launch import run_scenario


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_and_unshard_are_inverse_and_positions_follow_the_tokens(cp: int, layout: str) -> None:
    seq = 2 * cp * 5
    x = torch.randn(3, seq, 4)
    slices = [shard_sequence(x, cp, r, layout) for r in range(cp)]
    assert all(s.shape == (3, seq // cp, 4) for s in slices)
    assert torch.equal(unshard_sequence(slices, layout), x)
    # Every token exactly once, and each slice's position ids index the tokens it holds.
    positions = [position_ids(seq, cp, r, layout) for r in range(cp)]
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(seq))
    for s, p in zip(slices, positions):
        assert torch.equal(s, x[:, p])
    # Along another dim too (q/k/v are (batch, heads, seq, head dim)).
    y = torch.randn(2, 3, seq, 4)
    assert torch.equal(unshard_sequence([shard_sequence(y, cp, r, layout, dim=2) for r in range(cp)], layout, dim=2), y)


def test_zigzag_holds_chunks_i_and_mirror() -> None:
    assert [rank_chunks(4, r, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert num_chunks(4, "zigzag") == 8 and num_chunks(4, "contiguous") == 4
    assert position_ids(16, 4, 1, "zigzag").tolist() == [2, 3, 12, 13]
    assert position_ids(16, 4, 1, "contiguous").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_exactly(cp: int) -> None:
    seq = 2 * cp * 7
    zigzag = [causal_pairs(seq, cp, r, "zigzag") for r in range(cp)]
    contiguous = [causal_pairs(seq, cp, r, "contiguous") for r in range(cp)]
    total = seq * (seq + 1) // 2
    assert sum(zigzag) == sum(contiguous) == total
    assert len(set(zigzag)) == 1  # every rank computes the same number of (query, key) pairs
    # Contiguous: rank r's work grows like 2r + 1 (its queries see r earlier chunks and half of its own).
    c = seq // cp
    assert contiguous == [c * c * r + c * (c + 1) // 2 for r in range(cp)]


def test_shard_batch_slices_the_sequences_and_adds_their_positions() -> None:
    tokens = torch.arange(2 * 17).view(2, 17)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "weight": torch.ones(2)}
    parts = [shard_batch(batch, 2, r, "zigzag") for r in range(2)]
    assert parts[1]["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11], [21, 22, 23, 24, 25, 26, 27, 28]]
    assert parts[1]["position_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]] * 2  # a row per sample
    assert torch.equal(parts[0]["labels"], batch["labels"][:, parts[0]["position_ids"][0]])  # targets stay with inputs
    assert parts[0]["weight"] is batch["weight"]
    with pytest.raises(ValueError, match=r"no \['labels'\] to split.*name the sequence entries"):
        shard_batch({"input_ids": tokens}, 2, 0)
    with pytest.raises(ValueError, match=r"one length, got \{'input_ids': 16, 'labels': 17\}"):
        shard_batch({"input_ids": tokens[:, 1:], "labels": tokens}, 2, 0)
    with pytest.raises(ValueError, match=r"already has 'position_ids'"):
        shard_batch({**batch, "position_ids": torch.arange(16)}, 2, 0)


def test_sharding_errors_name_the_value_and_the_fix() -> None:
    message = r"Sequence length 30 .* context_parallel_size=4 .* not divisible by 8.*layout='contiguous'"
    with pytest.raises(ValueError, match=message):
        check_layout(30, 4, "zigzag")
    check_layout(48, 4, "zigzag", sequence_parallel_size=2)
    with pytest.raises(ValueError, match=r"leaves 10 tokens per rank.*tensor_parallel_size=4; .* multiple of 16"):
        check_layout(40, 4, "zigzag", sequence_parallel_size=4)
    with pytest.raises(ValueError, match=r"not divisible by 4"):
        shard_sequence(torch.zeros(1, 30), 4, 0, "contiguous")
    with pytest.raises(ValueError, match=r"Unknown context-parallel layout 'stripes'"):
        position_ids(16, 2, 0, "stripes")
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        shard_sequence(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match=r"equal lengths"):
        unshard_sequence([torch.zeros(1, 4), torch.zeros(1, 6)])


def test_ring_input_errors_are_raised_without_communication() -> None:
    """Pure checks (no process group exists here): every rank raises them before entering the ring."""
    q = torch.zeros(1, 2, 6, 8)
    cases = [
        ((q, q, q[..., :4]), dict(cp=2, layout="zigzag", causal=True), r"same head dim, got 8, 8 and 4"),
        ((q, q[:, :1], q[:, :1]), dict(cp=2, layout="zigzag", causal=True), r"same batch and heads.*grouped-query"),
        ((q[:, :, :5], q[:, :, :5], q[:, :, :5]), dict(cp=2, layout="zigzag", causal=True), r"5 \(odd\).*multiple of 2 x"),
        ((q, q[:, :, :4], q[:, :, :4]), dict(cp=2, layout="contiguous", causal=False), r"equally long.*6, 4 and 4"),
        ((q[0], q[0], q[0]), dict(cp=2, layout="zigzag", causal=True), r"query has shape \(2, 6, 8\)"),
        ((q, q, q.double()), dict(cp=2, layout="zigzag", causal=True), r"share dtype and device"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            check_ring_inputs(*args, **kwargs)
    check_ring_inputs(q[:, :, :5], q[:, :, :5], q[:, :, :5], cp=2, layout="zigzag", causal=False)  # no halves needed


def test_attention_without_a_group_is_sdpa() -> None:
    q, k, v = torch.randn(3, 2, 2, 8, 4).unbind(0)
    for causal in (True, False):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.equal(ring_attention(q, k, v, causal=causal), expected)
        assert torch.equal(ulysses_attention(q, k, v, causal=causal), expected)


def test_ulysses_needs_heads_divisible_by_cp() -> None:
    check_ulysses_heads(8, 4)
    with pytest.raises(ValueError, match=r"this rank's 6 heads are not divisible by context_parallel_size=4.*ring"):
        check_ulysses_heads(6, 4)


def test_ring_attention_and_cp_training_equal_one_process(tmp_path) -> None:
    report = run_scenario(4, "context", ["--world", "4"], tmp_path / "report.json", timeout=600)
    layouts = ["dp1xcp4", "dp2xcp2"]
    assert len(report["ranks"]) == 4
    for rank_report in report["ranks"]:
        assert sorted(rank_report) == sorted(layouts)
        for key in layouts:
            case = rank_report[key]
            # The same messages on every rank (each raised before any collective: the cases after them ran).
            assert case["errors"] == report["ranks"][0][key]["errors"]
            assert case["round_trips"] is True
            expected = [f"{kernel},{layout},{mask}" for kernel in ("ring", "ulysses")
                        for layout in ("contiguous", "zigzag") for mask in ("causal", "full")]
            assert sorted(case["attention"]) == sorted(expected + ["ring,zigzag,causal,bf16"])
            assert sorted(case["errors"]) == ["head_dim", "heads", "indivisible", "layout", "odd_local", "ulysses_odd"]
            assert sorted(case["training"]) == ["contiguous", "zigzag"]
    if os.environ.get("L3D_TEST_DEVICE") == "cuda":
        return  # the strategy's part runs on CPU only: CUDA's fp32 ring needs 64-token slices, the tiny GPT has 16
    strategy = report["strategy"]
    # Compressed3DStrategy(context_parallel_size=...) with pp, tp (and sequence parallelism), dp, cp 4 and Ulysses:
    # every layout equal to one process (tests/test_distributed.py's fp32 tolerance), on a ("dp", "pp", "cp", "tp") mesh.
    tolerance = 1e-5
    runs = {(r["dp"], r["pp"], r["cp"], r["tp"], r.get("attention", "ring")): r for r in strategy["layouts"]}
    assert sorted(runs) == [(1, 1, 2, 2, "ring"), (1, 1, 4, 1, "ring"), (1, 2, 2, 1, "ring"), (2, 1, 2, 1, "ring"),
                            (2, 1, 2, 1, "ulysses")]
    for key, run in runs.items():
        assert run["mesh"] == ["dp", "pp", "cp", "tp"] and run["mesh_shape"] == list(key[:4]), run
        assert run["loss_err"] <= tolerance and run["param_err"] <= tolerance, run
    # shard_optimizer_state with cp: the optimizer state is split over all dp x cp = 4 replicas, still exact.
    assert [r["optimizer_sharded_over"] for r in runs.values()] == [4 if r.get("shard") else 1 for r in runs.values()]
    assert runs[2, 1, 2, 1, "ulysses"]["optimizer_sharded_over"] == 4
    # A dp 2 x cp 2 checkpoint resumes at cp 1 and cp 4 with the straight run's third loss and parameters.
    for name in ("dp4_cp1", "dp1_cp4"):
        resumed = strategy["resume"][name]
        assert resumed["loss_err"] <= tolerance and resumed["param_err"] <= tolerance, (name, resumed)
    # SC over dp x cp compresses and keeps the cp replicas' parameters identical.
    sc = strategy["selective"]
    assert sc["compressing"] and sc["bytes_after"] < sc["bytes_before"] and sc["losses_finite"], sc
    assert sc["replica_spread"] == 0.0, sc
    # Bad values: one message each, the same on every rank (raised without communication).
    errors = strategy["errors"]
    assert strategy["errors_same_on_every_rank"]
    assert "Sequence length 6 cannot be split over context_parallel_size=2" in errors["length"]
    assert "multiple of 4" in errors["length"]
    assert "sequence parallelism cannot split over tensor_parallel_size=4" in errors["sp_length"]
    assert "Packed documents" in errors["packed"] and "context_parallel_size=1" in errors["packed"]
    assert errors["dropout"].startswith("ValueError: dropout=0.1 with context_parallel_size=2")
    assert "3 heads are not divisible by context_parallel_size=2" in errors["ulysses_heads"]
    assert errors["plain_module"].startswith("TypeError: context_parallel_size=2 needs a module")
