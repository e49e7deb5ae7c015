"""Megatron's communication operators for tensor parallelism on plain (local) tensors.

Each operator is an autograd function whose forward and backward are conjugate collectives over the tensor-parallel
group (see docs/tensor_parallel.md):

- :func:`copy_to_region` ("f"): forward identity, backward all-reduce — the input of column-parallel layers.
- :func:`reduce_from_region` ("g"): forward all-reduce, backward identity — the output of row-parallel layers.
- :func:`gather_sequence` / :func:`reduce_scatter_sequence`: the sequence-parallel versions of f and g (all-gather
  along the sequence forward and reduce-scatter backward, and the reverse).
- :func:`split_sequence`: forward keeps this rank's sequence chunk, backward all-gathers (replicated -> sharded).

The sequence is dimension 1 (activations are (batch, seq, hidden)); rank r holds the r-th of tp equal contiguous
chunks, the layout of DTensor's ``Shard(1)``, so pipeline boundaries, dropout streams and checkpoints see the same
shards as the DTensor plan did. Collectives are synchronous here: overlapping them with the GEMMs (torch's async-TP
on symmetric memory) needs GPUs and is left to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_3d.utils.compat import functional_all_gather, functional_all_reduce, functional_reduce_scatter

# The single-tensor collectives under their newer names where torch has them (the old ones warn as deprecated).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel group a layer runs in: its mesh (for the DTensor parameters), group, size and rank, and
    whether activations between layers are sharded over the sequence (sequence parallelism)."""

    mesh: DeviceMesh
    sequence_parallel: bool = False

    # Looked up per layer and micro-batch, so resolved once here. Not ``functools.cached_property``: before Python 3.12
    # it takes an RLock, a context manager torch.compile cannot trace (a graph break per lookup in a compiled block).
    group: dist.ProcessGroup = field(init=False, repr=False, compare=False)
    size: int = field(init=False, repr=False, compare=False)
    rank: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "group", self.mesh.get_group())
        object.__setattr__(self, "size", self.mesh.size())
        object.__setattr__(self, "rank", self.mesh.get_local_rank())

    def enter(self, x: Tensor) -> Tensor:
        """The input of a column-parallel layer: the full activation on every rank (f, or the sequence all-gather).

        Under autocast the GEMM that follows casts its input to the autocast dtype anyway; casting before the
        collective instead makes the backward all-reduce (or the sequence all-gather and its reduce-scatter) move
        bf16, not the fp32 that a LayerNorm's output has under autocast: half the bytes, as Megatron's activations."""
        device = x.device.type
        if x.is_floating_point() and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            if x.dtype != dtype:
                x = x.to(dtype)
        return gather_sequence(x, self.group) if self.sequence_parallel else copy_to_region(x, self.group)

    def exit(self, x: Tensor) -> Tensor:
        """The output of a row-parallel layer: partial sums reduced (g, or the sequence reduce-scatter)."""
        return reduce_scatter_sequence(x, self.group) if self.sequence_parallel else reduce_from_region(x, self.group)


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    if torch.compiler.is_compiling():  # out of place in a graph (see functional_all_reduce)
        return functional_all_reduce(x.contiguous(), group)
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(b, s/tp, ...) chunks -> (b, s, ...), rank order along the sequence."""
    world = dist.get_world_size(group)
    if torch.compiler.is_compiling():  # out of place in a graph (see functional_all_gather)
        out = functional_all_gather(x.contiguous(), group)
    else:
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))  # the collective concatenates along dim 0
        _all_gather_single(out, x.contiguous(), group=group)
    # (tp, b, s/tp, ...) -> (b, tp, s/tp, ...) -> (b, s, ...): one copy.
    return out.unflatten(0, (world, x.shape[0])).transpose(0, 1).reshape(x.shape[0], world * x.shape[1], *x.shape[2:])


def _reduce_scatter_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(b, s, ...) partial sums -> this rank's (b, s/tp, ...) chunk of their sum."""
    world = dist.get_world_size(group)
    b, s = x.shape[0], x.shape[1]
    if s % world:
        raise ValueError(f"Sequence parallelism needs the sequence length {s} divisible by tensor_parallel_size={world}.")
    # (b, s, ...) -> (tp, b, s/tp, ...) flattened to (tp * b, s/tp, ...): rank r's chunk is the r-th block of dim 0.
    chunks = x.reshape(b, world, s // world, *x.shape[2:]).transpose(0, 1).reshape(world * b, s // world, *x.shape[2:])
    if torch.compiler.is_compiling():  # out of place in a graph (see functional_reduce_scatter)
        return functional_reduce_scatter(chunks, group)
    out = x.new_empty(chunks.shape[0] // world, *chunks.shape[1:])
    _reduce_scatter_single(out, chunks, group=group)
    return out


def _split_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    s = x.shape[1]
    if s % world:
        raise ValueError(f"Sequence parallelism needs the sequence length {s} divisible by tensor_parallel_size={world}.")
    return x.narrow(1, rank * (s // world), s // world).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        # Out of place: autograd may hand the same gradient tensor to another consumer (or it is the caller's own).
        return _all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        if torch.compiler.is_compiling():
            return _all_reduce(x, group)  # out of place: a graph has no in-place collective to declare
        if x.is_leaf or not x.is_contiguous():
            return _all_reduce(x.clone(memory_format=torch.contiguous_format), group)
        # In place on the GEMM's fresh output (no op saved it), declared so that autograd knows.
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _all_gather_seq(grad, ctx.group), None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _all_gather_seq(grad, ctx.group), None


def copy_to_region(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """f: identity forward; the backward all-reduces the gradient (each rank's layer saw the whole input)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """g: all-reduce forward (sums the ranks' partial products); identity backward."""
    return _ReduceFromRegion.apply(x, group)


def gather_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sequence-sharded -> full along dim 1; the backward reduce-scatters the gradient back to the chunks."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Partial sums -> this rank's sequence chunk of their sum; the backward all-gathers the chunks' gradients."""
    return _ReduceScatterSequence.apply(x, group)


def split_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Replicated -> this rank's sequence chunk; the backward all-gathers (each rank's chunk's gradient)."""
    return _SplitSequence.apply(x, group)
