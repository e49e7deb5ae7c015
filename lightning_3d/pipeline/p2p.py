"""Point-to-point channels between pipeline ranks.

Every channel carries one kind of message (activations "F" or gradients "B") in one direction, on a
process group of its own. NCCL runs the operations of one communicator in order on one stream, so a
receive posted early for a gradient could block an activation send behind it on a shared communicator;
with one group per direction and kind, each stream only ever holds operations that match the peer's in
order, and the schedule (checked by ``schedules.check_schedule``) cannot deadlock.

Shapes can change from one micro-batch to the next. The receiver of an activation learns its shape from
a small header sent on a CPU (gloo) group, but only the first time a micro-batch *signature* (input
shapes and dtypes) is seen at that boundary; after that both sides know it from the signature alone and
nothing extra is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8]
_HEADER_LEN = 64

TensorMeta = tuple[tuple[int, ...], torch.dtype]


@dataclass
class Channel:
    kind: str  # "F": activations, "B": gradients
    src: int  # pipeline rank of the sender
    dst: int  # pipeline rank of the receiver
    peer: int  # global rank of the other end
    group: dist.ProcessGroup
    meta_group: dist.ProcessGroup  # CPU group for shape headers (the same group when the backend is gloo)


def channel_edges(pp: int, virtual_stages: int) -> list[tuple[str, int, int]]:
    """(kind, src, dst) of every channel a pipeline of ``pp`` ranks needs, in a fixed global order."""
    wrap = virtual_stages > 1
    edges = [("F", r, (r + 1) % pp) for r in range(pp) if r + 1 < pp or wrap]
    edges += [("B", r, (r - 1) % pp) for r in range(pp) if r > 0 or wrap]
    return edges


class PipelineChannels:
    """This rank's incoming and outgoing channels. Construction is collective over the world."""

    def __init__(
        self,
        pipelines: list[list[int]],
        rank: int,
        virtual_stages: int,
        device: torch.device,
        timeout: timedelta | None = None,
    ) -> None:
        """``pipelines``: the global ranks of every pipeline of the job, each ordered by pipeline rank. ``timeout``:
        how long a send or receive waits for a peer before it raises (None: torch's 30 minutes)."""
        self.device = device
        self.outgoing: dict[str, Channel] = {}
        self.incoming: dict[str, Channel] = {}
        self.groups: list[dist.ProcessGroup] = []  # the groups this rank belongs to, for their owner to destroy
        pp = len(pipelines[0])
        if pp == 1:
            return
        # Shape headers travel on one CPU group spanning the world (point-to-point messages are matched per
        # sender and receiver, so pipelines do not mix). It is created before the pair groups: with NCCL's
        # eager initialisation every new NCCL group is a world-wide split, and a gloo group created between
        # two splits can leave its members waiting for each other inside different calls.
        meta_group = dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() != "gloo" else None
        if meta_group is not None:
            self.groups.append(meta_group)
        # Group creation is collective over the world: every rank creates every pipeline's groups in one order.
        for ranks in pipelines:
            for kind, src, dst in channel_edges(pp, virtual_stages):
                group = dist.new_group(ranks=sorted([ranks[src], ranks[dst]]), timeout=timeout)
                if rank in (ranks[src], ranks[dst]):
                    self.groups.append(group)
                if rank == ranks[src]:
                    self.outgoing[kind] = Channel(kind, src, dst, ranks[dst], group, meta_group or group)
                if rank == ranks[dst]:
                    self.incoming[kind] = Channel(kind, src, dst, ranks[src], group, meta_group or group)

    def warmup(self) -> None:
        """Open every channel once, in the global edge order, so lazy communicator setup cannot interleave badly."""
        token = torch.zeros(1, device=self.device)
        # Process this rank's channels in the same global (kind, src, dst) order every rank uses.
        mine = [(c.kind, c.src, c.dst, "send", c) for c in self.outgoing.values()]
        mine += [(c.kind, c.src, c.dst, "recv", c) for c in self.incoming.values()]
        for kind, src, dst, op, channel in sorted(mine, key=lambda x: (x[0] != "F", x[1], x[2])):
            if op == "send":
                dist.send(token, dst=channel.peer, group=channel.group)
            else:
                dist.recv(token, src=channel.peer, group=channel.group)

    def isend(self, channel: Channel, tensor: Tensor) -> dist.Work:
        return dist.isend(tensor.contiguous(), dst=channel.peer, group=channel.group)

    def irecv(self, channel: Channel, tensor: Tensor) -> dist.Work:
        return dist.irecv(tensor, src=channel.peer, group=channel.group)

    def send_header(self, channel: Channel, metas: list[TensorMeta]) -> dist.Work:
        return dist.isend(encode_header(metas), dst=channel.peer, group=channel.meta_group)

    def recv_header(self, channel: Channel) -> list[TensorMeta]:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        dist.recv(header, src=channel.peer, group=channel.meta_group)
        return decode_header(header)


def encode_header(metas: list[TensorMeta]) -> Tensor:
    values = [len(metas)]
    for shape, dtype in metas:
        values += [_DTYPES.index(dtype), len(shape), *shape]
    if len(values) > _HEADER_LEN:
        raise ValueError(f"A pipeline boundary carries too many tensor dimensions to describe: {metas}")
    return torch.tensor(values + [0] * (_HEADER_LEN - len(values)), dtype=torch.int64)


def decode_header(header: Tensor) -> list[TensorMeta]:
    values = header.tolist()
    count, pos, metas = values[0], 1, []
    for _ in range(count):
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        metas.append((tuple(values[pos + 2 : pos + 2 + ndim]), dtype))
        pos += 2 + ndim
    return metas
