"""Shared pieces of the distributed scenarios: a tiny GPT, deterministic data, and the single-process reference.

The reference is plain PyTorch (no Lightning, no strategy): the same weights (layout-independent init),
the same global batches, AdamW, gradient clipping and the recipe's LR schedule. Every process computes it
itself (it is tiny), so a rank can compare its own shard of every parameter without gathering.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_3d.pipeline.microbatch import MicroBatches
from lightning_3d.pipeline.schedules import Action
from lightning_3d.recipes import GPT

VOCAB, SEQ = 300, 16
# Lightning's environment teardown deletes WORLD_SIZE after each fit; remember the launch values.
WORLD = int(os.environ.get("WORLD_SIZE", 1))
LOCAL_WORLD = int(os.environ.get("LOCAL_WORLD_SIZE", WORLD))
# L3D_TEST_DEVICE=cuda runs the same scenarios on GPUs with NCCL (used on the lent GPU machines); the
# reference is then built on the GPU too, because the seeded init draws from that device's generator.
DEVICE = os.environ.get("L3D_TEST_DEVICE", "cpu")
# adam_eps=1e-6 rather than 1e-8: different (dp, pp, tp) layouts sum in different orders, so gradients agree
# to fp32 rounding (~1e-7 relative); where a zero-initialised bias has a near-zero gradient, Adam's
# g / (|g| + eps) with eps=1e-8 turns that rounding into O(lr) differences. 1e-6 is still far below the
# gradients' scale and keeps the comparison about the parallelism, not about Adam's conditioning.
MODEL = dict(vocab_size=VOCAB, seq_length=SEQ, num_layers=12, hidden_size=48, num_heads=12, warmup_steps=2,
             learning_rate=2e-3, min_learning_rate=2e-4, decay_steps=6, adam_eps=1e-6,
             optimizer_foreach=True)  # the CUDA default path, which refuses mixed DTensor/Tensor groups
CLIP = 0.5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    parser.add_argument("--extra", default="")
    return parser.parse_args()


def make_model(**overrides) -> GPT:
    return GPT("tiny", **{**MODEL, **overrides})


class Tokens(Dataset):
    def __init__(self, n: int = 256, seq: int = SEQ, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i, :-1], "labels": self.data[i, 1:]}


def ignore_some(labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``labels`` with a random number (0 to half the length) of random positions per sample set to -100 (ignored),
    like fine-tuning targets with masked prompts or padding: replicas then hold different numbers of loss terms, and
    only a loss normalised by the terms of all replicas together reproduces the single-process token mean. At most
    half, at random places: every position keeps most of its labels, so no parameter's gradient is left to the
    few terms whose rounding Adam would magnify (see adam_eps in MODEL)."""
    rows, length = labels.shape
    ignored = torch.randint(0, length // 2 + 1, (rows, 1), generator=g)
    rank = torch.rand(rows, length, generator=g).argsort(dim=1).argsort(dim=1)  # a random order of the positions
    return labels.masked_fill(rank < ignored, -100)


class MaskedTokens(Tokens):
    """``Tokens`` with a random number of ignored (-100) labels per sample (see ``ignore_some``)."""

    def __init__(self, n: int = 256, seq: int = SEQ, seed: int = 0) -> None:
        super().__init__(n, seq, seed)
        self.labels = ignore_some(self.data[:, 1:], torch.Generator().manual_seed(seed + 1000))

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i, :-1], "labels": self.labels[i]}


class Progressions(Tokens):
    """Learnable sequences: x_t = (a + d·t) mod VOCAB with random a and d in 1..4 (random tokens teach nothing)."""

    def __init__(self, n: int = 256, seq: int = SEQ, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 5, (n, 1), generator=g)
        self.data = (start + step * torch.arange(seq + 1)) % VOCAB


