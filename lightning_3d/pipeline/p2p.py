"""The transport between the ranks of one pipeline: one ordered stream of point-to-point batches.

All messages of a pipeline, activations and gradients in both directions, travel on one process group of the
pipeline's ranks, on which nothing else is issued: each rank issues them in rounds (``rounds.lockstep_rounds``), one
``torch.distributed.batch_isend_irecv`` per round, and both ends of every message post it in the same round. On
NCCL a batch is one group call on the pipeline's communicator, so each link sees the same sequence of operations on
its two ends, as NCCL requires; see docs/architecture.md ("Pipeline transport") for why this cannot deadlock, also
with receives posted ahead of their use.

Shapes can change from one micro-batch to the next. The receiver of an activation learns its shape from a small
header sent on a CPU (gloo) group, but only the first time a micro-batch *signature* (input shapes and dtypes) is
seen at that boundary; after that both sides know it from the signature alone and nothing extra is sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8]
_HEADER_LEN = 64

TensorMeta = tuple[tuple[int, ...], torch.dtype]


class PipelineChannels:
    """This rank's end of its pipeline's stream. ``ranks``: the pipeline's global ranks, by pipeline rank.

    ``group``: the pipeline's process group (its members are ``ranks``; None when pp = 1). ``meta_group``: the CPU
    group that carries shape headers (the same group when the backend is gloo). Construction is local: the groups
    are made by their owner (``distributed.process_groups``), one per pipeline.
    """

    def __init__(
        self,
        ranks: list[int],
        rank: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        meta_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.ranks = ranks
        self.device = device
        self.group = group
        self.meta_group = meta_group if meta_group is not None else group
        self.pp_rank = ranks.index(rank)

    def peer(self, pp_rank: int) -> int:
        """Global rank of a pipeline rank."""
        return self.ranks[pp_rank]

    def warmup(self) -> None:
        """Collective over the pipeline: creates its communicator while every member takes part (a batch of
        point-to-point operations on a communicator that does not exist yet must involve all its ranks)."""
        if self.group is not None:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)

    def exchange(self, sends: list[tuple[int, Tensor]], recvs: list[tuple[int, Tensor]]) -> list[dist.Work]:
        """Post one round's batch: ``sends`` and ``recvs`` as (peer pipeline rank, tensor), each list in message
        order. Returns the batch's works (NCCL: one for the whole batch); waiting for them completes every operation."""
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.peer(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.peer(p), self.group) for p, t in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    def send_header(self, pp_rank: int, metas: list[TensorMeta]) -> dist.Work:
        return dist.isend(encode_header(metas), dst=self.peer(pp_rank), group=self.meta_group)

    def recv_header(self, pp_rank: int) -> list[TensorMeta]:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        dist.recv(header, src=self.peer(pp_rank), group=self.meta_group)
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
