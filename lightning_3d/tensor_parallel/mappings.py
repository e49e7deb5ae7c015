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
shards as the DTensor plan did. The column-parallel entry fused with its GEMM, whose backward overlaps the input
gradient's collective with the weight-gradient GEMM, is :func:`column_parallel_linear` (f or the sequence
all-gather and the GEMM as one autograd function).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_3d.utils.compat import (
    enable_async_tensor_parallel,
    functional_all_gather_start,
    functional_all_reduce_start,
    functional_reduce_scatter_start,
    functional_wait,
)

# The single-tensor collectives under their newer names where torch has them (the old ones warn as deprecated).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel group a layer runs in: its mesh (for the DTensor parameters), group, size and rank, and
    whether activations between layers are sharded over the sequence (sequence parallelism)."""

    mesh: DeviceMesh
    sequence_parallel: bool = False
    # Whether column-parallel layers overlap the backward's collective of their input gradient with their weight
    # gradient's GEMM (``column_parallel_linear``); off only to measure what the overlap buys.
    overlap: bool = field(default_factory=lambda: overlap_from_environment())
    # Under SP with the overlap: whether the column-parallel GEMM saves only this rank's sequence chunk of its input and
    # all-gathers it again in the backward (less activation memory), instead of the gathered input (the memory of the
    # synchronous path, no second all-gather). Off by default: on GPUs the re-gather made the backward slower than the
    # synchronous path (docs/tensor_parallel.md, "Overlapping the backward collectives").
    regather: bool = field(default_factory=lambda: regather_from_environment())
    # Async tensor parallelism (``L3D_TP_ASYNC``): inductor fuses compiled blocks' sequence all-gathers with the GEMMs
    # that read them and GEMMs with the reduce-scatters of their outputs, chunked over symmetric memory
    # (docs/tensor_parallel.md, "Async tensor parallelism"). Needs SP, CUDA with NCCL and compiled blocks.
    async_tp: bool = field(default_factory=lambda: async_tp_from_environment())

    # Looked up per layer and micro-batch, so resolved once here. Not ``functools.cached_property``: before Python 3.12
    # it takes an RLock, a context manager torch.compile cannot trace (a graph break per lookup in a compiled block).
    group: dist.ProcessGroup = field(init=False, repr=False, compare=False)
    size: int = field(init=False, repr=False, compare=False)
    rank: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "group", self.mesh.get_group())
        object.__setattr__(self, "size", self.mesh.size())
        object.__setattr__(self, "rank", self.mesh.get_local_rank())
        if self.async_tp:
            check_async_tp(self.sequence_parallel, self.mesh.device_type, dist.get_backend(self.group))
            enable_async_tensor_parallel(self.group)

    def enter(self, x: Tensor) -> Tensor:
        """The input of a column-parallel layer: the full activation on every rank (f, or the sequence all-gather).

        Under autocast the GEMM that follows casts its input to the autocast dtype anyway; casting before the
        collective instead makes the backward all-reduce (or the sequence all-gather and its reduce-scatter) move
        bf16, not the fp32 that a LayerNorm's output has under autocast: half the bytes, as Megatron's activations."""
        dtype = autocast_dtype(x)
        if dtype is not None and x.dtype != dtype:
            x = x.to(dtype)
        return gather_sequence(x, self.group) if self.sequence_parallel else copy_to_region(x, self.group)

    def exit(self, x: Tensor) -> Tensor:
        """The output of a row-parallel layer: partial sums reduced (g, or the sequence reduce-scatter)."""
        return reduce_scatter_sequence(x, self.group) if self.sequence_parallel else reduce_from_region(x, self.group)


OVERLAP_VARIABLE = "L3D_TP_OVERLAP"


def overlap_from_environment() -> bool:
    """``L3D_TP_OVERLAP``: 1 (or unset) overlaps the column-parallel backward's collective with the weight-gradient
    GEMM; 0 runs the collective synchronously after the layer's whole backward (the comparison a benchmark makes).
    Read where the plan builds its ``TensorParallel``, on every rank before any collective."""
    return _switch(OVERLAP_VARIABLE, "1", "set it to 1 (overlap the tensor-parallel backward collectives with the"
                   " weight-gradient GEMM, the default) or 0 (synchronous collectives, for comparison), or unset it.")


def _switch(variable: str, default: str, fix: str) -> bool:
    """An environment variable that is 0 or 1 (``default`` when unset); anything else raises with ``fix``."""
    value = os.environ.get(variable, default).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{variable}={value!r} is not a switch: {fix}")
    return value == "1"


REGATHER_VARIABLE = "L3D_TP_SP_REGATHER"


def regather_from_environment() -> bool:
    """``L3D_TP_SP_REGATHER``: 0 (or unset) saves the gathered input of each column-parallel GEMM under sequence
    parallelism; 1 saves this rank's chunk and all-gathers it again in the backward, (tp - 1)/tp of that input's
    memory less for one all-gather more. No effect without SP or with ``L3D_TP_OVERLAP=0``."""
    return _switch(REGATHER_VARIABLE, "0", "set it to 0 (save the gathered input of column-parallel layers under"
                   " sequence parallelism, the default) or 1 (save this rank's sequence chunk and all-gather it again in"
                   " the backward: less memory), or unset it.")


ASYNC_TP_VARIABLE = "L3D_TP_ASYNC"


def async_tp_from_environment() -> bool:
    """``L3D_TP_ASYNC``: 1 turns on async tensor parallelism (inductor's micro-pipeline TP pass and symmetric memory for
    the tensor-parallel group), 0 or unset leaves it off. Read where the plan builds its ``TensorParallel``."""
    return _switch(ASYNC_TP_VARIABLE, "0", "set it to 1 (async tensor parallelism in compiled sequence-parallel"
                   " blocks on CUDA) or 0 (off, the default), or unset it.")


def check_async_tp(sequence_parallel: bool, device_type: str, backend: str) -> None:
    """Refuses async tensor parallelism where inductor's pass cannot fuse anything, before any collective."""
    if not sequence_parallel:
        raise ValueError(f"{ASYNC_TP_VARIABLE}=1 (async_tp=True) fuses the sequence all-gathers and reduce-scatters"
                         " with their GEMMs, but sequence_parallel=False: set sequence_parallel=True, or unset"
                         f" {ASYNC_TP_VARIABLE}.")
    if device_type != "cuda" or "nccl" not in str(backend):  # "nccl", or a per-device list such as "cpu:gloo,cuda:nccl"
        raise ValueError(f"{ASYNC_TP_VARIABLE}=1 (async_tp=True) needs CUDA devices with NCCL (symmetric memory);"
                         f" the tensor-parallel group is on {device_type!r} with {backend!r}: unset"
                         f" {ASYNC_TP_VARIABLE}.")


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype autocast gives a GEMM of ``x`` on its device, or None where autocast leaves ``x`` alone."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


