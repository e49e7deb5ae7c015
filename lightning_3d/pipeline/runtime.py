"""Executes a pipeline schedule on this rank: forwards, backwards and the sends and receives between them.

Each step may bring any number of micro-batches of any shapes. Receives run one message ahead on each
channel (so transfers overlap compute) whenever the message's shape is already known; a shape seen for
the first time is learned from the sender's header at the point of need (see ``p2p``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_3d.utils.comm_stats import CommunicationStats
from lightning_3d.pipeline.codec import BoundaryKey, GradientCodec, IdentityCodec
from lightning_3d.pipeline.microbatch import signature
from lightning_3d.pipeline.p2p import PipelineChannels, TensorMeta
from lightning_3d.pipeline.schedules import (
    Action, build_forward_only, build_schedule, check_schedule, mark_epilogue, message_order,
)

ContextFactory = Callable[[], contextlib.AbstractContextManager]


class RuntimeObserver(Protocol):
    """What diagnostics and timelines may watch; the runtime calls it only when one is attached."""

    def on_step(self, phase: str, train: bool, num_microbatches: int) -> None:
        """``phase`` is "begin" or "end" of one pipeline step."""

    def span(self, name: str, stage: int, microbatch: int) -> contextlib.AbstractContextManager:
        """Wraps "forward", "backward" and "wait" (for a received tensor) of one (stage, micro-batch)."""

    def on_received(self, stage: int, microbatch: int, tensors: list[Tensor]) -> None:
        """The activations ``stage`` received for ``microbatch`` (the tensors whose gradient it sends back)."""


@dataclass
class _Incoming:
    """The expected message sequence of one incoming channel and the receives posted for it."""

    order: list[tuple[int, int]]
    consumed: int = 0
    posted: dict[int, tuple[list[dist.Work], list[Tensor]]] = field(default_factory=dict)


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
        self._shape_cache: dict[tuple[int, tuple], list[TensorMeta]] = {}  # boundaries this rank receives
        self._announced: dict[tuple[int, tuple], list[TensorMeta]] = {}  # boundaries this rank sends
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
        """Forward only; ``orders`` as in ``train_step``, with forward actions only."""
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
            orders = [mark_epilogue(order) for order in given]
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
        self._incoming = {
            kind: _Incoming(message_order(orders, self.num_stages, kind, channel.src, channel.dst))
            for kind, channel in self.channels.incoming.items()
        }
        self._signatures = [signature(mb) for mb in mbs]
        self._pending: list[tuple[dist.Work, Any]] = []
        self._saved: dict[tuple[int, int], tuple[list[Tensor], Any]] = {}
        self._out_metas: dict[tuple[int, int], list[TensorMeta]] = {}
        # Both ends of a gradient message must agree on its key, including whether the sender is draining.
        self._epilogue = {(a.stage, a.microbatch): a.epilogue for order in orders for a in order if a.kind == "B"}
        last_backward = {a.stage: i for i, a in enumerate(mine) if a.kind == "B"}
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
        if self.observer is not None:
            self.observer.on_step("begin", train, len(mbs))
        for kind in self._incoming:
            self._post_ahead(kind)
        for index, action in enumerate(mine):
            if action.kind == "F":
                loss = self._forward(action, mbs[action.microbatch], train)
                if loss is not None:
                    loss_sum += loss.detach().float()
            else:
                if self.before_last_backward is not None and last_backward[action.stage] == index:
                    self.before_last_backward(action.stage)
                self._backward(action)
            self._reap()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        if self.observer is not None:
            self.observer.on_step("end", train, len(mbs))
        return loss_sum / self._global_terms() if self._terms is not None else None

    # ----- compute ---------------------------------------------------------------------------------------
    def _forward(self, action: Action, mb: Any, train: bool) -> Tensor | None:
        stage, m = action.stage, action.microbatch
        inputs: list[Tensor] = []
        if stage > 0:
            inputs = self._take("F", (stage - 1, m))
            if train:
                inputs = [t.requires_grad_(True) if t.is_floating_point() else t for t in inputs]
            if self.observer is not None:
                self.observer.on_received(stage, m, inputs)
        with self.forward_context(), self._span("forward", stage, m):
            output = self.stages[stage](*inputs, microbatch=mb)
        if stage == self.num_stages - 1:
            with self.loss_context(), self.forward_context():
                loss = scalar_loss(self.loss_fn(output, mb))
            if train:  # scaled at the backward, where the global term count is first needed
                self._saved[(stage, m)] = (inputs, loss)
            return loss
        outputs = list(output) if isinstance(output, (tuple, list)) else [output]
        metas = [(tuple(t.shape), t.dtype) for t in outputs]
        self._out_metas[(stage, m)] = metas
        self._announce(stage, m, metas)
        channel = self.channels.outgoing["F"]
        for tensor in outputs:
            self._pending.append((self.channels.isend(channel, tensor.detach()), tensor))
            if train:  # the counters describe training steps
                self._count("forward_activations", tensor, [tensor])
        if train:
            self._saved[(stage, m)] = (inputs, outputs)
        return None

    def _backward(self, action: Action) -> None:
        stage, m = action.stage, action.microbatch
        inputs, outputs = self._saved.pop((stage, m))
        if stage == self.num_stages - 1:
            with self.loss_context(), self._span("backward", stage, m):
                torch.autograd.backward(outputs * self._factor())
        else:
            grads = self._take("B", (stage + 1, m))  # one per floating-point output
            floating = [o for o in outputs if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floating, grads, strict=True) if o.requires_grad]
            if pairs:
                with self._span("backward", stage, m):
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if stage > 0:
            channel = self.channels.outgoing["B"]
            floating = [t for t in inputs if t.is_floating_point()]
            for index, t in enumerate(floating):
                grad = t.grad if t.grad is not None else torch.zeros_like(t)
                parts = self.codec.encode(grad, self._key(stage, m, index))
                message = _pack(parts)
                if CHECK_MESSAGES:
                    self._pending.append((self.channels.send_header(channel, [(tuple(message.shape), message.dtype)]), None))
                self._pending.append((self.channels.isend(channel, message), message))
                self._count("backward_activation_grads", grad, parts)

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

    # ----- receiving -------------------------------------------------------------------------------------
    def _take(self, kind: str, key: tuple[int, int]) -> list[Tensor]:
        """The tensors of the next message on channel ``kind``, which must be ``key``."""
        queue = self._incoming[kind]
        if queue.order[queue.consumed] != key:
            raise RuntimeError(f"pipeline rank {self.pp_rank}: expected {kind} message {queue.order[queue.consumed]}, schedule asks for {key}")
        with self._span("wait", key[0] + (1 if kind == "F" else -1), key[1]):
            if queue.consumed not in queue.posted:  # a new shape: its header arrives first
                self._post(kind, queue.consumed, may_block=True)
            works, buffers = queue.posted.pop(queue.consumed)
            queue.consumed += 1
            for work in works:
                work.wait()
        self._post_ahead(kind)
        if kind == "F":
            return buffers
        sender_stage, m = key
        metas = self._float_metas(self._out_metas[(sender_stage - 1, m)])
        return self._decode_grads(buffers, metas, sender_stage, m)

    def _post_ahead(self, kind: str) -> None:
        queue = self._incoming[kind]
        nxt = queue.consumed
        if nxt < len(queue.order) and nxt not in queue.posted:
            self._post(kind, nxt, may_block=False)

    def _post(self, kind: str, index: int, may_block: bool) -> None:
        queue, channel = self._incoming[kind], self.channels.incoming[kind]
        sender_stage, m = queue.order[index]
        if kind == "F":
            cache_key = (sender_stage, self._signatures[m])
            if cache_key not in self._shape_cache:
                if not may_block:
                    return
                self._shape_cache[cache_key] = self.channels.recv_header(channel)
            metas = self._shape_cache[cache_key]
        else:
            produced = self._out_metas.get((sender_stage - 1, m))
            if produced is None:
                return  # our forward of that micro-batch has not run yet
            if not may_block and (CHECK_MESSAGES or not isinstance(self.codec, IdentityCodec)):
                # Compressed gradients are received just in time, never ahead: on NCCL, with a receive posted ahead,
                # the compressing sender and this rank hung in the first step (benchmarks/NOTES.md, "CB on NCCL
                # hung"): a posted receive kernel blocks anything that synchronises the device, such as the
                # codec's kernels, while it waits for a send that only follows them. Compressed messages are small,
                # so receiving late costs little.
                return
            # One message per boundary tensor: a codec's parts (e.g. P and Q) travel packed in one flat buffer.
            works, views = [], []
            for i, meta in enumerate(self._float_metas(produced)):
                message, parts = _packed_buffer(self.codec.message_metas(meta, self._key(sender_stage, m, i)), self.device)
                if CHECK_MESSAGES:  # blocking, on the CPU group: compare what the sender packed with this buffer
                    sent = self.channels.recv_header(channel)
                    if sent != [(tuple(message.shape), message.dtype)]:
                        raise RuntimeError(f"pipeline rank {self.pp_rank}: gradient message {(sender_stage, m, i)} is {sent}"
                                           f" on the sender but {(tuple(message.shape), message.dtype)} here")
                works.append(self.channels.irecv(channel, message))
                views += parts
            queue.posted[index] = (works, views)
            return
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in metas]
        queue.posted[index] = ([self.channels.irecv(channel, b) for b in buffers], buffers)

    def _announce(self, stage: int, m: int, metas: list[TensorMeta]) -> None:
        """Send the boundary's shapes the first time this signature crosses it; check them afterwards."""
        key = (stage, self._signatures[m])
        known = self._announced.get(key)
        if known is None:
            self._announced[key] = metas
            header = self.channels.send_header(self.channels.outgoing["F"], metas)
            self._pending.append((header, None))
        elif known != metas:
            raise RuntimeError(
                f"Stage {stage} produced outputs {metas} for micro-batch {m}, but an earlier micro-batch with the same"
                f" input shapes produced {known}. Pipeline boundary shapes must depend only on the input shapes."
            )

    def _key(self, sender_stage: int, m: int, tensor: int) -> BoundaryKey:
        return BoundaryKey(sender_stage, m, self._epilogue[(sender_stage, m)], tensor)

    @staticmethod
    def _float_metas(metas: list[TensorMeta]) -> list[TensorMeta]:
        return [meta for meta in metas if meta[1].is_floating_point]

    def _decode_grads(self, buffers: list[Tensor], metas: list[TensorMeta], sender_stage: int, m: int) -> list[Tensor]:
        grads, pos = [], 0
        for index, meta in enumerate(metas):
            key = self._key(sender_stage, m, index)
            count = len(self.codec.message_metas(meta, key))
            grads.append(self.codec.decode(buffers[pos : pos + count], meta, key))
            pos += count
        return grads

    def _span(self, name: str, stage: int, microbatch: int) -> contextlib.AbstractContextManager:
        return self.observer.span(name, stage, microbatch) if self.observer is not None else contextlib.nullcontext()

    def _count(self, kind: str, original: Tensor, sent: list[Tensor]) -> None:
        if self.stats is not None:
            self.stats.add(kind, original.numel() * original.element_size(), sum(t.numel() * t.element_size() for t in sent))

    def _reap(self) -> None:
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]


