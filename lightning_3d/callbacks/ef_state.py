"""CompressionStateMonitor: watch (and on demand reset) the error-feedback state of Optimus-CC compression."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_3d.callbacks.plumbing import gather, log_rank_zero, require_compressed_3d
from lightning_3d.strategies.compressed_3d import Compressed3DStrategy


class CompressionStateMonitor(Callback):
    """Owns the error-feedback state of a compressed run: logs its norms and resets it when asked.

    Every ``log_every_n_steps`` optimizer steps rank 0 logs, averaged over the ranks holding each buffer:

    - ``ef/cb/stage{s}/lep_error_norm``: the LEP error kept by sender stage ``s`` (compressed backpropagation);
    - ``ef/cb/stage{s}/q_norm``: its warm-start Q;
    - ``ef/sc/pp{p}/error_norm``, ``p_memory_norm``, ``q_memory_norm``: PowerSGD's error feedback and P/Q memories
      of the data-parallel gradients on pipeline rank ``p`` (selective compression), over all buckets.

    ``reset()`` zeroes the LEP errors and PowerSGD's error feedback and drops the warm-start factors (CB's Q is
    re-drawn from the compression seed, PowerSGD's P/Q from its own generator, identically on every replica, at their
    next use). Call it on every rank at the same point between steps. With ``reset_at_warmup_end`` it runs once, on
    all ranks, before the first step that selective compression compresses (the end of ``sc_warmup``).

    Checkpoints: this callback's ``state_dict`` holds only its counters (resets done, whether the warm-up reset ran).
    The buffers themselves are rank-local and large; the strategy saves and restores them with every checkpoint in
    its sharded checkpoint directory (``rank_state/rank{r}.pt``, see ``Compressed3DStrategy.rank_state_dict``).
    Logging costs one small all-gather on logged steps and nothing on the others.
    """

    def __init__(self, log_every_n_steps: int = 50, reset_at_warmup_end: bool = False) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"CompressionStateMonitor(log_every_n_steps={log_every_n_steps}) must be >= 1.")
        self.log_every_n_steps, self.reset_at_warmup_end = log_every_n_steps, reset_at_warmup_end
        self.resets = 0
        self.warmup_reset_done = False
        self.last_metrics: dict[str, float] = {}
        self._strategy: Compressed3DStrategy | None = None
        self._warmup_step: int | None = None
        self._step = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy = require_compressed_3d(self, trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = self._strategy
        cfg = s.compression
        sc_anywhere = s.compresses_data_parallel_anywhere
        if s.compressed_backprop is None and not sc_anywhere:
            rank_zero_warn("CompressionStateMonitor: compression is off for this run; there is no error-feedback state.")
        self._warmup_step = None
        if self.reset_at_warmup_end:
            if not sc_anywhere:
                rank_zero_warn("CompressionStateMonitor(reset_at_warmup_end=True): selective compression is off in this"
                               " run (no data parallelism, no stage chosen, or a data-parallel link faster than"
                               " sc_max_link_gbps), so its warm-up never ends; no automatic reset.")
            elif s.selective_compression is not None:
                self._warmup_step = s.selective_compression.warmup_steps
            else:  # a stage without SC (e.g. the last) computes the same step as the ranks that have it
                total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
                self._warmup_step = cfg.warmup_steps(int(total))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches != 0:
            return
        self._step = trainer.global_step
        if self._warmup_step is not None and not self.warmup_reset_done and self._step == self._warmup_step:
            self.reset()
            self.warmup_reset_done = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches != 0 or self._step % self.log_every_n_steps != 0:
            return
        merged: dict[str, list[float]] = {}
        for norms in gather(self.norms()):
            for name, value in norms.items():
                merged.setdefault(name, []).append(value)
        self.last_metrics = {name: sum(v) / len(v) for name, v in merged.items()}
        log_rank_zero(trainer, self.last_metrics, self._step)

    def _attached(self) -> Compressed3DStrategy:
        if self._strategy is None:
            raise RuntimeError("CompressionStateMonitor is not attached to a Trainer yet: add it to"
                               " `Trainer(callbacks=[...])` and call this during or after `trainer.fit`.")
        return self._strategy

    def norms(self) -> dict[str, float]:
        """This rank's norms (see the class docstring for the names); one host synchronisation."""
        s = self._attached()
        names, values = [], []
        codec = s.compressed_backprop
        if codec is not None:
            for (stage, index), error in sorted(codec.errors.items()):  # keyed by (stage, boundary tensor)
                names.append(f"ef/cb/stage{stage}{f'/t{index}' if index else ''}/lep_error_norm")
                values.append(error.float().norm())
            for (stage, index), q in sorted(codec.q_memory.items()):
                names.append(f"ef/cb/stage{stage}{f'/t{index}' if index else ''}/q_norm")
                values.append(q.float().norm())
        sc = s.selective_compression
        if sc is not None:
            state = sc.state
            for what, table in (("error_norm", state.error_dict), ("p_memory_norm", state.p_memory_dict),
                                ("q_memory_norm", state.q_memory_dict)):
                if table:
                    names.append(f"ef/sc/pp{s.pp_rank}/{what}")
                    values.append(torch.stack([t.float().norm() for t in table.values()]).norm())
        if not values:
            return {}
        return dict(zip(names, torch.stack([v.to(values[0].device) for v in values]).tolist(), strict=True))

    def reset(self) -> None:
        """Zero LEP errors and PowerSGD error feedback, drop CB's and PowerSGD's warm-start factors (this rank)."""
        s = self._attached()
        codec = s.compressed_backprop
        if codec is not None:
            for error in codec.errors.values():
                error.zero_()
            codec.q_memory.clear()
        sc = s.selective_compression
        if sc is not None:
            for error in sc.state.error_dict.values():
                error.zero_()
            sc.state.p_memory_dict.clear()
            sc.state.q_memory_dict.clear()
        self.resets += 1

    def state_dict(self) -> dict[str, Any]:
        return {"resets": self.resets, "warmup_reset_done": self.warmup_reset_done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.resets = int(state_dict.get("resets", 0))
        self.warmup_reset_done = bool(state_dict.get("warmup_reset_done", False))
