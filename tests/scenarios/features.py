"""Lightning features under the strategy: plain data parallelism, validation/test under pipelining, resume.

- A plain LightningModule (no protocol) with pure data parallelism equals a single-process run.
- ``trainer.validate`` / ``trainer.test`` under pp x tp log the reference model's loss on every rank, also when the
  evaluation batch does not divide into the micro-batch count.
- Under bf16-mixed the residual stream, and with it the activations between pipeline stages, travel in bf16 (half
  the bytes of ``fp32_residual=True``), and both give nearly the same losses.
- Stop at step 3 with a sharded checkpoint, resume with ``ckpt_path``: the losses and final parameters are
  bitwise those of the uninterrupted run (mid-epoch, through the stateful loader).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes.data import ResumableDataLoader, ResumableDistributedSampler
from tests.scenarios.common import WORLD, LossRecorder, TestData, Tokens, all_max, make_model, parse_args, reference, trainer, write_report


class Regression(pl.LightningModule):
    """Plain module: a two-layer MLP; the loss is the mean over its local batch, as with DDP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        per = 16 // kw["num_replicas"]
        idx = [t * 16 + kw["rank"] * per + i for t in range(4) for i in range(per)]
        return DataLoader(torch.utils.data.TensorDataset(self.x[idx], self.y[idx]), batch_size=per)


def plain_data_parallel() -> dict:
    module = Regression()
    trainer(Compressed3DStrategy(compression=False), 4).fit(module)
    ref = Regression()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for t in range(4):
        opt.zero_grad()
        F.mse_loss(ref.net(ref.x[t * 16 : (t + 1) * 16]), ref.y[t * 16 : (t + 1) * 16]).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    err = max(((a - b).norm() / b.norm()).item() for a, b in zip(module.parameters(), ref.parameters()))
    return {"param_err": all_max(err)}


def evaluation(dp: int, pp: int, tp: int, schedule: str = "1f1b") -> dict:
    """Train 2 steps, then validate and test; every rank must log the reference loss of the trained model.

    Under the interleaved schedule (pp=2, v=2), 3 evaluation micro-batches leave a partial group of pp."""
    model = make_model()
    t = trainer(Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                     num_microbatches=2, compression=False, schedule=schedule), 2, limit_val_batches=1.0)
    data = TestData(8)
    t.fit(model, datamodule=data)
    val = t.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    data.test_dataloader = data.val_dataloader
    test = t.test(model, datamodule=data, verbose=False)[0]["test_loss"]
    t.strategy.num_microbatches = 3  # batches of 8 become micro-batches of 2, 3 and 3: still the same loss
    uneven = t.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    _, params = reference(2, 8)
    ref_model = make_model()
    ref_model.configure_model()
    ref_model.model.load_state_dict({**params, "head.weight": params["embed.wte.weight"]}, strict=False)
    batch = Tokens(32, seed=1)[0:32]
    with torch.no_grad():
        logits = ref_model.model(batch["input_ids"])
    per_batch = [F.cross_entropy(logits[i : i + 8].flatten(0, 1), batch["labels"][i : i + 8].flatten()) for i in range(0, 32, 8)]
    expected = torch.stack(per_batch).mean().item()
    spread = torch.tensor([val, test, uneven], dtype=torch.float64)
    low, high = spread.clone(), spread.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return {"val": val, "test": test, "val_uneven_microbatches": uneven, "expected": expected,
            "rank_spread": (high - low).max().item()}


def mixed_precision_boundaries(dp: int, pp: int) -> dict:
    """Bytes of forward activations this rank sent in 2 steps of bf16-mixed training, bf16 and fp32 residual."""
    report = {}
    for name, fp32_residual in (("bf16", False), ("fp32", True)):
        recorder = LossRecorder()
        strategy = Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, num_microbatches=4,
                                        compression=False)
        trainer(strategy, 2, [recorder], precision="bf16-mixed").fit(make_model(fp32_residual=fp32_residual),
                                                                     datamodule=TestData(8))
        sent = strategy.communication_stats()["forward_activations"]["bytes_before"]
        report[name] = {"sent": all_max(sent), "losses": recorder.losses}
    return report


def resumable_data(global_batch: int) -> pl.LightningDataModule:
    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            kw = self.trainer.strategy.distributed_sampler_kwargs
            dataset = Tokens(64)
            sampler = ResumableDistributedSampler(dataset, num_replicas=kw["num_replicas"], rank=kw["rank"], shuffle=True, seed=3)
            return ResumableDataLoader(dataset, batch_size=global_batch // kw["num_replicas"], sampler=sampler)

    return Data()


def resume(dp: int, pp: int, tp: int, schedule: str, workdir: Path, compressed: bool = False) -> dict:
    # Compressed: CB + LEP at rank 4, SC at rank 4 compressing from step 3 on; its state rides in the checkpoint.
    options = (dict(cb_rank=4, cb_min_compression_ratio=0.0, cb_lazy_error_propagation=True, sc_rank=4, sc_warmup=2)
               if compressed else dict(compression=False))

    def strategy():
        return Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                    num_microbatches=4, schedule=schedule, **options)

    full, first, second = LossRecorder(), LossRecorder(), LossRecorder()
    straight = make_model()
    trainer(strategy(), 6, [full]).fit(straight, datamodule=resumable_data(8))
    # Gathered now: the next fit prepares a new model, which destroys this run's groups (README, "Across fits").
    expected = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in straight.parameters()]
    ckpt_dir = workdir / f"ckpt_{dp}{pp}{tp}{'c' if compressed else ''}"
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)
    trainer(strategy(), 3, [first, saver], enable_checkpointing=True).fit(make_model(), datamodule=resumable_data(8))
    path = str(next(ckpt_dir.glob("*.ckpt")))
    resumed = make_model()
    trainer(strategy(), 6, [second]).fit(resumed, datamodule=resumable_data(8), ckpt_path=path)
    diff = 0.0
    for a, b in zip(expected, resumed.parameters(), strict=True):
        b = b.full_tensor() if isinstance(b, DTensor) else b
        diff = max(diff, (a - b).abs().max().item())
    return {"layout": [dp, pp, tp], "compressed": compressed, "straight": full.losses, "resumed": first.losses + second.losses,
            "max_param_diff": all_max(diff), "checkpoint_is_dir": Path(path).is_dir() and (Path(path) / ".metadata").exists()}


def main() -> None:
    args = parse_args()
    workdir = args.report.with_suffix(".work")
    report = {"plain": plain_data_parallel()}
    report["evaluation"] = evaluation(1, 2, WORLD // 2, "interleaved_1f1b") if WORLD >= 2 else evaluation(1, 1, 1)
    report["mixed_precision"] = mixed_precision_boundaries(WORLD // 2, 2)  # the test runs this scenario on 4
    report["resume"] = [resume(1, 2, WORLD // 2, "interleaved_1f1b", workdir), resume(WORLD // 2, 2, 1, "gpipe", workdir),
                        resume(WORLD // 2, 2, 1, "1f1b", workdir, compressed=True)]
    write_report(args.report, report)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
