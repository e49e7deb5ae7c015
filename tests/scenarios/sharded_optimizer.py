"""Sharded optimizer state (``shard_optimizer_state=True``) on 4 processes, one process group for every check.

- (2,1,2), (2,2,1) and (4,1,1) train like the single-process reference (masked labels, clipping, the recipe's LR
  schedule), and each rank's element-wise optimizer state is its exact share of the unsharded state.
- With SC on stage 0 (FE off, so stage 1's tied head stays in a bucket that is all-reduced and sliced), sharded
  equals unsharded training with the same compression.
- A sharded checkpoint resumes bitwise; it also resumes at dp=4 (sharded) and unsharded, like the straight run.
- A plain LightningModule (SGD with momentum) at dp=4 trains like one process.
- Under bf16-true the optimizer steps fp32 master pieces, and the replicas end every step with the same model.
- ``ZeroRedundancyOptimizer`` is refused with a message that names the option.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_3d import Compressed3DStrategy
from lightning_3d.distributed.sharded_optimizer import owned_elements
from lightning_3d.strategies.optimizer_sharding import check_optimizers
from lightning_3d.utils.tensors import local
from tests.scenarios.common import LossRecorder, TestData, all_max, compare, make_model, parse_args, reference, trainer, write_report
from tests.scenarios.features import Regression, resumable_data

STEPS = 6


def strategy(dp: int, pp: int, tp: int, m: int, shard: bool = True, **kw) -> Compressed3DStrategy:
    kw.setdefault("compression", False)
    kw.setdefault("gradient_accumulation_fusion", True)  # the tiny models' weights are below the "auto" threshold
    return Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                num_microbatches=m, shard_optimizer_state=shard, **kw)


def state_bytes(s: Compressed3DStrategy, model) -> dict:
    """This rank's element-wise state bytes, what the shard sizes say it must be, and the unsharded state of this
    rank's stage and tensor shard (AdamW: two fp32 moments per element)."""
    sharded = s.engine.sharded
    dp, rank = s.dims.dp, s.dp_rank
    expected = 8 * sum(owned_elements(u.numel, dp, rank) for u in sharded.units)
    unsharded = 8 * sum(local(p).numel() for p in model.parameters())
    total = torch.tensor(float(sharded.state_bytes()), dtype=torch.float64)
    dist.all_reduce(total, group=s.groups.dp_group)  # the replicas' shares add up to the unsharded state
    # What a checkpoint save holds on this replica: the state of the parameters that start in its ranges, each
    # parameter on exactly one replica.
    saved = sum(local(v).numel() * local(v).element_size() for k, v in sharded.flat_state_dict().items()
                if k.startswith("state.") and v.ndim > 0)
    saved_total = torch.tensor(float(saved), dtype=torch.float64)
    dist.all_reduce(saved_total, group=s.groups.dp_group)
    off = abs(sharded.state_bytes() - expected) + abs(total.item() - unsharded) + abs(saved_total.item() - unsharded)
    padding = abs(sharded.state_bytes() - unsharded / dp) - 8 * (dp - 1) * len(sharded.units)
    largest = 8 * max(local(p).numel() for p in model.parameters())
    return {"bytes_off": all_max(off), "beyond_padding": all_max(padding),
            "save_beyond_share": all_max(saved - unsharded / dp - largest),
            "fraction": all_max(sharded.state_bytes() / unsharded), "units": len(sharded.units)}


def layout(dp: int, pp: int, tp: int, m: int, **kw) -> dict:
    recorder, model = LossRecorder(), make_model()
    s = strategy(dp, pp, tp, m, **kw)
    global_batch = dp * m * 2
    trainer(s, STEPS, [recorder]).fit(model, datamodule=TestData(global_batch, masked=True))
    result = compare(model, recorder.losses, reference(STEPS, global_batch, masked=True))
    return {"layout": [dp, pp, tp], "loss_err": all_max(result["loss_err"]), "param_err": all_max(result["param_err"]),
            **state_bytes(s, model)}


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter of the model by name, gathered from all ranks (stages hold different ones)."""
    mine = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.model.named_parameters()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {n: t for part in parts for n, t in part.items()}


def param_errs(model, expected: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Worst relative (norm) and absolute (element) difference of this rank's parameters from ``expected``."""
    rel = diff = 0.0
    for name, p in model.model.named_parameters():
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        rel = max(rel, ((full - expected[name]).norm() / expected[name].norm().clamp_min(1e-12)).item())
        diff = max(diff, (full - expected[name]).abs().max().item())
    return all_max(rel), all_max(diff)


def with_selective_compression() -> dict:
    """(2,2,1), SC at rank 4 on stage 0 from step 2 on, FE off: sharded against unsharded with the same compression."""
    runs = {}
    for shard in (False, True):
        recorder, model = LossRecorder(), make_model()
        s = strategy(2, 2, 1, 4, shard, compression=True, compressed_backprop=False, sc_rank=4, sc_warmup=1,
                     compressed_stages=[0], fused_embedding_sync=False, sc_matmul_precision="fp32")
        trainer(s, STEPS, [recorder]).fit(model, datamodule=TestData(16, masked=True))
        runs[shard] = (recorder.losses, full_params(model), s.selective_compression is not None and s.pp_rank == 0)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(runs[True][0], runs[False][0], strict=True))
    err = max(((runs[True][1][n] - t).norm() / t.norm()).item() for n, t in runs[False][1].items())
    return {"loss_err": all_max(loss_err), "param_err": all_max(err), "compressed": all_max(float(runs[True][2]))}


