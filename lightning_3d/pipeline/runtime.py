"""Executes a pipeline schedule on this rank: forwards, backwards and the loss normalisation of a step.

Each step may bring any number of micro-batches of any shapes. The runtime walks this rank's rounds
(``rounds.lockstep_rounds``: its actions on a clock shared by the pipeline) and hands what each action sends
and receives to a ``StepExchange``, which posts one batch of point-to-point operations per round (see
``exchange`` and ``p2p``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_3d.pipeline.codec import GradientCodec, IdentityCodec
from lightning_3d.pipeline.exchange import StepExchange
from lightning_3d.pipeline.graphs import StageGraphs
from lightning_3d.pipeline.microbatch import signature
from lightning_3d.pipeline.p2p import PipelineChannels
from lightning_3d.pipeline.rounds import lockstep_rounds
from lightning_3d.pipeline.schedules import Action, build_forward_only, build_schedule, check_schedule, deferred_weights, mark_epilogue
from lightning_3d.pipeline.weight_grad import deferring, run_deferred
from lightning_3d.utils.comm_stats import CommunicationStats

ContextFactory = Callable[[], contextlib.AbstractContextManager]


class RuntimeObserver(Protocol):
    """What diagnostics and timelines may watch; the runtime calls it only when one is attached."""

    def on_step(self, phase: str, train: bool, num_microbatches: int) -> None:
        """``phase`` is "begin" or "end" of one pipeline step."""

    def span(self, name: str, stage: int, microbatch: int) -> contextlib.AbstractContextManager:
        """Wraps "forward", "backward" (B, or the whole backward), "weight" (W: a split backward's weight gradients)
        and "wait" (for a received tensor) of one (stage, micro-batch)."""

    def on_received(self, stage: int, microbatch: int, tensors: list[Tensor]) -> None:
        """The activations ``stage`` received for ``microbatch`` (the tensors whose gradient it sends back)."""


class PipelineRuntime:
    def __init__(
        self,
        stages: dict[int, nn.Module],
        num_stages: int,
        pp_rank: int,
        pp_size: int,
        schedule: str,
        channels: PipelineChannels,
        device: torch.device,
        loss_fn: Callable[[Any, Any], Tensor],
        loss_terms_fn: Callable[[Any], Tensor | int],
        forward_context: ContextFactory = contextlib.nullcontext,
        loss_context: ContextFactory = contextlib.nullcontext,
        before_last_backward: Callable[[int], None] | None = None,
        stats: CommunicationStats | None = None,
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``dp_group``: the data-parallel replicas of this rank (None: one replica). The loss is normalised by the
        loss terms of the whole step summed over them (see ``_run``), so that gradients averaged over replicas equal
        one process's gradient of the global token mean."""
        self.stages = stages
        self.num_stages = num_stages
        self.pp_rank = pp_rank
        self.pp = pp_size
        self.virtual_stages = num_stages // pp_size
        self.schedule = schedule
        self.channels = channels
        self.device = device
        self.loss_fn = loss_fn
        self.loss_terms_fn = loss_terms_fn
        self.forward_context = forward_context
        self.loss_context = loss_context
        self.before_last_backward = before_last_backward
        self.stats = stats
        self.dp_group = dp_group
        self.replicas = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.codec: GradientCodec = IdentityCodec()
        self.observer: RuntimeObserver | None = None
        # CUDA graphs of the stages' training forwards and backwards (the strategy's cuda_graphs=True), else None.
        self.graphs: StageGraphs | None = None
        # The transport of this rank (None in unit tests that only exercise the schedule bookkeeping).
        self.exchange = StepExchange(channels, device, num_stages, pp_size) if channels is not None else None
        self._checked: set[tuple] = set()
        self.last_orders: tuple[tuple[Action, ...], ...] = ()  # the schedule of the last step, every rank's list

    # ----- public entry points ---------------------------------------------------------------------------
    def train_step(
        self, microbatches: Sequence[Any], loss_scale: float = 1.0, orders: Sequence[Sequence[Action]] | None = None
    ) -> Tensor | None:
        """Forward and backward of all micro-batches; on the last stage returns this replica's share of the step's
        mean loss (its loss sum over the terms of all replicas; the shares add up to the mean), else None.

        ``orders``: this step's schedule, one action list per pipeline rank (default: the micro-batches'
        ``MicroBatches.orders`` if set, else the named schedule built for their count). It is checked by the
        schedule simulator before anything is sent."""
        order = self._orders(len(microbatches), train=True, given=self._given(microbatches, orders))
        return self._run(order, microbatches, train=True, loss_scale=loss_scale)

    @torch.no_grad()
    def eval_step(self, microbatches: Sequence[Any], orders: Sequence[Sequence[Action]] | None = None) -> Tensor | None:
        """Forward only; ``orders`` as in ``train_step``. A training schedule runs its forward actions in their given
        order (the dynamic micro-batcher plans validation batches as it plans training ones); dropping the backwards
        removes only dependencies, so the forward projection of a valid schedule is a valid forward-only one."""
        order = self._orders(len(microbatches), train=False, given=self._given(microbatches, orders))
        return self._run(order, microbatches, train=False, loss_scale=1.0)

    # ----- schedule bookkeeping ----------------------------------------------------------------------------
    @staticmethod
    def _given(microbatches: Sequence[Any], orders: Sequence[Sequence[Action]] | None):
        return orders if orders is not None else getattr(microbatches, "orders", None)

    def _orders(self, m: int, train: bool, given: Sequence[Sequence[Action]] | None = None) -> list[tuple[Action, ...]]:
        if given is not None:
            if len(given) != self.pp:
                raise ValueError(
                    f"An explicit schedule needs one action list per pipeline rank: got {len(given)} for"
                    f" pipeline_parallel_size={self.pp}."
                )
            orders = [mark_epilogue(order if train else [a for a in order if a.kind == "F"]) for order in given]
            key = ("train" if train else "eval", m, tuple(orders))
        else:
            if train:
                orders = [build_schedule(self.schedule, self.pp, self.virtual_stages, m, r) for r in range(self.pp)]
            else:
                orders = [build_forward_only(self.pp, self.virtual_stages, m, r) for r in range(self.pp)]
            key = ("train" if train else "eval", m)
        if key not in self._checked:
            # Every rank runs the same check on the same lists, so a bad schedule fails everywhere before any send.
            check_schedule(orders, self.num_stages, m, train=train)
            if len(self._checked) >= 256:  # explicit per-step orders: bounded memory of checked schedules
                self._checked.clear()
            self._checked.add(key)
        self.last_orders = tuple(orders)
        return orders

    def _run(self, orders: list[tuple[Action, ...]], mbs: Sequence[Any], train: bool, loss_scale: float) -> Tensor | None:
        mine = orders[self.pp_rank]
        self.exchange.begin(orders, [signature(mb) for mb in mbs], self.codec)
        self._saved: dict[tuple[int, int], tuple[list[Tensor], Any]] = {}
        # A B with a later W computes only what the pipeline waits for; its weight-gradient work waits for the W.
        self._split = deferred_weights(mine)
        self._weight_work: dict[tuple[int, int], list[Callable[[], None]]] = {}
        # The stage's gradients are final during its last B or W (the hook of the data-parallel buckets).
        last_backward = {a.stage: i for i, a in enumerate(mine) if a.kind != "F"}
        self._terms: Tensor | None = None
        self._terms_work: dist.Work | None = None
        self._loss_scale = loss_scale
        self._loss_factor: Tensor | None = None
        if self.num_stages - 1 in self.stages:
            # The mean is over the loss terms of the whole step on all replicas (e.g. the non-ignored target tokens),
            # not per replica: replicas may hold different numbers of terms (padding, ignore_index, variable
            # micro-batches), and averaging per-replica means would weigh their tokens unequally. The count comes
            # from the data alone, so its all-reduce starts now and overlaps the forwards; it is waited for at the
            # first backward. Every rank of a data-parallel group holds the same stages, so either all of them join
            # this all-reduce or none do (only last-stage ranks need the count).
            self._terms = sum(torch.as_tensor(self.loss_terms_fn(mb), device=self.device) for mb in mbs)  # a new tensor
            if self.replicas > 1:
                self._terms_work = dist.all_reduce(self._terms, group=self.dp_group, async_op=True)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        if self.graphs is not None:
            self.graphs.begin_step()
        if self.observer is not None:
            self.observer.on_step("begin", train, len(mbs))
        index = 0
        for rnd in lockstep_rounds(orders, self.num_stages)[self.pp_rank]:
            action = rnd.action
            if action is not None and action.kind == "F":
                loss = self._forward(action, mbs[action.microbatch], train)
                if loss is not None:
                    loss_sum += loss.detach().float()
            elif action is not None:
                if self.before_last_backward is not None and last_backward[action.stage] == index:
                    self.before_last_backward(action.stage)
                if action.kind == "W":
                    self._weights(action)
                else:
                    self._backward(action)
            index += action is not None
            self.exchange.end_round(rnd)
        self.exchange.finish()
        if self.observer is not None:
            self.observer.on_step("end", train, len(mbs))
        return loss_sum / self._global_terms() if self._terms is not None else None

    # ----- compute ---------------------------------------------------------------------------------------
    def _forward(self, action: Action, mb: Any, train: bool) -> Tensor | None:
        stage, m = action.stage, action.microbatch
        inputs: list[Tensor] = []
        if stage > 0:
            inputs = self.exchange.take("F", stage - 1, m, self._span)
            if train:
                inputs = [t.requires_grad_(True) if t.is_floating_point() else t for t in inputs]
            if self.observer is not None:
                self.observer.on_received(stage, m, inputs)
        with self.forward_context(), self._span("forward", stage, m):
            if train and self.graphs is not None:
                output = self.graphs.forward(stage, self.stages[stage], inputs, mb)
            else:
                output = self.stages[stage](*inputs, microbatch=mb)
        if stage == self.num_stages - 1:
            with self.loss_context(), self.forward_context():
                loss = scalar_loss(self.loss_fn(output, mb))
            if train:  # scaled at the backward, where the global term count is first needed
                self._saved[(stage, m)] = (inputs, loss)
            return loss
        outputs = list(output) if isinstance(output, (tuple, list)) else [output]
        self.exchange.send_activations(stage, m, outputs)
        if train:  # the counters describe training steps
            for tensor in outputs:
                self._count("forward_activations", tensor, [tensor])
            self._saved[(stage, m)] = (inputs, outputs)
        return None

    def _backward(self, action: Action) -> None:
        stage, m = action.stage, action.microbatch
        inputs, outputs = self._saved.pop((stage, m))
        split = contextlib.nullcontext()
        if (stage, m) in self._split:  # weight gradients deferred to this (stage, m)'s W (pipeline/weight_grad.py)
            split = deferring(self._weight_work.setdefault((stage, m), []))
        if stage == self.num_stages - 1:
            with self.loss_context(), self._span("backward", stage, m), split:
                torch.autograd.backward(outputs * self._factor())
        else:
            grads = self.exchange.take("B", stage + 1, m, self._span)  # one per floating-point output
            floating = [o for o in outputs if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floating, grads, strict=True) if o.requires_grad]
            if pairs:
                with self._span("backward", stage, m), split:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if stage > 0:
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point()]
            for grad, parts in zip(grads, self.exchange.send_gradients(stage, m, grads)):
                self._count("backward_activation_grads", grad, parts)

    def _weights(self, action: Action) -> None:
        """W: the weight gradients that ``action``'s B deferred, accumulated as autograd would have."""
        work = self._weight_work.pop((action.stage, action.microbatch), [])
        with self._span("weight", action.stage, action.microbatch):
            run_deferred(work)

    def _global_terms(self) -> Tensor:
        """The loss terms of this step summed over the data-parallel replicas (waits for their all-reduce)."""
        if self._terms_work is not None:
            self._terms_work.wait()
            self._terms_work = None
        return self._terms

    def _factor(self) -> Tensor:
        """What the last stage multiplies its loss sums by before their backward: ``loss_scale · dp / global
        terms``. The data-parallel sync averages gradients over the dp replicas, so the factor dp turns that average
        into the sum over replicas of their gradients of (loss sum / global terms): one process's gradient of the
        global mean. ``loss_scale`` (1 / accumulate_grad_batches) leaves each accumulated batch normalised by its
        own global term count."""
        if self._loss_factor is None:
            self._loss_factor = self._loss_scale * self.replicas / self._global_terms()
        return self._loss_factor

    def _span(self, name: str, stage: int, microbatch: int) -> contextlib.AbstractContextManager:
        return self.observer.span(name, stage, microbatch) if self.observer is not None else contextlib.nullcontext()

    def _count(self, kind: str, original: Tensor, sent: list[Tensor]) -> None:
        if self.stats is not None:
            self.stats.add(kind, original.numel() * original.element_size(), sum(t.numel() * t.element_size() for t in sent))


def scalar_loss(loss: Any) -> Tensor:
    """``pipeline_loss``'s value as a plain scalar tensor. Under tp > 1 the loss of tensor-parallel logits (torch's
    ``loss_parallel`` cross-entropy) is a DTensor: its full value is taken (differentiably; a replicated one is just
    its local tensor). Anything but one number is an error saying what to return."""
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, Tensor) else type(loss).__name__
        raise TypeError(f"pipeline_loss returned {what}: return the SUM of the micro-batch's loss terms as one floating-point"
                        " number, a 0-dim tensor (e.g. F.cross_entropy(..., reduction='sum')); a DTensor is accepted.")
    return loss.reshape(())