# Each ``_launch_*`` starts a collective and returns (output, handle) without waiting for it; ``_finish(output,
# handle)`` waits and returns the result. Eagerly: the c10d call with ``async_op=True`` into a tensor allocated here,
# and its work handle. Inside a graph: torch's functional collective op (out of place, see
# compat.functional_all_reduce_start) with handle None, and the wait a graph op of its own, placed where ``_finish``
# is called: a compiled graph runs the work between the two while the collective is in flight.


def _finish(output: Tensor, handle) -> Tensor:
    if handle is None:
        return functional_wait(output)
    handle.wait()
    return output


def _launch_all_reduce(x: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, object]:
    """The sum of ``x`` over ``group``; eagerly in place on (a contiguous) ``x``."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return functional_all_reduce_start(x, group), None
    return x, dist.all_reduce(x, group=group, async_op=True)


def _launch_all_gather(x: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, object]:
    """Every rank's ``x`` concatenated along dim 0, in rank order (:func:`_sequence_from_gathered` reorders it)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return functional_all_gather_start(x, group), None
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    return out, _all_gather_single(out, x, group=group, async_op=True)


def _sequence_from_gathered(out: Tensor, world: int) -> Tensor:
    """(tp * b, s/tp, ...) as gathered -> (tp, b, s/tp, ...) -> (b, tp, s/tp, ...) -> (b, s, ...): one copy.

    Inside a graph as the chunks concatenated along the sequence, the form torch's ``all_gather_tensor(x, 1)``
    traces to (the same values): inductor's micro-pipeline tensor-parallel pass recognises that form only
    (docs/tensor_parallel.md, "Async tensor parallelism")."""
    if torch.compiler.is_compiling():
        return torch.cat(out.chunk(world, 0), dim=1)
    b = out.shape[0] // world
    return out.unflatten(0, (world, b)).transpose(0, 1).reshape(b, world * out.shape[1], *out.shape[2:])