def checkpoints(workdir: Path) -> dict:
    """Straight 6 steps sharded at (2,2,1); 3 steps with a checkpoint; resumed to 6 at (2,2,1) sharded (bitwise), at
    (4,1,1) sharded and at (2,2,1) unsharded (the straight run within fp32 rounding of a different summation order)."""
    straight, model = LossRecorder(), make_model()
    trainer(strategy(2, 2, 1, 4), STEPS, [straight]).fit(model, datamodule=resumable_data(8))
    expected = full_params(model)
    folder = workdir / "sharded_ckpt"
    saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1)
    first = LossRecorder()
    trainer(strategy(2, 2, 1, 4), 3, [first, saver], enable_checkpointing=True).fit(make_model(), datamodule=resumable_data(8))
    path = str(next(folder.glob("*.ckpt")))
    report = {"straight": straight.losses}
    for name, s in (("exact", strategy(2, 2, 1, 4)), ("dp4", strategy(4, 1, 1, 2)),
                    ("unsharded", strategy(2, 2, 1, 4, shard=False))):
        resumed, model = LossRecorder(), make_model()
        trainer(s, STEPS, [resumed]).fit(model, datamodule=resumable_data(8), ckpt_path=path)
        losses = first.losses + resumed.losses
        rel, diff = param_errs(model, expected)
        report[name] = {
            "losses": losses,
            "loss_err": all_max(max(abs(a - b) / abs(b) for a, b in zip(losses, straight.losses, strict=True))),
            "param_err": rel, "max_param_diff": diff,
        }
    return report


def bf16_master_weights() -> dict:
    """bf16-true at (2,2,1), 2 steps: the optimizer steps fp32 masters of bf16 parameters; after the all-gather every
    parameter is its master rounded to bf16 on the replica that owns it, and the replicas hold the same model."""
    model = make_model()
    s = strategy(2, 2, 1, 4)
    trainer(s, 2, precision="bf16-true").fit(model, datamodule=TestData(16))
    pieces = s.engine.sharded.pieces
    fp32_masters = all(pc.main.dtype == torch.float32 and pc.param.dtype == torch.bfloat16 for pc in pieces)
    rounded = max((local(pc.param).detach().reshape(-1)[pc.start : pc.end].float() - pc.main.bfloat16().float())
                  .abs().max().item() for pc in pieces)
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=s.groups.dp_group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=s.groups.dp_group)
    return {"fp32_masters": all_max(0.0 if fp32_masters else 1.0) == 0.0, "master_rounding_off": all_max(rounded),
            "replicas_differ": all_max((high - low).abs().max().item())}


def plain_module() -> float:
    """A plain LightningModule (no pipeline protocol) with SGD + momentum at dp=4, sharded, against one process."""
    module = Regression()
    trainer(Compressed3DStrategy(compression=False, shard_optimizer_state=True), 4).fit(module)
    ref = Regression()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for t in range(4):
        opt.zero_grad()
        F.mse_loss(ref.net(ref.x[t * 16 : (t + 1) * 16]), ref.y[t * 16 : (t + 1) * 16]).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    return all_max(max(((a - b).norm() / b.norm()).item() for a, b in zip(module.parameters(), ref.parameters())))


def zero_redundancy_refused() -> str:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = [torch.nn.Parameter(torch.zeros(4))]
    try:
        check_optimizers([ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)])
    except TypeError as err:
        return str(err)
    return ""


def main() -> None:
    args = parse_args()
    if args.extra == "222":  # the 8-process layout alone (tests/scenarios/layouts.py runs it in its world-8 group)
        write_report(args.report, {"layouts": [layout(2, 2, 2, 4)]})
        return
    workdir = args.report.with_suffix(".work")
    report: dict = {"layouts": []}
    # (2,1,2) with small buckets (many units, parameters cut between replicas' ranges), the others with the default
    # ones and gradient-accumulation fusion (fp32 buffers padded to a multiple of dp, reduce-scattered as they are).
    for dp, pp, tp, m, kw in ((2, 1, 2, 2, {"bucket_size_mb": 0.02}), (2, 2, 1, 4, {}), (4, 1, 1, 2, {})):
        report["layouts"].append(layout(dp, pp, tp, m, **kw))
        write_report(args.report, report)
    report["zero_redundancy"] = zero_redundancy_refused()
    report["plain_param_err"] = plain_module()
    report["selective"] = with_selective_compression()
    report["bf16"] = bf16_master_weights()
    write_report(args.report, report)
    report["checkpoints"] = checkpoints(workdir)
    write_report(args.report, report)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
