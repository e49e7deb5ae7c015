"""Hugging Face interop under the strategy (2 processes): sharded checkpoints to export, GPT-2 weights to import.

- ``gpt_112``: train a tiny GPT 2 steps in (1,1,2), validate (the loss the exported model must reproduce) and
  ``trainer.save_checkpoint`` a sharded checkpoint directory (vocabulary padded to 512 for tp=2).
- ``pretrained_121`` / ``pretrained_112``: ``gpt_from_pretrained(--extra DIR)``; every local shard equals the
  GPT-2 weights before training, the first step's loss is reported, and a checkpoint is saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes.hf import gpt_from_pretrained, hf_to_gpt_state_dict
from tests.scenarios.common import LossRecorder, TestData, all_max, make_model, parse_args, trainer, write_report

SMALL = dict(num_layers=2, hidden_size=32, num_heads=4)


def strategy(pp: int, tp: int) -> Compressed3DStrategy:
    return Compressed3DStrategy(pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=2, compression=False)


def gpt_checkpoint(pp: int, tp: int, path: str) -> dict:
    module = make_model(**SMALL)
    t = trainer(strategy(pp, tp), 2, limit_val_batches=1)
    data = TestData(8)
    t.fit(module, datamodule=data)
    val_loss = t.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
    t.save_checkpoint(path)
    return {"path": path, "val_loss": val_loss}


class WeightCheck(pl.Callback):
    """Before the first step: the largest difference between any local parameter and its GPT-2 tensor."""

    def __init__(self, hf_dir: str) -> None:
        from safetensors.torch import load_file  # not transformers: its import costs seconds per process

        config = json.loads((Path(hf_dir) / "config.json").read_text())
        self.expected, _ = hf_to_gpt_state_dict(load_file(Path(hf_dir) / "model.safetensors"), config)
        self.err, self.checked = float("inf"), 0

    def on_train_start(self, trainer, module) -> None:
        err = 0.0
        for name, p in module.model.named_parameters():
            full = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            want = self.expected[name]
            rows = min(full.shape[0], want.shape[0])
            padding = full[rows:].abs().max().item() if full.shape[0] > rows else 0.0
            err = max(err, (full[:rows] - want[:rows]).abs().max().item(), padding)
            self.checked += 1
        self.err = err


def pretrained(pp: int, tp: int, hf_dir: str, path: str) -> dict:
    module = gpt_from_pretrained(hf_dir, dropout=0.0, warmup_steps=1)
    check, losses = WeightCheck(hf_dir), LossRecorder()
    t = trainer(strategy(pp, tp), 1, [check, losses])
    t.fit(module, datamodule=TestData(8))
    t.save_checkpoint(path)
    hparams = {k: v for k, v in module.hparams.items() if isinstance(v, (int, float, str, bool))}
    return {"path": path, "first_loss": losses.losses[0], "weight_err": all_max(check.err), "checked": check.checked,
            "key_bias": module.config.key_bias, "hparams": hparams}


def main() -> None:
    args = parse_args()
    work = args.report.with_suffix(".work")
    hf_dir = args.extra
    report = {
        "gpt_112": gpt_checkpoint(1, 2, str(work / "gpt_112")),
        "pretrained_121": pretrained(2, 1, hf_dir, str(work / "pretrained_121")),
        "pretrained_112": pretrained(1, 2, hf_dir, str(work / "pretrained_112")),
    }
    torch.distributed.barrier()
    write_report(args.report, report)


if __name__ == "__main__":
    main()
