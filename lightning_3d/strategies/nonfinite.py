"""The non-finite guard of ``Compressed3DStrategy``: whether an optimizer step's loss or gradients hold NaN or inf,
decided on every rank alike, and what follows (skip, warn, raise; ``RuntimeConfig.on_nonfinite``).

It judges the gradients the update reads: after Lightning's closure (forward, backward, gradient sync), its
``on_before_optimizer_step`` hooks and clipping (``compat.after_gradient_hooks`` calls ``judge_pending``). The
verdict is synchronous, or lazy where the optimizer's own kernel can skip on ``found_inf`` (``verdict_can_wait``):
then the host reads it a step later. The ``PipelineEngine`` owns one and calls it from its step hooks; docs/speed.md
("Non-finite steps") says what each path costs.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_3d.distributed.grad_sync import local
from lightning_3d.strategies.compression_state import CompressionState
from lightning_3d.utils.compat import clear_found_inf, set_found_inf, skips_on_found_inf


class NonFiniteGuard:
    """One step's verdict at a time. ``lazy_verdict=False`` forces the synchronous verdict everywhere (the tests
    compare the two paths); ``device`` is the rank's (set when the engine is bound to a module)."""

    def __init__(self, on_nonfinite: str, max_consecutive: int, compression: CompressionState | None) -> None:
        self.on_nonfinite, self.max_consecutive, self.compression = on_nonfinite, max_consecutive, compression
        self.device: torch.device | None = None
        self.lazy_verdict = True
        self._streak = 0
        # The lazy verdict: the last step's, not read on the host yet, and the optimizer that holds it as
        # ``found_inf`` until its step is done.
        self._pending: PendingVerdict | None = None
        self._found_inf_on: Optimizer | None = None
        self._to_judge: tuple | None = None  # this step's loss etc., judged once Lightning's gradient hooks ran

    @property
    def active(self) -> bool:
        return self.on_nonfinite != "ignore"

    def before_closure(self) -> None:
        if self.active and self.compression is not None:
            self.compression.save_sc_state()  # only where a hook may edit gradients after SC ran (compression_state)

    def after_closure(self, loss: Any, trainer: pl.Trainer, scaled: bool) -> None:
        self._to_judge = (loss, trainer, scaled) if self.active else None

    def judge_pending(self, optimizer: Optimizer) -> None:
        """Lightning's hooks and clipping are done: judge the gradients the update will read (``guarded_closure``)."""
        pending, self._to_judge = self._to_judge, None
        if pending is not None:
            self.guarded_closure(optimizer, *pending)

    def after_step(self) -> None:
        """The lazy verdict's ``found_inf`` goes: it was this step's."""
        if self._found_inf_on is not None:
            clear_found_inf(self._found_inf_on)
            self._found_inf_on = None

    def verdict_can_wait(self, optimizer: Optimizer, scaled: bool) -> bool:
        """Whether this step's non-finite verdict can skip the step on the device and reach the host a step later
        (``guarded_closure``): where the optimizer's own step skips exactly on ``found_inf`` (torch's fused Adam,
        AdamW, momentum-free SGD: ``compat.skips_on_found_inf``) and no GradScaler owns that attribute (``scaled``,
        precision "16-mixed"). The sharded optimizer and tensor parallelism's local pieces qualify too: the same
        torch optimizer object steps their pieces (its param groups rewritten), so its kernel skips them alike, and
        what follows the step (the masters copied back and all-gathered, the gradients released) carries the
        unchanged values (the robustness scenario compares both paths there)."""
        opt = getattr(optimizer, "_optimizer", optimizer)  # SC saved for a hook: restored now, or it would be too late
        return self.lazy_verdict and not scaled and skips_on_found_inf(opt) and not (
            self.compression is not None and self.compression.sc_state_saved)

    def guarded_closure(self, optimizer: Optimizer, loss: Any, trainer: pl.Trainer, scaled: bool = False) -> Any:
        """After Lightning's closure (forward, backward, gradient sync) and its ``on_before_optimizer_step`` hooks and
        clipping (where users edit gradients, and a NaN can appear), decide on every rank alike whether the step is
        finite (one all-reduced flag for the world).

        Synchronous verdict (the general case): the host reads the flag now (it waits for the whole backward); a
        skipped step clears the gradients, so the optimizer leaves every parameter and its state untouched (torch
        optimizers pass over parameters without a gradient) and clipping sees nothing to clip.

        Lazy verdict (``verdict_can_wait``): the flag becomes the optimizer's ``found_inf`` for this step, so a bad
        step is skipped on the device by the optimizer's own kernel (parameters and state as if it had not stepped;
        clipping's NaN coefficient touches only gradients that are dropped). The host does not wait: the flag is
        copied to host memory behind the step's work and read in the next step's ``guarded_closure`` (after its
        forward and backward are queued, before its update), at the end of fit (``flush_verdict``), or before a
        checkpoint is written. The warning, the streak limit and ``on_nonfinite="raise"`` act then, naming the bad
        step; "raise" thus raises one step later, from the next step's closure, with the parameters and optimizer
        state still those from before the bad step (it was skipped, and the next update has not run).

        The optimizer's update runs inside ``optimizer.step(closure)``, after this returns: this is the last point
        before it. Lightning still counts the step (``global_step``, LR schedulers stepping by step), as for any
        optimizer step. A skipped step also restores SC's state where a hook may have edited gradients after SC
        compressed them (``CompressionState.save_sc_state``)."""
        grads = [local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # The max-abs norm is finite exactly when every element is (and cannot overflow the way a sum of squares can).
        bad = torch.zeros((), device=self.device)
        if grads:
            bad += (~torch.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=float("inf")))).float()
        if isinstance(loss, Tensor):
            bad += (~torch.isfinite(loss.detach().float())).float().to(bad.device)
        dist.all_reduce(bad)  # one verdict for the whole world: every stage, shard and replica skips together
        step = trainer.global_step
        self.flush_verdict()  # the last step's verdict, before this step's update (its work is queued by now)
        if self.verdict_can_wait(optimizer, scaled):
            # Exactly 1.0 where bad: torch's fused kernels skip where found_inf == 1 and subtract it from step counts.
            flag = (bad > 0).float()
            opt = getattr(optimizer, "_optimizer", optimizer)
            set_found_inf(opt, flag)
            self._found_inf_on = opt
            self._pending = PendingVerdict(flag, step)
            return loss
        if self.judge(bool(bad.item()), step):
            if self.compression is not None:
                self.compression.restore_sc_state()
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        return loss

    def flush_verdict(self) -> None:
        """Act on the pending lazy verdict, if any (warn, count the streak, raise). Every rank holds the same
        verdict, so every rank raises alike."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.judge(pending.read(), pending.step)

    def drop_verdict(self) -> None:
        """Forget a pending verdict and ``found_inf`` without acting (teardown: after an error, or once fit's end
        has flushed it)."""
        self._pending = self._to_judge = None
        if self._found_inf_on is not None:
            clear_found_inf(self._found_inf_on)
            self._found_inf_on = None

    def judge(self, bad: bool, step: int) -> bool:
        """The policy on optimizer step ``step``'s verdict: the streak, the warning, ``raise``. True: it was bad
        (and skipped)."""
        if not bad:
            self._streak = 0
            return False
        self._streak += 1
        what = "the loss or the gradients of optimizer step"
        if self.on_nonfinite == "raise":
            raise FloatingPointError(
                f"Compressed3DStrategy: {what} {step} hold NaN or inf (on_nonfinite='raise'). Lower the learning rate,"
                " check the data of this step, or pass on_nonfinite='skip' to skip such steps."
            )
        if self._streak > self.max_consecutive:
            raise FloatingPointError(
                f"Compressed3DStrategy: {what} {step} hold NaN or inf, {self._streak} such steps in a row"
                f" (max_consecutive_nonfinite={self.max_consecutive}): training diverged. Lower the"
                " learning rate or resume from an earlier checkpoint."
            )
        rank_zero_warn(
            f"Compressed3DStrategy: {what} {step} hold NaN or inf; the step is skipped on every rank (parameters,"
            f" optimizer and compression state unchanged; {self._streak} in a row, at most"
            f" {self.max_consecutive})."
        )
        return True


class PendingVerdict:
    """A step's all-reduced non-finite flag on its way to the host. On CUDA it is copied into pinned host memory
    behind the step's work, with an event recorded after the copy: reading it a step later waits for nothing the
    host still needs (the event is done unless the device is a whole step behind). Elsewhere the flag is kept as it
    is (on the CPU it is computed already)."""

    def __init__(self, flag: Tensor, step: int) -> None:
        self.step = step
        self.event = None
        if flag.device.type == "cuda":
            self.flag = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self.flag.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.flag = flag

    def read(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.flag.item())