def _launch_reduce_scatter_seq(x: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, object]:
    """(b, s, ...) partial sums -> this rank's (b, s/tp, ...) chunk of their sum."""
    world = dist.get_world_size(group)
    b, s = x.shape[0], x.shape[1]
    if s % world:
        raise ValueError(f"Sequence parallelism needs the sequence length {s} divisible by tensor_parallel_size={world}.")
    if torch.compiler.is_compiling():
        # The chunks stacked along dim 0 as torch's ``reduce_scatter_tensor(x, "sum", 1)`` traces them (the same
        # values as below): the form inductor's micro-pipeline tensor-parallel pass recognises.
        return functional_reduce_scatter_start(torch.cat(x.chunk(world, 1), dim=0), group), None
    # (b, s, ...) -> (tp, b, s/tp, ...) flattened to (tp * b, s/tp, ...): rank r's chunk is the r-th block of dim 0.
    chunks = x.reshape(b, world, s // world, *x.shape[2:]).transpose(0, 1).reshape(world * b, s // world, *x.shape[2:])
    out = x.new_empty(chunks.shape[0] // world, *chunks.shape[1:])
    return out, _reduce_scatter_single(out, chunks, group=group, async_op=True)


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _finish(*_launch_all_reduce(x, group))


def _all_gather_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(b, s/tp, ...) chunks -> (b, s, ...), rank order along the sequence."""
    return _sequence_from_gathered(_finish(*_launch_all_gather(x, group)), dist.get_world_size(group))


def _reduce_scatter_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(b, s, ...) partial sums -> this rank's (b, s/tp, ...) chunk of their sum."""
    return _finish(*_launch_reduce_scatter_seq(x, group))


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


class _ColumnParallelLinear(torch.autograd.Function):
    """f (or the sequence all-gather) and the GEMM as one autograd node, so that its backward can order its work as
    Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` does: the input gradient (dgrad) first, its
    all-reduce (reduce-scatter under SP) launched without waiting, the weight and bias gradients computed while it
    runs, the wait last. Through ``copy_to_region`` and ``F.linear`` autograd ran the GEMM's whole backward and only
    then the collective, with nothing left to overlap it with. Under SP the forward saves the gathered input, as
    ``F.linear`` did, or with ``regather`` only this rank's sequence chunk, and the backward gathers the full input
    again while the dgrad GEMM runs (the forward's gathered copy, tp times the chunk, is freed after the forward). The
    operations are the ones autograd runs for ``F.linear`` (``mm`` for both gradients, ``sum`` over tokens for the
    bias), so the gradients are those of the synchronous path to the bit."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, group,  # type: ignore[override]
                sequence_parallel: bool, regather: bool, async_tp: bool) -> Tensor:
        need_x, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = _all_gather_seq(x, group) if sequence_parallel else x
        ctx.regather = sequence_parallel and regather
        # Saved as autograd saves for F.linear: the input where the weight needs a gradient (under SP with regather
        # this rank's chunk of it), the weight where the input does.
        saved_x = (x if ctx.regather else total) if need_weight else None
        ctx.save_for_backward(saved_x, weight if need_x else None)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        if async_tp and bias is not None:
            # addmm, which F.linear with a bias becomes, is no GEMM inductor's micro-pipeline TP pass fuses with the
            # all-gather; mm and the bias added apart are (rounded twice, so not the bits of F.linear).
            return F.linear(total, weight) + bias
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        group, sp, regather = ctx.group, ctx.sequence_parallel, ctx.regather
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        if need_weight and regather:  # in flight while the dgrad GEMM runs
            gathered, gather_handle = _launch_all_gather(x, group)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_x = handle = None
        if need_x:
            dgrad = grad_2d.mm(weight).view(*grad.shape[:-1], weight.shape[1])
            # Launched before the all-gather's wait (Megatron waits first): both run in order on the collectives'
            # stream either way, and the reduce-scatter's layout copy then runs on the compute stream while the
            # all-gather may still be in flight.
            grad_x, handle = (_launch_reduce_scatter_seq if sp else _launch_all_reduce)(dgrad, group)
        grad_weight = grad_bias = None
        if need_weight:
            total = _sequence_from_gathered(_finish(gathered, gather_handle), dist.get_world_size(group)) \
                if regather else x
            grad_weight = grad_2d.t().mm(total.reshape(-1, total.shape[-1]))
        if need_bias:
            grad_bias = grad_2d.sum(0)
        if need_x:
            grad_x = _finish(grad_x, handle)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def column_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, tp: TensorParallel) -> Tensor:
    """``F.linear(tp.enter(x), weight, bias)`` for this rank's rows ``weight`` of a column-parallel layer: the same
    result and gradients, with the backward's collective of the input gradient overlapped with the weight-gradient
    GEMM (``_ColumnParallelLinear``; docs/tensor_parallel.md); under SP ``tp.regather`` saves this rank's chunk of the
    input instead of the gathered input and all-gathers it again in the backward. ``tp.overlap`` False
    (``L3D_TP_OVERLAP=0``) runs ``tp.enter`` and ``F.linear`` as separate autograd nodes instead, the synchronous
    path, for comparison. With ``tp.async_tp``, in a compiled block, the bias is added after the GEMM (the fusion
    pass takes ``mm``, not ``addmm``).

    Under autocast the input, weight and bias are cast to the autocast dtype here, as autocast's ``linear`` casts
    them, so that the collectives move that dtype (``TensorParallel.enter``) and the node sees one dtype."""
    if not tp.overlap or not torch.is_grad_enabled():
        return F.linear(tp.enter(x), weight, bias)
    dtype = autocast_dtype(x)
    if dtype is not None:
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return _ColumnParallelLinear.apply(x, weight, bias, tp.group, tp.sequence_parallel, tp.regather,
                                       tp.async_tp and torch.compiler.is_compiling())
