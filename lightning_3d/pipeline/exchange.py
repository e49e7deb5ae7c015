"""The messages of one pipeline step on this rank: what its actions send, what it receives, in which round.

``PipelineRuntime`` computes; this class turns what it computes into the transport's ordered stream. During a
round the runtime hands over the round's outgoing message (``send_activations`` / ``send_gradients``: encoded by
the codec, packed, its shape header sent if new); ``end_round`` then posts the round's one batch: that message and
the receives of every message a neighbour sent in the same round (``rounds.lockstep_rounds``). Receives are thus
posted as soon as their sender has produced them, compressed gradients included, and waited for only when an
action consumes them (``take``). Why this order is safe on NCCL: docs/architecture.md ("Pipeline transport").
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_3d.pipeline.codec import BoundaryKey, GradientCodec
from lightning_3d.pipeline.p2p import PipelineChannels, TensorMeta
from lightning_3d.pipeline.rounds import Message, Round, destination
from lightning_3d.pipeline.schedules import Action

# Debugging aid: ``L3D_CHECK_MESSAGES=1`` sends every gradient message's shape and dtype ahead on the CPU group and
# checks it on the receiver (a mismatch raises instead of hanging NCCL). Costs a host round trip per message.
CHECK_MESSAGES = os.environ.get("L3D_CHECK_MESSAGES", "0") == "1"

Span = Callable[[str, int, int], contextlib.AbstractContextManager]


class _Batch:
    """The works of one posted batch, waited for once: on gloo a second ``wait`` of a receive (or send) waits for
    another completion of the same buffer, which never comes. Several messages of a round share one batch."""

    __slots__ = ("works", "tensors", "done")

    def __init__(self, works: list[dist.Work], tensors: list[Tensor]) -> None:
        self.works, self.tensors, self.done = works, tensors, False

    def wait(self) -> None:
        if not self.done:
            for work in self.works:
                work.wait()
            self.done = True

    def completed(self) -> bool:
        return self.done or all(work.is_completed() for work in self.works)


class StepExchange:
    """This rank's sends and receives; the shapes it learned persist across steps, the rest is per step (``begin``)."""

    def __init__(self, channels: PipelineChannels, device: torch.device, num_stages: int, pp: int) -> None:
        self.channels = channels
        self.device = device
        self.num_stages = num_stages
        self.pp = pp
        self._shape_cache: dict[tuple[int, tuple], list[TensorMeta]] = {}  # boundaries this rank receives
        self._announced: dict[tuple[int, tuple], list[TensorMeta]] = {}  # boundaries this rank sends

    def begin(self, orders: Sequence[Sequence[Action]], signatures: list[tuple], codec: GradientCodec) -> None:
        self.codec = codec
        self._signatures = signatures
        # Both ends of a gradient message must agree on its key, including whether the sender is draining.
        self._epilogue = {(a.stage, a.microbatch): a.epilogue for order in orders for a in order if a.kind == "B"}
        self.out_metas: dict[tuple[int, int], list[TensorMeta]] = {}  # what this rank's forwards produced
        self._posted: dict[Message, tuple[_Batch, list[Tensor]]] = {}
        self._outgoing: list[tuple[int, Tensor]] = []
        self._pending: list[_Batch] = []  # sends in flight, with their tensors

    # ----- sending ---------------------------------------------------------------------------------------
    def send_activations(self, stage: int, m: int, outputs: list[Tensor]) -> None:
        """Queue ``stage``'s outputs for ``m`` (sent at the end of the round); announce their shapes if new."""
        metas = [(tuple(t.shape), t.dtype) for t in outputs]
        self.out_metas[(stage, m)] = metas
        dst = destination("F", stage, self.num_stages, self.pp)
        key = (stage, self._signatures[m])
        known = self._announced.get(key)
        if known is None:
            self._announced[key] = metas
            self._pending.append(_Batch([self.channels.send_header(dst, metas)], []))
        elif known != metas:
            raise RuntimeError(
                f"Stage {stage} produced outputs {metas} for micro-batch {m}, but an earlier micro-batch with the same"
                f" input shapes produced {known}. Pipeline boundary shapes must depend only on the input shapes."
            )
        self._outgoing += [(dst, t.detach().contiguous()) for t in outputs]

    def send_gradients(self, stage: int, m: int, grads: list[Tensor]) -> list[list[Tensor]]:
        """Encode and queue the gradients of ``stage``'s floating-point inputs for ``m``; returns the sent parts."""
        dst = destination("B", stage, self.num_stages, self.pp)
        sent = []
        for index, grad in enumerate(grads):
            parts = self.codec.encode(grad, self._key(stage, m, index))
            message = _pack(parts)
            if CHECK_MESSAGES:
                self._pending.append(_Batch([self.channels.send_header(dst, [(tuple(message.shape), message.dtype)])], []))
            self._outgoing.append((dst, message))
            sent.append(parts)
        return sent

    # ----- one batch per round -----------------------------------------------------------------------------
    def end_round(self, rnd: Round) -> None:
        """Post the round's batch: the queued outgoing message and the receives of ``rnd.receives``."""
        recvs: list[tuple[int, Tensor]] = []
        expected: list[tuple[Message, list[Tensor]]] = []
        for message in rnd.receives:
            kind, sender_stage, m = message
            src = sender_stage % self.pp
            if kind == "F":
                buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._in_metas(src, sender_stage, m)]
                recvs += [(src, b) for b in buffers]
                expected.append((message, buffers))
                continue
            views: list[Tensor] = []
            produced = self.out_metas[(sender_stage - 1, m)]  # our forward of ``m`` ran before its gradient was sent
            for i, meta in enumerate(_float_metas(produced)):
                buffer, parts = _packed_buffer(self.codec.message_metas(meta, self._key(sender_stage, m, i)), self.device)
                if CHECK_MESSAGES:  # blocking, on the CPU group: compare what the sender packed with this buffer
                    got = self.channels.recv_header(src)
                    if got != [(tuple(buffer.shape), buffer.dtype)]:
                        raise RuntimeError(f"pipeline rank {self.channels.pp_rank}: gradient message {(sender_stage, m, i)} is"
                                           f" {got} on the sender but {(tuple(buffer.shape), buffer.dtype)} here")
                recvs.append((src, buffer))
                views += parts
            expected.append((message, views))
        batch = _Batch(self.channels.exchange(self._outgoing, recvs), [t for _, t in self._outgoing])
        self._outgoing = []
        for message, tensors in expected:
            self._posted[message] = (batch, tensors)
        if batch.tensors:
            self._pending.append(batch)
        self._pending = [b for b in self._pending if not b.completed()]

    def _in_metas(self, src: int, sender_stage: int, m: int) -> list[TensorMeta]:
        """Shapes of an incoming activation: known from the micro-batch's signature, or read from the sender's header
        (sent before its batch of the same round, so this blocking receive waits at most for the sender's round)."""
        key = (sender_stage, self._signatures[m])
        if key not in self._shape_cache:
            self._shape_cache[key] = self.channels.recv_header(src)
        return self._shape_cache[key]

    # ----- receiving -------------------------------------------------------------------------------------
    def take(self, kind: str, sender_stage: int, m: int, span: Span) -> list[Tensor]:
        """The tensors of a received message (gradients decoded), waiting for its batch."""
        batch, tensors = self._posted.pop((kind, sender_stage, m))
        with span("wait", sender_stage + (1 if kind == "F" else -1), m):
            batch.wait()
        if kind == "F":
            return tensors
        grads, pos = [], 0
        for index, meta in enumerate(_float_metas(self.out_metas[(sender_stage - 1, m)])):
            key = self._key(sender_stage, m, index)
            count = len(self.codec.message_metas(meta, key))
            grads.append(self.codec.decode(tensors[pos : pos + count], meta, key))
            pos += count
        return grads

    def finish(self) -> None:
        """Wait for every send of the step."""
        for batch in self._pending:
            batch.wait()
        self._pending.clear()
        if self._posted:
            raise RuntimeError(f"pipeline rank {self.channels.pp_rank}: messages {sorted(self._posted)} were received but never used")

    def _key(self, sender_stage: int, m: int, tensor: int) -> BoundaryKey:
        return BoundaryKey(sender_stage, m, self._epilogue[(sender_stage, m)], tensor)


def _float_metas(metas: list[TensorMeta]) -> list[TensorMeta]:
    return [meta for meta in metas if meta[1].is_floating_point]


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
