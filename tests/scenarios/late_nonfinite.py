"""A NaN written into a gradient in ``on_before_optimizer_step`` (after the backward, the gradient sync and SC; where
users clip, scale or edit gradients), on one data-parallel replica only, in one process group of two ranks:

- with SC compressing (dp 2): the step is skipped on every rank with the usual warning, parameters, optimizer state
  and SC's state (step count, error feedback, P and Q) after it equal those before it, and training goes on finite;
- with fused AdamW (the lazy verdict's optimizer): the same, the hook's NaN reaching the optimizer's ``found_inf``;
- ``on_nonfinite="raise"``: raises on every rank, naming the step.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import torch

from lightning_3d import Compressed3DStrategy
from tests.scenarios.common import LossRecorder, TestData, parse_args, trainer, write_report
from tests.scenarios.robustness import Snapshot, all_true, expect, fused_model, model

STEP = 2  # the poisoned optimizer step


class NaNInHook(pl.Callback):
    """Writes NaN into one gradient element on data-parallel rank 1 at ``step``, in on_before_optimizer_step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if trainer.global_step == self.step and trainer.strategy.dp_rank == 1:
            grad = next(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
            grad.view(-1)[0] = float("nan")


class SCState(pl.Callback):
    """SC's state (step count, error feedback, P, Q) just before step K and just after it."""

    def __init__(self, step: int) -> None:
        self.step, self.before, self.after = step, None, None

    @staticmethod
    def state(trainer):
        s = trainer.strategy.selective_compression.state
        return s.iter, [{k: v.clone() for k, v in d.items()} for d in (s.error_dict, s.p_memory_dict, s.q_memory_dict)]

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.before = self.state(trainer)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step + 1:
            self.after = self.state(trainer)

    def unchanged(self) -> bool:
        (i0, d0), (i1, d1) = self.before, self.after
        return i0 == i1 and all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                                for a, b in zip(d0, d1, strict=True)) and bool(d0[0])


def run(strategy: Compressed3DStrategy, module, sc: bool, steps: int = 5) -> dict:
    losses, snap = LossRecorder(), Snapshot(STEP)
    sc_state = SCState(STEP) if sc else None
    callbacks = [losses, snap, NaNInHook(STEP)] + ([sc_state] if sc else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy, steps, callbacks).fit(module, datamodule=TestData(8))
    return {
        "losses": losses.losses,
        "finite_after": all(math.isfinite(x) for x in losses.losses),
        "unchanged": all_true(snap.unchanged()),
        "sc_unchanged": all_true(sc_state.unchanged()) if sc else None,
        "params_finite": all_true(all(bool(torch.isfinite(p.detach()).all()) for p in module.parameters()
                                      if not hasattr(p, "to_local"))),
        "warnings": [str(c.message) for c in caught if "the step is skipped on every rank" in str(c.message)],
    }


def main() -> None:
    args = parse_args()
    w = args.world
    sc = dict(data_parallel_size=w, compressed_stages=[0], sc_rank=2, sc_warmup=1)
    report = {
        "sc": run(Compressed3DStrategy(**sc), model(), sc=True),
        "lazy": run(Compressed3DStrategy(data_parallel_size=w, compression=False), fused_model(), sc=False),
        "raise": expect("raise", f"optimizer step {STEP} hold NaN or inf (on_nonfinite='raise')",
                        lambda: trainer(Compressed3DStrategy(**sc, on_nonfinite="raise"), 4, [NaNInHook(STEP)]).fit(
                            model(), datamodule=TestData(8))),
    }
    write_report(args.report, report)


if __name__ == "__main__":
    main()
