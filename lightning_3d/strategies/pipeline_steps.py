"""How Lightning's step hooks run through the pipeline: the whole forward and backward of a batch happen in
``training_step`` (the schedule interleaves them per micro-batch), so ``backward`` only hands the gradients back.

Part of ``Compressed3DStrategy`` (a mixin, for the file size); modules without the pipeline protocol fall through to
Lightning's own hooks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_3d.pipeline.microbatch import MicroBatches, split_batch
from lightning_3d.strategies.grad_sync import clip_grad_norm_, local, sync_tied_gradients


class PipelineStepsMixin:
    """Training, evaluation and clipping hooks of ``Compressed3DStrategy`` (see the module docstring)."""

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        self._sync_blocked = True
        try:
            yield
        finally:
            self._sync_blocked = False

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Lightning's transfer rebuilds a ``MicroBatches`` list from its items; keep its explicit ``orders``."""
        moved = super().batch_to_device(batch, device, dataloader_idx)
        if isinstance(batch, MicroBatches) and isinstance(moved, MicroBatches):
            moved.orders = batch.orders
        return moved

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is None:
            self._log_communication()
            return super().training_step(*args, **kwargs)
        batch, batch_idx = args[0], args[1]
        module = self.lightning_module
        self._log_communication()
        if batch_idx % self.lightning_module.trainer.accumulate_grad_batches == 0:
            module.zero_grad(set_to_none=True)  # what Lightning's zero_grad would do, before our backward runs
        microbatches = split_batch(batch, self.num_microbatches)
        self._check_batch(microbatches)
        self._grad_sync.begin(sync=not self._sync_blocked)
        loss = self._runtime.train_step(microbatches, loss_scale=1.0 / module.trainer.accumulate_grad_batches)
        self._grad_sync.finish()
        if not self._sync_blocked:
            if self._fused_tied:
                sync_tied_gradients(self._tied, self.fused_tied_group, divide_by=self.dims.dp, stats=self.comm_stats)
            else:
                sync_tied_gradients(self._tied, self.tied_group, stats=self.comm_stats)
        # Lightning zeroes gradients between training_step and backward; keep ours out of its reach.
        self._stashed_grads = [(p, p.grad) for p in module.parameters()]
        for p in module.parameters():
            p.grad = None
        return self._report_loss(loss, "train")

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.on_nonfinite != "ignore":
            closure = functools.partial(self._guarded_closure, optimizer, closure)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.comm_stats.end_step()  # "last_step" = everything one optimizer step (all its batches) sent
        return output

    def _guarded_closure(self, optimizer: Optimizer, closure: Any) -> Any:
        """Run Lightning's closure (forward, backward, gradient sync), then decide on every rank alike whether the
        step is finite; a skipped step clears the gradients, so the optimizer leaves every parameter and its state
        untouched (torch optimizers pass over parameters without a gradient) and clipping sees nothing to clip.

        The optimizer's update runs inside ``optimizer.step(closure)``, after this returns: this is the last point
        before it. Lightning still counts the step (``global_step``, LR schedulers stepping by step), as for any
        optimizer step."""
        loss = closure()
        grads = [local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # The max-abs norm is finite exactly when every element is (and cannot overflow the way a sum of squares can).
        bad = torch.zeros((), device=self.root_device)
        if grads:
            bad += (~torch.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=float("inf")))).float()
        if isinstance(loss, Tensor):
            bad += (~torch.isfinite(loss.detach().float())).float().to(bad.device)
        dist.all_reduce(bad)  # one verdict for the whole world: every stage, shard and replica skips together
        step = self.lightning_module.trainer.global_step
        if not bad.item():
            self._nonfinite_streak = 0
            return loss
        self._nonfinite_streak += 1
        what = "the loss or the gradients of optimizer step"
        if self.on_nonfinite == "raise":
            raise FloatingPointError(
                f"Compressed3DStrategy: {what} {step} hold NaN or inf (on_nonfinite='raise'). Lower the learning rate,"
                " check the data of this step, or pass on_nonfinite='skip' to skip such steps."
            )
        if self._nonfinite_streak > self.max_consecutive_nonfinite:
            raise FloatingPointError(
                f"Compressed3DStrategy: {what} {step} hold NaN or inf, {self._nonfinite_streak} such steps in a row"
                f" (max_consecutive_nonfinite={self.max_consecutive_nonfinite}): training diverged. Lower the learning"
                " rate or resume from an earlier checkpoint."
            )
        rank_zero_warn(
            f"Compressed3DStrategy: {what} {step} hold NaN or inf; the step is skipped on every rank (parameters,"
            f" optimizer and compression state unchanged; {self._nonfinite_streak} in a row, at most"
            f" {self.max_consecutive_nonfinite})."
        )
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        return loss

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._runtime is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self._stashed_grads or []:  # the pipeline already ran the backward in training_step
            p.grad = grad
        self._stashed_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    def pre_backward(self, closure_loss: Tensor) -> None:
        self._grad_sync.begin(sync=not self._sync_blocked)
        self._grad_sync.arm(None)

    def post_backward(self, closure_loss: Tensor) -> None:
        self._grad_sync.finish()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("val", args, kwargs) if self._runtime else super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test", args, kwargs) if self._runtime else super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is not None and self.dims.pp > 1:
            raise RuntimeError(
                "trainer.predict is not available with pipeline_parallel_size > 1 (outputs live on the last stage"
                " only); predict with pipeline_parallel_size=1."
            )
        return super().predict_step(*args, **kwargs)

    def _eval_step(self, stage: str, args: tuple, kwargs: dict) -> Tensor:
        microbatches = split_batch(args[0], self.num_microbatches, uneven=True)
        self._check_batch(microbatches)
        loss = self._runtime.eval_step(microbatches)
        return self._report_loss(loss, stage)

    def _check_batch(self, microbatches: list[Any]) -> None:
        """The module's ``check_pipeline_batch`` (optional) on every micro-batch, on every rank, before any collective.
        A batch that does not fit the model (an id outside the vocabulary, a sequence longer than its positions)
        would otherwise fail on the one stage that reads it, and the other ranks would only see a lost peer; every
        rank of a pipeline holds the same batch, so all of them raise the same message here."""
        check = getattr(self.lightning_module, "check_pipeline_batch", None)
        if callable(check):
            for microbatch in microbatches:
                check(microbatch)

    def _report_loss(self, loss: Tensor | None, stage: str) -> Tensor:
        """Sum the last stage's per-replica shares of the step's mean loss (each replica's loss sum over the loss
        terms of all replicas, see ``PipelineRuntime.train_step``) and give the global mean to every rank, then log it."""
        contributes = loss is not None and self.tp_rank == 0
        value = loss.detach().float() if contributes else torch.zeros((), device=self.root_device)
        dist.all_reduce(value)
        module = self.lightning_module
        if callable(getattr(module, "log_pipeline_loss", None)):
            module.log_pipeline_loss(value, stage)
        else:
            module.log(f"{stage}_loss", value, prog_bar=True, sync_dist=False)
        return value

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        skip = {id(p) for p in self._tied} if self.pp_rank == self.dims.pp - 1 else set()
        clip_grad_norm_(params, clip_val, self.model_parallel_group, self.tp_rank, self.root_device, skip)
