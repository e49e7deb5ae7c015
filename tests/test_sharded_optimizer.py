"""Sharded optimizer state (``shard_optimizer_state=True``, docs/sharded_optimizer.md).

The distributed checks run in one group of 4 processes (tests/scenarios/sharded_optimizer.py). Tolerances: fp32
losses and final parameters within 1e-5 relative of the single-process reference, as for every layout
(tests/test_distributed.py; the reference's Adam eps is explained in tests/scenarios/common.py): sharding changes
only the order in which the squared gradient norm is summed, and where each element's (element-wise) update runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_3d import Compressed3DStrategy
from lightning_3d.distributed.sharded_optimizer import ShardedOptimizer, owned_elements, shard_size, units_of
from tests.launch import run_scenario

TOLERANCE = 1e-5


@pytest.mark.parametrize("numel, dp", [(1, 2), (7, 2), (8, 4), (10, 4), (3, 4), (1000003, 8)])
def test_every_element_has_exactly_one_owner(numel: int, dp: int) -> None:
    owned = [owned_elements(numel, dp, r) for r in range(dp)]
    assert sum(owned) == numel
    assert all(0 <= n <= shard_size(numel, dp) for n in owned)
    assert shard_size(numel, dp) * dp - numel < dp  # the padding of one bucket is under dp elements


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_cover_every_parameter_once_in_the_users_param_groups(dtype: torch.dtype) -> None:
    """Two replicas' layouts of one bucket (a 3x5 weight, a 4-element bias) and one unbucketed parameter: every
    element is in exactly one replica's pieces, fp32 pieces are views of their parameter (bf16 ones fp32 masters),
    and the optimizer keeps its own param-group dicts, so an LR scheduler still drives them."""
    torch.manual_seed(0)
    w, b, e = (torch.nn.Parameter(torch.randn(*s).to(dtype)) for s in ((3, 5), (4,), (7,)))
    covered = {id(p): torch.zeros(p.numel()) for p in (w, b, e)}
    for rank in range(2):
        opt = torch.optim.AdamW([{"params": [w, e]}, {"params": [b], "weight_decay": 0.0}], lr=1.0)
        groups = list(opt.param_groups)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        sharded = ShardedOptimizer(opt, units_of(opt, [[w, b]]), {id(w): "w", id(b): "b", id(e): "e"}, None, 2, rank, 0)
        assert [u.numel for u in sharded.units] == [19, 7] and opt.param_groups == groups
        assert all(g is h for g, h in zip(opt.param_groups, groups))
        for piece in sharded.pieces:
            covered[id(piece.param)][piece.start : piece.end] += 1
            assert piece.main.dtype == torch.float32
            assert (piece.main.data_ptr() == piece.param.view(-1)[piece.start :].data_ptr()) == (dtype == torch.float32)
            assert torch.equal(piece.main, piece.param.detach().view(-1)[piece.start : piece.end].float())
        assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
            owned_elements(u.numel, 2, rank) for u in sharded.units)
        opt.step()
        sched.step()
        assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    assert all(torch.equal(c, torch.ones_like(c)) for c in covered.values())


def test_a_used_optimizer_is_refused() -> None:
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w])
    w.grad = torch.ones(4)
    opt.step()
    with pytest.raises(RuntimeError, match="shard_optimizer_state=True needs a fresh optimizer, but AdamW already holds"):
        ShardedOptimizer(opt, [[w]], {id(w): "w"}, None, 2, 0, 0)


def test_option_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"`shard_optimizer_state='yes'` must be True or False"):
        Compressed3DStrategy(shard_optimizer_state="yes")
    assert Compressed3DStrategy(shard_optimizer_state=True).options.shard_optimizer_state is True


def test_sharded_optimizer_state_trains_like_one_process_and_checkpoints_reshard(tmp_path: Path) -> None:
    report = run_scenario(4, "sharded_optimizer", ["--world", "4"], tmp_path / "report.json", timeout=900)
    layouts = report["layouts"]
    assert [tuple(r["layout"]) for r in layouts] == [(2, 1, 2), (2, 2, 1), (4, 1, 1)]
    for r in layouts:
        assert r["loss_err"] <= TOLERANCE and r["param_err"] <= TOLERANCE, r
        # Each rank's two AdamW moments are exactly its ranges of the units (the shard sizes), the replicas' shares
        # add up to the unsharded state, and a share is 1/dp of it up to the padding (under dp elements a unit).
        assert r["bytes_off"] == 0.0 and r["beyond_padding"] <= 0.0, r
        assert r["fraction"] <= 1 / r["layout"][0] + 1e-3, r
        # A checkpoint save holds each parameter's state on one replica: a share, give or take one parameter.
        assert r["save_beyond_share"] <= 0.0, r
    assert layouts[0]["units"] > 3  # small buckets: parameters are cut between the replicas' ranges
    sc = report["selective"]  # SC on stage 0: sharded equals unsharded with the same compression
    assert sc["compressed"] == 1.0 and sc["loss_err"] <= TOLERANCE and sc["param_err"] <= TOLERANCE, sc
    assert report["plain_param_err"] <= TOLERANCE
    assert report["bf16"] == {"fp32_masters": True, "master_rounding_off": 0.0, "replicas_differ": 0.0}, report["bf16"]
    assert "pass Compressed3DStrategy(shard_optimizer_state=True)" in report["zero_redundancy"]
    assert "ZeroRedundancyOptimizer" in report["zero_redundancy"]
    ckpt = report["checkpoints"]
    assert ckpt["exact"]["losses"] == ckpt["straight"] and ckpt["exact"]["max_param_diff"] == 0.0, ckpt["exact"]
    for name in ("dp4", "unsharded"):  # another summation order: fp32 rounding of the same training
        assert ckpt[name]["loss_err"] <= TOLERANCE and ckpt[name]["param_err"] <= TOLERANCE, (name, ckpt[name])