# Debugging aid: ``L3D_CHECK_MESSAGES=1`` sends every gradient message's shape and dtype ahead on the CPU group and
# checks it on the receiver (a mismatch raises instead of hanging NCCL). Costs a host round trip per message.
CHECK_MESSAGES = os.environ.get("L3D_CHECK_MESSAGES", "0") == "1"


def _pack(parts: list[Tensor]) -> Tensor:
    """A codec's parts as one contiguous message: one point-to-point operation per boundary tensor, like an
    uncompressed send (fewer, larger NCCL operations; the receiver splits the same way, see ``_packed_buffer``)."""
    if len(parts) == 1:
        return parts[0]
    if len({t.dtype for t in parts}) != 1:
        raise TypeError(f"codec parts must share one dtype to travel as one message, got {[t.dtype for t in parts]}")
    return torch.cat([t.reshape(-1) for t in parts])


def _packed_buffer(metas: list[TensorMeta], device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """The receive buffer of one packed message and the views of its parts (shapes from ``metas``)."""
    if len(metas) == 1:
        buffer = torch.empty(metas[0][0], dtype=metas[0][1], device=device)
        return buffer, [buffer]
    sizes = [math.prod(shape) for shape, _ in metas]
    buffer = torch.empty(sum(sizes), dtype=metas[0][1], device=device)
    return buffer, [part.view(shape) for part, (shape, _) in zip(buffer.split(sizes), metas)]


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
