"""Ulysses attention: context parallelism by an all-to-all over heads (DeepSpeed Ulysses), the alternative to the ring.

Each rank holds its sequence slice of every head. One all-to-all trades it for the whole sequence of ``heads / cp``
heads; each rank runs ordinary SDPA (causal or full, any kernel, the whole sequence in natural order) on its heads;
a second all-to-all trades the output back to sequence slices. The same three all-to-alls run in reverse in the
backward (``torch.distributed.nn.functional.all_to_all_single`` is differentiable). In the forward a rank sends
about ``4 · b · S · h / cp`` elements per layer (q, k and v out, the output back), falling with cp, where the ring
sends ``2 · b · S · h · (cp − 1) / cp`` (K and V, cp − 1 times), about constant; but the heads must divide by cp, and
tensor parallelism has already divided them once. Activation memory equals the ring's (local slice of all heads, or the whole
sequence of a share of the heads). Slices follow ``sharding.py``'s layouts, so the same batch slicing serves both.
See docs/context_parallel.md.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.nn.functional import all_to_all_single

from lightning_3d.context.ring_attention import check_attention_shapes
from lightning_3d.context.sharding import shard_sequence, unshard_sequence


def check_ulysses_heads(heads: int, cp: int) -> None:
    """Raise a ValueError naming the fix if ``heads`` (this rank's, after tensor parallelism) do not divide by cp."""
    if heads % cp != 0:
        raise ValueError(f"Ulysses attention splits the heads over the context-parallel ranks, but this rank's {heads}"
                         f" heads are not divisible by context_parallel_size={cp}: use ring attention, or a cp size"
                         f" that divides {heads} (the heads per tensor-parallel rank).")


def _exchange(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-to-all of ``x`` of shape ``(cp, ...)``: entry j goes to rank j; entry j of the result came from rank j."""
    x = x.contiguous()
    return all_to_all_single(torch.empty_like(x), x, group=group)


def _sequence_to_heads(x: Tensor, group: dist.ProcessGroup, cp: int, layout: str) -> Tensor:
    """(b, heads, local sequence, d) slices of all heads -> (b, heads / cp, sequence, d), natural token order."""
    b, h, s, d = x.shape
    received = _exchange(x.view(b, cp, h // cp, s, d).transpose(0, 1), group)  # [j]: rank j's slice of my heads
    return unshard_sequence(list(received.unbind(0)), layout, dim=2)


def _heads_to_sequence(y: Tensor, group: dist.ProcessGroup, cp: int, layout: str) -> Tensor:
    """(b, heads / cp, sequence, d) -> this rank's slice of all heads, (b, heads, local sequence, d)."""
    slices = torch.stack([shard_sequence(y, cp, rank, layout, dim=2) for rank in range(cp)])  # [j]: rank j's tokens
    received = _exchange(slices, group)  # [j]: my tokens of rank j's heads
    cp_, b, h, s, d = received.shape
    return received.transpose(0, 1).reshape(b, cp_ * h, s, d)


def ulysses_attention(query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup | None = None,
                      causal: bool = True, layout: str = "zigzag", scale: float | None = None) -> Tensor:
    """Attention of this rank's slice (``(batch, heads, local sequence, head dim)``, ``layout`` as in
    ``sharding.py``) over the whole sequence, by all-to-alls over heads; returns this rank's slice of the output, like
    ``ring_attention``. Heads must divide by the group's size."""
    cp = dist.get_world_size(group) if dist.is_initialized() else 1
    check_attention_shapes(query, key, value, layout)
    check_ulysses_heads(query.shape[1], cp)
    if layout == "zigzag" and cp > 1 and query.shape[2] % 2 != 0:
        raise ValueError(f"A zigzag slice holds two equal chunks, but the local sequence length is {query.shape[2]}"
                         f" (odd): make the full sequence a multiple of 2 x context_parallel_size = {2 * cp}.")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if cp == 1:
        return F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale)
    if group is None:
        group = dist.group.WORLD
    q, k, v = (_sequence_to_heads(t, group, cp, layout) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return _heads_to_sequence(out, group, cp, layout)
