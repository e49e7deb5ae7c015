"""Loss and optimisation shared by the GPT and T5 recipes (one definition, so both train the same way)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def summed_token_cross_entropy(output: Tensor, labels: Tensor) -> Tensor:
    """Summed token cross-entropy (the pipeline divides by the token count); vocab-parallel when the logits are a
    vocabulary-sharded DTensor, fp32 otherwise."""
    logits = output.flatten(0, 1)
    if not isinstance(logits, DTensor):
        logits = logits.float()
    loss = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def count_target_tokens(labels: Tensor) -> Tensor:
    return (labels != IGNORE_INDEX).sum()


def adamw_warmup_cosine(module: pl.LightningModule, decays: Callable[[str, Tensor], bool]) -> dict[str, Any]:
    """AdamW with weight decay where ``decays(name, param)``; linear warm-up, then cosine decay to
    ``min_learning_rate`` over ``decay_steps`` (default: the trainer's ``max_steps``). Reads the module's hparams."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        (decay if decays(name, p) else no_decay).append(p)
    hp = module.hparams
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.adam_eps, foreach=hp.optimizer_foreach,
    )
    total = hp.decay_steps or (module.trainer.max_steps if module.trainer.max_steps > 0 else 10_000)
    floor = hp.min_learning_rate / hp.learning_rate

    def schedule(step: int) -> float:
        if step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        progress = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
