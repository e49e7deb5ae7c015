"""Ring attention: exact (causal or full) attention of sequences sharded over a context-parallel group.

Each rank holds its slice of the queries, keys and values (``sharding.py``: contiguous, or zigzag for balanced causal
work). The K/V slices travel around the ring: at every step a rank attends its queries to the K/V slice it holds
while that slice is already on its way to the next rank (an asynchronous one-peer permutation: send to rank + 1,
receive from rank - 1, waited for just before its use), and the partial results are merged with the log-sum-exp rule
(online softmax). Causal masking follows the chunk positions: blocks entirely in a query's future are skipped, the
diagonal block gets the triangular mask, blocks entirely in its past none. The backward is a second ring pass: K/V
circulate again, and each block's dK/dV travel with them back to their owners. Memory is that of the local slices.

Built on torch's own ring (``torch.distributed.tensor.experimental._context_parallel``, through
``lightning_3d.utils.compat``), which implements exactly this for both layouts (its "load balance" is our zigzag)
and works on CPU with gloo. What it lacks, and this module adds:

- a usable entry point: torch's public ``context_parallel`` intercepts only the CUDA SDPA kernels through DTensor
  dispatch and swaps ``F.scaled_dot_product_attention`` globally; here one autograd ``Function`` calls the ring's
  forward and backward loops directly, with the block kernel of the device (``compat.attention_block_ops``);
- per-call options (torch keeps them in module globals) and the point-to-point rotation (its default all-gathers
  every K/V slice, which is the memory of the whole sequence);
- the zigzag layout under full (non-causal) attention, which torch refuses: full attention does not depend on the
  order of keys, so it simply runs without the causal bookkeeping;
- input checks that raise on every rank before any collective (a shape mismatch inside the ring would leave the
  other ranks waiting in it).

See docs/context_parallel.md for the design and how it joins the (dp, cp, pp, tp) mesh.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_3d.context.sharding import LAYOUTS
from lightning_3d.utils.compat import attention_block_ops, ring_attention_backward, ring_attention_forward


def check_attention_shapes(query: Tensor, key: Tensor, value: Tensor, layout: str) -> None:
    """The checks every context-parallel attention shares: a known layout, (batch, heads, local sequence, head dim)
    tensors of equal shapes, dtype and device. Raise a ValueError naming the bad value and the fix; pure (no
    communication), so every rank raises alike, before any collective."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown context-parallel layout {layout!r}; use one of {LAYOUTS}.")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"Context-parallel attention takes (batch, heads, local sequence, head dim) tensors; {name}"
                             f" has shape {tuple(t.shape)}.")
    if not (query.shape[:2] == key.shape[:2] == value.shape[:2]):
        raise ValueError(f"query, key and value must have the same batch and heads, got {tuple(query.shape)},"
                         f" {tuple(key.shape)} and {tuple(value.shape)} (grouped-query attention: repeat the K/V heads"
                         " first).")
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]):
        raise ValueError(f"query, key and value must have the same head dim, got {query.shape[-1]}, {key.shape[-1]}"
                         f" and {value.shape[-1]}.")
    if key.shape[2] != value.shape[2] or query.shape[2] != key.shape[2]:
        raise ValueError(f"The local query, key and value slices must be equally long (every rank holds the same"
                         f" tokens of each), got {query.shape[2]}, {key.shape[2]} and {value.shape[2]}.")
    if not (query.dtype == key.dtype == value.dtype) or not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must share dtype and device, got {query.dtype}/{query.device},"
                         f" {key.dtype}/{key.device} and {value.dtype}/{value.device}.")


def check_ring_inputs(query: Tensor, key: Tensor, value: Tensor, cp: int, layout: str, causal: bool) -> None:
    """``check_attention_shapes`` and what the ring adds: zigzag slices of two equal halves under causal masking, and
    CUDA's fp32 kernel's lengths."""
    check_attention_shapes(query, key, value, layout)
    local = query.shape[2]
    if layout == "zigzag" and causal and cp > 1 and local % 2 != 0:
        raise ValueError(f"A zigzag slice holds two equal chunks, but the local sequence length is {local} (odd): make"
                         f" the full sequence a multiple of 2 x context_parallel_size = {2 * cp}.")
    if query.device.type == "cuda" and query.dtype == torch.float32 and cp > 1 and local % 64 != 0:
        # The memory-efficient kernel pads its log-sum-exp to 32 rows; the ring merges it row by row with the output.
        raise ValueError(f"fp32 ring attention on CUDA needs local sequence lengths that are multiples of 64, got"
                         f" {local}; pad the sequence, or run attention in bf16/fp16 (autocast).")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup, causal: bool,
                balanced: bool, scale: float) -> Tensor:
        forward_op, backward_op, grad_name = attention_block_ops(query.device.type, query.dtype)
        fwd_kwargs = _forward_kwargs(forward_op, scale)
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out, lse, *rest = ring_attention_forward(group, forward_op, query, key, value, causal, balanced, **fwd_kwargs)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.args = (group, causal, balanced, scale, backward_op, grad_name, _backward_kwargs(forward_op, rest, scale))
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        group, causal, balanced, scale, backward_op, grad_name, bwd_kwargs = ctx.args
        dq, dk, dv, *_ = ring_attention_backward(group, backward_op, grad_out.contiguous(), grad_name, query, key,
                                                 value, out, lse, causal, balanced, **bwd_kwargs)
        return dq, dk, dv, None, None, None, None


def _forward_kwargs(op, scale: float) -> dict:
    if "efficient" in op.name():
        return dict(attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, scale=scale)
    return dict(dropout_p=0.0, scale=scale)


def _backward_kwargs(op, rest: list, scale: float) -> dict:
    """The block backward's extra arguments, from the forward kernel's extra outputs (dropout is off, so the random
    state they carry is unused)."""
    name = op.name()
    if "efficient" in name:
        seed, offset = rest[:2]
        return dict(attn_bias=None, philox_seed=seed, philox_offset=offset, dropout_p=0.0,
                    grad_input_mask=(True, True, True, False), scale=scale)
    if "for_cpu" in name:
        return dict(dropout_p=0.0, scale=scale)
    cum_q, cum_k, max_q, max_k, rng_state, unused = rest[:6]
    return dict(cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k, dropout_p=0.0, philox_seed=rng_state,
                philox_offset=unused, scale=scale)


def ring_attention(query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup | None = None,
                   causal: bool = True, layout: str = "zigzag", scale: float | None = None) -> Tensor:
    """Attention of this rank's queries to the keys and values of the whole sequence, sharded over ``group``.

    ``query``/``key``/``value``: ``(batch, heads, local sequence, head dim)``, this rank's slice in ``layout``
    (``sharding.shard_sequence`` along dim 2, or of the tokens before the projections along dim 1). Returns this
    rank's slice of the output, equal to the matching rows of full-sequence ``scaled_dot_product_attention``. No
    dropout (attention dropout needs a mask consistent across the ring, which torch's ring does not draw). With a
    group of one rank (or ``None`` outside a distributed run) it is plain SDPA.
    """
    cp = dist.get_world_size(group) if dist.is_initialized() else 1
    check_ring_inputs(query, key, value, cp, layout, causal)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if cp == 1:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale)
    if group is None:
        group = dist.group.WORLD
    return _RingAttention.apply(query, key, value, group, causal, causal and layout == "zigzag", scale)
