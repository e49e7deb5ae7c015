"""After ``fit`` nothing of a model trained by Compressed3DStrategy outlives the user's last reference: runs in one
process (benchmark variants, sweeps, notebooks) must not pile up parameters, gradients and compression state."""

from __future__ import annotations

import gc
import weakref

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_3d import Compressed3DStrategy
from lightning_3d.distributed import wgrad_fusion
from lightning_3d.recipes import GPT
from lightning_3d.recipes.data import SyntheticLMDataModule


def hooked(module: torch.nn.Module) -> tuple[int, int]:
    """Parameters the gradient synchronizer follows: by a post-accumulate-grad hook, and (weights under gradient-
    accumulation fusion) by a registered gradient slot."""
    slotted = {id(weight) for weight, _ in wgrad_fusion._SLOTS.values()}
    params = list(module.parameters())
    return sum(bool(getattr(p, "_post_accumulate_grad_hooks", None)) for p in params), sum(id(p) in slotted for p in params)


def fit_twice(pipeline: bool) -> tuple[list[weakref.ref], list[tuple[int, int]], int]:
    """Fit, then fit on with the same trainer: weak references to what was trained, the hooked and slotted parameter
    counts at every optimizer step and the count of linear weights. A function of its own: ``save_hyperparameters`` snapshots its caller's
    locals (``f_locals``), which would keep the model alive from a frame that is still running."""
    seen: list[int] = []

    class CountHooks(pl.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            seen.append(hooked(module))

    torch.manual_seed(0)
    model = GPT("tiny", seq_length=32, vocab_size=512) if pipeline else BoringModel()
    data = SyntheticLMDataModule(vocab_size=512, seq_length=32, batch_size=4, num_samples=32) if pipeline else None
    strategy = Compressed3DStrategy(num_microbatches=2 if pipeline else 1, gradient_accumulation_fusion=True)  # slots too
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[CountHooks()])
    trainer.fit(model, datamodule=data)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 4
    refs = [weakref.ref(obj) for obj in (model, strategy, trainer, next(model.parameters()))]
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    return refs, seen, linears


@pytest.mark.parametrize("pipeline", [True, False], ids=["protocol_module", "plain_module"])
def test_fit_releases_the_model_and_a_second_fit_gets_its_hooks_back(pipeline: bool) -> None:
    refs, seen, linears = fit_twice(pipeline)
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    # The second fit's setup registered the fused weights' slots again (one process: no data-parallel replica, so no
    # hooks at all: GradientSynchronizer hooks only where there is work, see test_grad_sync_hooks_only_where_work).
    slotted = seen[0][1]
    assert seen == [(0, slotted)] * 4 and (0 < slotted <= linears if pipeline else slotted == 0)