class ReplicaSlices(Sampler):
    """Global batch t is samples [t*G, (t+1)*G); replica r takes its r-th slice of size G/dp."""

    def __init__(self, n: int, global_batch: int, dp: int, rank: int) -> None:
        self.n, self.g, self.dp, self.rank = n, global_batch, dp, rank

    def __iter__(self):
        per = self.g // self.dp
        for t in range(self.n // self.g):
            yield from range(t * self.g + self.rank * per, t * self.g + (self.rank + 1) * per)

    def __len__(self) -> int:
        return (self.n // self.g) * (self.g // self.dp)


class TestData(pl.LightningDataModule):
    def __init__(self, global_batch: int = 8, n: int = 256, variable: bool = False, dataset: type = Tokens,
                 masked: bool = False, ordered: tuple[int, int] | None = None) -> None:
        """``ordered`` (pp, virtual stages): variable steps carry an explicit per-step schedule (``gpipe_reversed``)."""
        super().__init__()
        self.global_batch, self.n, self.variable, self.masked = global_batch, n, variable, masked
        self.ordered = ordered
        self.dataset = MaskedTokens if masked else dataset

    def train_dataloader(self) -> DataLoader:
        kw = self.trainer.strategy.distributed_sampler_kwargs
        if self.variable:
            return DataLoader(VariableBatches(kw["num_replicas"], kw["rank"], masked=self.masked, ordered=self.ordered),
                              batch_size=None)
        sampler = ReplicaSlices(self.n, self.global_batch, kw["num_replicas"], kw["rank"])
        return DataLoader(self.dataset(self.n), batch_size=self.global_batch // kw["num_replicas"], sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = ReplicaSlices(32, self.global_batch, kw["num_replicas"], kw["rank"])
        return DataLoader(Tokens(32, seed=1), batch_size=self.global_batch // kw["num_replicas"], sampler=sampler)


# Steps with a different number of micro-batches and different (batch, sequence) shapes each.
VARIABLE_PLAN = [[(2, 16), (2, 8), (4, 12), (2, 16)], [(4, 8), (4, 8)], [(1, 16), (3, 12), (2, 4), (2, 8), (4, 16), (4, 16)]]


def variable_step(step: int, dp: int, rank: int, masked: bool = False) -> list[dict]:
    """The micro-batches of one replica at one step; micro-batch j of the global step is split over replicas.
    ``masked``: some labels are ignored (``ignore_some``)."""
    g = torch.Generator().manual_seed(100 + step)
    mbs = []
    for b, s in VARIABLE_PLAN[step % len(VARIABLE_PLAN)]:
        x = torch.randint(0, VOCAB, (b * dp, s + 1), generator=g)
        labels = ignore_some(x[:, 1:], g) if masked else x[:, 1:]
        mbs.append({"input_ids": x[rank * b : (rank + 1) * b, :-1], "labels": labels[rank * b : (rank + 1) * b]})
    return mbs


def gpipe_reversed(pp: int, virtual: int, m: int) -> list[list[Action]]:
    """An explicit schedule none of the named ones produces: every forward (stage by stage, micro-batches in order),
    then every backward with the micro-batches in reverse order."""
    orders = []
    for rank in range(pp):
        stages = [rank + k * pp for k in range(virtual)]
        forwards = [Action("F", s, j) for s in stages for j in range(m)]
        orders.append(forwards + [Action("B", s, j) for s in reversed(stages) for j in reversed(range(m))])
    return orders


class VariableBatches(torch.utils.data.IterableDataset):
    def __init__(self, dp: int, rank: int, steps: int = 6, masked: bool = False,
                 ordered: tuple[int, int] | None = None) -> None:
        self.dp, self.rank, self.steps, self.masked, self.ordered = dp, rank, steps, masked, ordered

    def __iter__(self):
        for step in range(self.steps):
            mbs = variable_step(step, self.dp, self.rank, self.masked)
            orders = gpipe_reversed(*self.ordered, len(mbs)) if self.ordered else None
            yield MicroBatches(mbs, orders=orders)


@lru_cache(maxsize=16)
def reference(steps: int, global_batch: int = 8, variable_dp: int = 0, accumulate: int = 1, masked: bool = False) -> tuple:
    """(losses per optimizer step, final named parameters) of plain single-process training. The loss of a batch
    is the mean over its non-ignored labels (the token mean of the global batch, however replicas split it); with
    accumulation each batch is normalised by its own count, then divided by ``accumulate``."""
    module = make_model()
    if DEVICE == "cpu":
        module.configure_model()
    else:
        from lightning_3d.recipes.gpt.model import GPTModel
        from lightning_3d.utils.tensors import materialize_

        torch.backends.cuda.matmul.allow_tf32 = False
        with torch.device("meta"):
            module.model = GPTModel(module.config, module.config.padded_vocab_size(1))
        materialize_(module.model, torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
        module.init_weights()
    model = module.model
    device = next(model.parameters()).device
    hp = module.hparams
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wpe" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "wpe" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.adam_eps)
    floor = hp.min_learning_rate / hp.learning_rate

    def schedule(step: int) -> float:
        if step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.decay_steps - hp.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    data = MaskedTokens() if masked else Tokens()
    losses = []
    for step in range(steps):
        opt.zero_grad()
        step_loss = 0.0
        for micro in range(accumulate):
            t = step * accumulate + micro
            if variable_dp:
                replicas = [variable_step(t, variable_dp, r, masked) for r in range(variable_dp)]
                mbs = [{k: torch.cat([rep[j][k] for rep in replicas]).to(device) for k in ("input_ids", "labels")}
                       for j in range(len(replicas[0]))]
                total = sum((mb["labels"] != -100).sum() for mb in mbs)
                loss = sum(_ce(model(mb["input_ids"]), mb["labels"], "sum") for mb in mbs) / total
            else:
                batch = {k: v.to(device) for k, v in data[t * global_batch : (t + 1) * global_batch].items()}
                loss = _ce(model(batch["input_ids"]), batch["labels"], "mean")
            (loss / accumulate).backward()
            step_loss += loss.item() / accumulate
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        losses.append(step_loss)
    return losses, {name: p.detach().clone().cpu() for name, p in model.named_parameters()}


def _ce(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction, ignore_index=-100)


class LossRecorder(pl.Callback):
    """The loss of every optimizer step (the mean over its accumulated batches), as every rank sees it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self._window = 0.0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._window += float(outputs["loss"])  # Lightning already divided it by accumulate_grad_batches
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(self._window)
            self._window = 0.0


def compare(module: GPT, losses: list[float], ref: tuple) -> dict:
    """Worst relative errors of the step losses and of every parameter this rank holds (full tensors)."""
    ref_losses, ref_params = ref
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    param_err = 0.0
    for name, p in module.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        expected = ref_params.get(name, ref_params["embed.wte.weight"] if name == "head.weight" else None)
        full = full.detach().cpu()[: expected.shape[0]]
        param_err = max(param_err, ((full - expected).norm() / expected.norm().clamp_min(1e-12)).item())
    return {"loss_err": loss_err, "param_err": param_err}


def all_max(value: float) -> float:
    t = torch.tensor(value, dtype=torch.float64, device="cuda" if DEVICE == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def trainer(strategy, steps: int, callbacks=(), accumulate: int = 1, **overrides) -> pl.Trainer:
    os.environ["WORLD_SIZE"] = str(WORLD)
    settings = dict(
        accelerator="gpu" if DEVICE == "cuda" else "cpu", devices=LOCAL_WORLD, num_nodes=WORLD // LOCAL_WORLD,
        strategy=strategy, max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=CLIP, accumulate_grad_batches=accumulate, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=list(callbacks), use_distributed_sampler=False,
    )
    settings.update(overrides)
    return pl.Trainer(**settings)


def write_report(path: Path, report: dict) -> None:
    if dist.get_rank() == 0:
        path.write_text(json.dumps(report, indent=1))


class FullCollections(pl.Callback):
    """The ``global_step`` at every full (generation-2) garbage collection during a fit, and whether automatic
    collection was on at the end of each training batch (read through ``gc.callbacks`` and ``gc.isenabled``)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.enabled_in_batches: list[bool] = []
        self._trainer = None

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2 and self._trainer is not None:
            self.steps.append(self._trainer.global_step)

    def on_fit_start(self, trainer, module) -> None:
        self._trainer = trainer
        gc.callbacks.append(self._seen)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.enabled_in_batches.append(gc.isenabled())

    def on_fit_end(self, trainer, module) -> None:
        self.detach()

    def on_exception(self, trainer, module, exception) -> None:
        self.detach()

    def detach(self) -> None:
        if self._seen in gc.callbacks:
            gc.callbacks.remove(self._seen)
        self._trainer = None
