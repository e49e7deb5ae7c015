"""The T5 recipe under (dp, pp, tp) layouts, schedules and compression, against single-process training.

One process group per world size runs every case in sequence (one Trainer each). The model is tiny (4 encoder +
4 decoder blocks, hidden 32, 4 heads); inputs carry encoder padding (attention masks) and every target ends in a
random number of ignored (-100) labels, so data-parallel replicas hold different numbers of loss terms and only a
loss normalised over all replicas together reproduces the single-process token mean.
On 2 ranks two runs also save sharded checkpoints (for the export test), and ``t5_from_pretrained(--extra DIR)``
starts (1,2,1) and (1,1,2) runs from a transformers T5: every local shard must equal its weights before training.
"""

from __future__ import annotations

import json
import math
import time
from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes import T5
from lightning_3d.recipes.hf_t5 import hf_to_t5_state_dict, t5_from_pretrained
from tests.scenarios.common import CLIP, LossRecorder, ReplicaSlices, all_max, parse_args, trainer, write_report

VOCAB, ENC, DEC = 300, 16, 8
STEPS = 3
MODEL = dict(vocab_size=VOCAB, num_layers=4, num_decoder_layers=4, hidden_size=32, num_heads=4, head_dim=8,
             ffn_hidden_size=64, relative_attention_num_buckets=8, relative_attention_max_distance=16, warmup_steps=2,
             learning_rate=2e-3, min_learning_rate=2e-4, decay_steps=6, weight_decay=0.1, adam_eps=1e-6,
             optimizer_foreach=True)
V11 = dict(feed_forward="gated-gelu", tie_embeddings=False)


