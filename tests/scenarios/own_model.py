"""A user's own model (examples/own_model.py: RMSNorm, SwiGLU, tied head) through the protocol at (1, 2, 2) and
(2, 2, 1) against single-process training, in one process group of 4; also checks there that the logged
``comm/*`` metrics are the job's (summed over ranks) and that the model summary counts the whole model."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_3d import Compressed3DStrategy
from lightning_3d.callbacks.progress import whole_model_counts
from tests.launch import ROOT
from tests.scenarios.common import ReplicaSlices, all_max, parse_args, trainer, write_report

sys.path.insert(0, str(ROOT / "examples"))
from own_model import TinyLM, random_tokens  # noqa: E402

STEPS, GLOBAL_BATCH, SAMPLES = 4, 8, 32


class Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = ReplicaSlices(SAMPLES, GLOBAL_BATCH, kw["num_replicas"], kw["rank"])
        return DataLoader(random_tokens(SAMPLES), batch_size=GLOBAL_BATCH // kw["num_replicas"], sampler=sampler)


def reference() -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Plain PyTorch on one process: the module's own one-device path, its optimizer, the same global batches."""
    model = TinyLM()
    model.configure_model()  # no trainer: materialises and initialises on the CPU
    optimizer = model.configure_optimizers()
    losses = []
    for batch in DataLoader(random_tokens(SAMPLES), batch_size=GLOBAL_BATCH):
        loss = model.pipeline_loss(model.net(batch["input_ids"]), batch) / model.pipeline_loss_terms(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses[:STEPS], params, sum(p.numel() for p in params.values())


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def run(dp: int, pp: int, tp: int, ref: tuple) -> dict:
    strategy = Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                    num_microbatches=2, compression=False)
    model, losses = TinyLM(), Losses()
    fit = trainer(strategy, STEPS, [losses], gradient_clip_val=None)
    fit.fit(model, datamodule=Data())
    ref_losses, ref_params, ref_count = ref
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses.values, ref_losses, strict=True))
    param_err = 0.0
    for name, p in model.named_parameters():
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        expected = ref_params.get(name, ref_params["net.embed.weight"] if name == "net.head.weight" else None)
        param_err = max(param_err, ((full - expected).norm() / expected.norm()).item())
    # The logged comm/bytes_sent is the previous step's traffic of the whole job; steps are alike, so it equals
    # the sum over ranks of each rank's last step.
    mine = sum(v["bytes_after"] for v in strategy.communication_stats("last_step").values())
    total = torch.tensor(float(mine), dtype=torch.float64)
    dist.all_reduce(total)
    logged = float(fit.callback_metrics["comm/bytes_sent"])
    counts = whole_model_counts(fit, model)
    return {"layout": [dp, pp, tp], "loss_err": all_max(loss_err), "param_err": all_max(param_err),
            "bytes_logged": logged, "bytes_job": total.item(), "bytes_mine": float(mine),
            "bytes_logged_max": all_max(logged), "counted": sum(t for t, _ in counts.values()), "parameters": ref_count}


def main() -> None:
    args = parse_args()
    ref = reference()
    results = []
    for layout in ((1, 2, 2), (2, 2, 1)):
        results.append(run(*layout, ref))
        write_report(args.report, {"results": results})


if __name__ == "__main__":
    main()
