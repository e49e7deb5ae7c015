"""Which tokens of a sequence each context-parallel rank holds, their positions, and the way back.

A sequence of length ``S`` is cut into chunks along its sequence dimension:

- ``"contiguous"``: rank ``r`` of ``cp`` holds tokens ``[r·S/cp, (r+1)·S/cp)``. Simple, but under causal attention
  the last rank attends to the whole sequence and the first to its own chunk only: rank ``r``'s work grows like
  ``2r + 1``.
- ``"zigzag"`` (load-balanced, the default): the sequence is cut into ``2·cp`` chunks and rank ``r`` holds chunks ``r``
  and ``2·cp − 1 − r``, in that order. An early chunk (little causal work) is paired with a late one (much), so every
  rank does exactly the same causal work (``causal_pairs``; Megatron-LM's and torch's load-balanced layout, which the
  ring attention in ``ring_attention.py`` assumes).

Everything here is index arithmetic on one process: ``shard_sequence`` / ``unshard_sequence`` are exact inverses,
``position_ids`` are the global positions of the local tokens (what a position embedding or RoPE must be given
instead of ``arange(local_length)``), and ``gather_sequence`` is the one collective (an all-gather over the cp group)
that rebuilds the full sequence on every rank. See docs/context_parallel.md.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")


def check_layout(seq_len: int, cp: int, layout: str, sequence_parallel_size: int = 1) -> None:
    """Raise a ValueError naming the bad value and the fix if ``seq_len`` tokens cannot be split over ``cp`` ranks in
    ``layout`` (and, with Megatron sequence parallelism over ``sequence_parallel_size`` tensor-parallel ranks, each
    rank's slice once more). Pure: call it on every rank before any collective."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown context-parallel layout {layout!r}; use one of {LAYOUTS}.")
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"The context-parallel size must be a positive integer, got {cp!r}.")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"The sequence length must be a positive integer, got {seq_len!r}.")
    chunks = num_chunks(cp, layout)
    if seq_len % chunks != 0:
        fix = f"pad or cut sequences to a multiple of {chunks}"
        if layout == "zigzag":
            fix += " (zigzag cuts a sequence into 2 x cp chunks), or use layout='contiguous' (a multiple of cp)"
        raise ValueError(
            f"Sequence length {seq_len} cannot be split over context_parallel_size={cp} in the {layout!r} layout: it is"
            f" not divisible by {chunks}; {fix}."
        )
    local = seq_len // cp
    if local % sequence_parallel_size != 0:
        raise ValueError(
            f"Sequence length {seq_len} over context_parallel_size={cp} leaves {local} tokens per rank, which sequence"
            f" parallelism cannot split over tensor_parallel_size={sequence_parallel_size}; make the sequence a"
            f" multiple of {math.lcm(chunks, cp * sequence_parallel_size)}."
        )


def num_chunks(cp: int, layout: str) -> int:
    """How many equal chunks a sequence is cut into: ``cp`` (contiguous) or ``2·cp`` (zigzag)."""
    return 2 * cp if layout == "zigzag" else cp


def rank_chunks(cp: int, rank: int, layout: str) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in the order it holds them."""
    if not 0 <= rank < cp:
        raise ValueError(f"Context-parallel rank {rank} is outside [0, {cp}).")
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)


def position_ids(seq_len: int, cp: int, rank: int, layout: str = "zigzag",
                 device: torch.device | str | None = None) -> Tensor:
    """Global positions (int64, shape ``(seq_len // cp,)``) of the tokens rank ``rank`` holds, in local order."""
    check_layout(seq_len, cp, layout)
    size = seq_len // num_chunks(cp, layout)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in rank_chunks(cp, rank, layout)])


def shard_sequence(x: Tensor, cp: int, rank: int, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """This rank's slice of ``x`` along ``dim`` (a copy only where zigzag concatenates two chunks)."""
    seq_len = x.shape[dim]
    check_layout(seq_len, cp, layout)
    chunks = x.chunk(num_chunks(cp, layout), dim=dim)
    mine = [chunks[c] for c in rank_chunks(cp, rank, layout)]
    return mine[0] if len(mine) == 1 else torch.cat(mine, dim=dim)


def unshard_sequence(slices: list[Tensor], layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The full sequence from every rank's slice (``slices[r]`` from rank ``r``): the inverse of ``shard_sequence``."""
    cp = len(slices)
    if cp == 0:
        raise ValueError("unshard_sequence needs the slices of every context-parallel rank, got none.")
    lengths = {s.shape[dim] for s in slices}
    if len(lengths) != 1:
        raise ValueError(f"Context-parallel slices must have equal lengths along dim {dim}, got {sorted(lengths)}.")
    per_rank = len(rank_chunks(cp, 0, layout))
    if lengths.pop() % per_rank != 0:
        raise ValueError(f"A {layout!r} slice holds {per_rank} equal chunks; its length must be divisible by {per_rank}.")
    ordered: list[Tensor | None] = [None] * num_chunks(cp, layout)
    for rank, local in enumerate(slices):
        for c, piece in zip(rank_chunks(cp, rank, layout), local.chunk(per_rank, dim=dim)):
            ordered[c] = piece
    return torch.cat(ordered, dim=dim)


def gather_sequence(local: Tensor, group: dist.ProcessGroup | None = None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The full sequence on every rank of the cp ``group``: an all-gather of the slices, then ``unshard_sequence``.
    Not differentiable (evaluation, generation, debugging)."""
    cp = dist.get_world_size(group)
    slices = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(slices, local.contiguous(), group=group)
    return unshard_sequence(slices, layout, dim)


def shard_batch(batch: dict, cp: int, rank: int, layout: str = "zigzag", keys: tuple[str, ...] = ("input_ids", "labels"),
                positions_key: str = "position_ids") -> dict:
    """This rank's part of a batch of ``(batch, sequence, ...)`` tensors: ``keys`` sliced along dim 1 (labels already
    shifted on the full sequence, so each slice keeps its own targets), every other entry as given, and the global
    positions of the slice under ``positions_key``, shape ``(batch, local sequence)`` (one row per sample, so that
    splitting the batch into micro-batches along dim 0 splits them too). What the strategy does to each per-replica
    batch before splitting it into micro-batches (docs/context_parallel.md)."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"The batch has no {missing} to split over the context-parallel ranks (it has {sorted(batch)});"
                         " name the sequence entries in `keys`.")
    lengths = {k: batch[k].shape[1] if batch[k].dim() > 1 else None for k in keys}
    if len(set(lengths.values())) != 1 or None in lengths.values():
        raise ValueError(f"The sequence entries must be (batch, sequence, ...) tensors of one length, got {lengths}.")
    if positions_key in batch:
        raise ValueError(f"The batch already has {positions_key!r}; context parallelism sets it from the slice.")
    seq_len = next(iter(lengths.values()))
    out = {k: shard_sequence(v, cp, rank, layout, dim=1) if k in keys else v for k, v in batch.items()}
    rows = batch[keys[0]].shape[0]
    out[positions_key] = position_ids(seq_len, cp, rank, layout, device=batch[keys[0]].device).expand(rows, -1)
    return out


def causal_pairs(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> int:
    """(query, key) pairs that causal attention computes on rank ``rank``: each query at global position ``p``
    attends to ``p + 1`` keys, so this is the rank's share of causal attention FLOPs (exactly proportional)."""
    return int((position_ids(seq_len, cp, rank, layout) + 1).sum())