class Pairs(Dataset):
    """Random (input, target) pairs: inputs padded after a random length >= 6, targets with 1 to DEC real labels."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.inputs = torch.randint(1, VOCAB, (n, ENC), generator=g)
        lengths = torch.randint(6, ENC + 1, (n,), generator=g)
        self.mask = (torch.arange(ENC)[None, :] < lengths[:, None]).long()
        self.inputs = self.inputs * self.mask
        self.labels = torch.randint(1, VOCAB, (n, DEC), generator=g)
        valid = torch.randint(1, DEC + 1, (n, 1), generator=g)
        self.labels[torch.arange(DEC) >= valid] = -100
        self.decoder = torch.cat([torch.zeros(n, 1, dtype=torch.long), self.labels[:, :-1].clamp_min(0)], dim=1)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.inputs[i], "attention_mask": self.mask[i], "decoder_input_ids": self.decoder[i],
                "labels": self.labels[i]}


class PairData(pl.LightningDataModule):
    def __init__(self, global_batch: int) -> None:
        super().__init__()
        self.global_batch = global_batch

    def _loader(self, dataset: Dataset) -> DataLoader:
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = ReplicaSlices(len(dataset), self.global_batch, kw["num_replicas"], kw["rank"])
        return DataLoader(dataset, batch_size=self.global_batch // kw["num_replicas"], sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(Pairs())

    def val_dataloader(self) -> DataLoader:
        return self._loader(Pairs(16, seed=1))


def _loss(model, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["decoder_input_ids"], batch["attention_mask"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)


@lru_cache(maxsize=8)
def reference(global_batch: int, v11: bool = False) -> tuple:
    """(step losses, final parameters, validation loss) of plain single-process training."""
    module = T5("tiny", **MODEL, **(V11 if v11 else {}))
    module.configure_model()
    model, hp = module.model, module.hparams
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "relative_bias" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "relative_bias" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.adam_eps)
    floor = hp.min_learning_rate / hp.learning_rate

    def schedule(step: int) -> float:
        if step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.decay_steps - hp.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    data, losses = Pairs(), []
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, data[step * global_batch : (step + 1) * global_batch])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        losses.append(loss.item())
    val = Pairs(16, seed=1)
    with torch.no_grad():
        val_loss = _loss(model, val[0:global_batch]).item()  # the one batch the distributed run validates on
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, val_loss


def compare(module: T5, losses: list[float], ref: tuple) -> dict:
    ref_losses, ref_params, _ = ref
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    param_err = 0.0
    for name, p in module.model.named_parameters():
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        expected = ref_params["shared.weight" if name == "lm_head.weight" and name not in ref_params else name]
        full = full[: expected.shape[0]]
        param_err = max(param_err, ((full - expected).norm() / expected.norm().clamp_min(1e-12)).item())
    return {"loss_err": loss_err, "param_err": param_err}


class WeightCheck(pl.Callback):
    """Before the first step: the largest difference between any local parameter and its transformers tensor."""

    def __init__(self, hf_dir: str) -> None:
        from safetensors.torch import load_file

        config = json.loads((Path(hf_dir) / "config.json").read_text())
        self.expected, _ = hf_to_t5_state_dict(load_file(Path(hf_dir) / "model.safetensors"), config)
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


def pretrained(cfg: dict, hf_dir: str, path: str) -> dict:
    strategy = Compressed3DStrategy(pipeline_parallel_size=cfg["pp"], tensor_parallel_size=cfg["tp"], num_microbatches=2,
                                    compression=False)
    module = t5_from_pretrained(hf_dir, dropout=0.0, warmup_steps=1)
    check, losses = WeightCheck(hf_dir), LossRecorder()
    t = trainer(strategy, 1, [check, losses])
    t.fit(module, datamodule=PairData(4))
    t.save_checkpoint(path)
    return {**cfg, "path": path, "first_loss": losses.losses[0], "weight_err": all_max(check.err), "checked": check.checked,
            "loss_err": 0.0, "param_err": 0.0}


def cases(world: int) -> list[dict]:
    if world == 2:
        return [dict(dp=1, pp=2, tp=1, schedule=s, m=2) for s in ("gpipe", "1f1b", "interleaved_1f1b")] + [
            dict(dp=1, pp=2, tp=1, schedule="1f1b", m=2, split=[3, 5], validate=True, save="t5_121"),  # spans both stacks
            dict(dp=1, pp=2, tp=1, schedule="1f1b", m=2, v11=True),
            dict(dp=2, pp=1, tp=1, schedule="1f1b", m=2),
            dict(dp=1, pp=1, tp=2, schedule="1f1b", m=2, v11=True, save="t5_112"),
            dict(dp=1, pp=1, tp=2, schedule="1f1b", m=2, sp=True),
            dict(dp=1, pp=2, tp=1, pretrained="pretrained_121"), dict(dp=1, pp=1, tp=2, pretrained="pretrained_112")]
    return [dict(dp=1, pp=4, tp=1, schedule="1f1b", m=4), dict(dp=1, pp=4, tp=1, schedule="interleaved_1f1b", m=4),
            dict(dp=2, pp=2, tp=1, schedule="1f1b", m=2), dict(dp=1, pp=2, tp=2, schedule="1f1b", m=2),
            dict(dp=2, pp=1, tp=2, schedule="1f1b", m=2, v11=True), dict(dp=1, pp=2, tp=2, schedule="gpipe", m=2, sp=True),
            # CB + LEP at full rank on every send (and SC in its warm-up, FE): must equal the uncompressed run.
            dict(dp=1, pp=2, tp=2, schedule="1f1b", m=2, compressed=True),
            dict(dp=2, pp=2, tp=1, schedule="1f1b", m=2, compressed=True)]


def run(cfg: dict, work: Path, hf_dir: str) -> dict:
    if cfg.get("pretrained"):
        return pretrained(cfg, hf_dir, str(work / cfg["pretrained"]))
    global_batch = cfg["dp"] * cfg["m"] * 2
    compression = (dict(cb_rank=64, cb_epilogue_only=False, cb_min_compression_ratio=0.0, cb_lazy_error_propagation=True,
                        sc_warmup=100) if cfg.get("compressed")
                   else dict(compression=False))
    strategy = Compressed3DStrategy(
        data_parallel_size=cfg["dp"], pipeline_parallel_size=cfg["pp"], tensor_parallel_size=cfg["tp"],
        num_microbatches=cfg["m"], schedule=cfg["schedule"], pipeline_layer_split=cfg.get("split"),
        sequence_parallel=cfg.get("sp", False), **compression,
        gradient_accumulation_fusion=True,  # every layer: the tiny model's weights are below the "auto" threshold
    )
    recorder, model = LossRecorder(), T5("tiny", **MODEL, **(V11 if cfg.get("v11") else {}))
    start = time.perf_counter()
    t = trainer(strategy, STEPS, [recorder], limit_val_batches=1)
    data = PairData(global_batch)
    t.fit(model, datamodule=data)
    ref = reference(global_batch, cfg.get("v11", False))
    result = {**cfg, **{k: all_max(v) for k, v in compare(model, recorder.losses, ref).items()}}
    if cfg.get("compressed"):
        codec = strategy.compressed_backprop
        result["compressed_sends"] = all_max(sum(codec.compressed_sends.values()) if codec else 0)
    if cfg.get("validate"):
        metrics = t.validate(model, datamodule=data, verbose=False)[0]
        result.update(val_loss=metrics["val_loss"], val_ppl=metrics["val_ppl"], ref_val_loss=ref[2])
    if cfg.get("save"):
        result["path"] = str(work / cfg["save"])
        t.save_checkpoint(result["path"])
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    results = []
    work = args.report.with_suffix(".work")
    for cfg in cases(args.world):
        results.append(run(cfg, work, args.extra))
        write_report(args.report, {"results": results})  # partial results survive a later failure


if __name__ == "__main__":
    main()
