"""Packed rows as the cost model sees them: first-fit-decreasing packing of samples into rows, the attention work
a row's document mask makes the device do, and the per-stage costs of micro-batches of packed rows.

A packed micro-batch of R rows of L tokens runs the linear parts of every layer (projections, MLP, norms, the head)
on R x L tokens, exactly as a padded micro-batch of that shape, so the cost model prices them as such. Attention
is where they differ (docs/dynamic.md, "Choosing per step"):

- ``"flex"`` (GPT, FlexAttention's block mask, ``document_block_mask``): blocks of ``FLEX_BLOCK`` queries by keys
  that hold no (same document, key <= query) pair are skipped; the others run. A row of short documents costs
  about the documents' own attention, not the row's.
- ``"dense"`` (GPT with SDPA's dense (R, 1, L, L) boolean mask): every block of the row is computed, twice causal
  attention's blocks, and the mask itself (L^2 bytes a row) is held while a stage runs.

Both are counted in blocks of ``FLEX_BLOCK`` and priced as the cost model's own causal attention on the same rows
times the ratio of blocks (``stage_costs.causal_attention_seconds``): how many blocks run is what changes, not the
kernels' speed per block, which the cost model does not separate. T5's packed rows attend with dense masks over
whole rows, as its padded rows already do (the encoder attends over the whole padded input, the relative position
bias is an additive mask), so they cost what a padded micro-batch of their shape costs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FLEX_BLOCK = 128  # torch's FlexAttention block size (create_block_mask's default), queries and keys
PACKED_ATTENTIONS = ("flex", "dense")


def first_fit_decreasing(lengths: Sequence[tuple[int, int]], capacity: tuple[int, int]) -> list[list[int]]:
    """Rows of sample indices: samples by decreasing (sequence, target) length (ties by index), each into the first
    row with room for both, else a new row; rows keep their samples in order of placement. Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i][0], -lengths[i][1], i))
    rows: list[list[int]] = []
    free: list[list[int]] = []
    for i in order:
        s, t = lengths[i]
        if s > capacity[0] or t > capacity[1]:
            raise ValueError(f"A sample of {s} (+{t} target) tokens does not fit a packed row of {capacity[0]}"
                             f" (+{capacity[1]}) tokens; raise seq_length/target_length or truncate the data.")
        for r, (fs, ft) in enumerate(free):
            if s <= fs and t <= ft:
                rows[r].append(i)
                free[r] = [fs - s, ft - t]
                break
        else:
            rows.append([i])
            free.append([capacity[0] - s, capacity[1] - t])
    return rows


def split_row(row: Sequence[int], tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """A packed row of two or more documents (sample indices; ``tokens[i]`` sample i's tokens) as two rows: its
    documents by decreasing tokens (ties: the earlier first), each to the half of fewer tokens so far (ties: the
    first), each half in the row's order. Each half is part of the row, so it fits wherever the row did."""
    if len(row) < 2:
        raise ValueError(f"a row of {len(row)} document(s) cannot be split into two rows.")
    halves: tuple[list[int], list[int]] = ([], [])
    load = [0, 0]
    for pos in sorted(range(len(row)), key=lambda p: (-tokens[row[p]], p)):
        half = 0 if load[0] <= load[1] else 1
        halves[half].append(pos)
        load[half] += tokens[row[pos]]
    first, second = (sorted(h) for h in halves)
    return [row[p] for p in first], [row[p] for p in second]


def packed_groups_to_multiple(groups: Sequence[Sequence[Sequence[int]]], tokens: Sequence[int],
                              multiple: int) -> list[list[list[int]]]:
    """Micro-batches of packed rows (each a list of rows of sample indices; ``tokens[i]`` sample i's tokens), split
    until their count is a multiple of ``multiple`` (interleaved schedules run a multiple of pp micro-batches): the
    micro-batch of most rows is halved (the first on ties), as padded micro-batches are; once every micro-batch is a
    single row, the row of most documents (the first on ties) becomes two rows (:func:`split_row`). A packed row's
    documents attend only within themselves and their positions restart at each document, so dealing them to two
    rows trains the same tokens the same way up to floating-point summation order, only with another padding tail.
    ValueError when every micro-batch is one row of one document."""
    out = [[list(row) for row in group] for group in groups]
    while len(out) % multiple:
        big = max(range(len(out)), key=lambda k: (len(out[k]), -k))
        if len(out[big]) >= 2:
            half = len(out[big]) // 2
            out[big : big + 1] = [out[big][:half], out[big][half:]]
            continue
        big = max(range(len(out)), key=lambda k: (len(out[k][0]), -k))
        if len(out[big][0]) < 2:
            raise ValueError(f"{len(out)} micro-batches cannot become a multiple of {multiple}: every micro-batch"
                             " holds one row of one document.")
        out[big : big + 1] = [[half] for half in split_row(out[big][0], tokens)]
    return out


def causal_blocks(row_len: int, block: int = FLEX_BLOCK) -> int:
    """Blocks causal attention over one row computes: the lower triangle of ceil(L / block) blocks, diagonal in."""
    nb = -(-row_len // block)
    return nb * (nb + 1) // 2


def document_blocks(doc_lengths: Sequence[int], row_len: int, attention: str, block: int = FLEX_BLOCK) -> int:
    """Blocks one packed row computes under ``attention``: ``"dense"`` all of them; ``"flex"`` those holding a
    (same document, key <= query) pair. The padding tail after the documents is one more document (the collators
    give it its own id), so it attends causally within itself. Documents are contiguous: a query block sees keys
    back to the start of the document of its first query, so its key blocks run from that start's block to its
    own."""
    nb = -(-row_len // block)
    if attention == "dense":
        return nb * nb
    if attention != "flex":
        raise ValueError(f"attention={attention!r}: use one of {PACKED_ATTENTIONS}.")
    lengths = [int(x) for x in doc_lengths if x > 0]
    used = sum(lengths)
    if used > row_len:
        raise ValueError(f"documents of {used} tokens do not fit a row of {row_len}.")
    if used < row_len:
        lengths.append(row_len - used)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    first_query = np.arange(nb) * block
    doc_start = starts[np.searchsorted(starts, first_query, side="right") - 1]
    return int(np.sum(np.arange(nb) - doc_start // block + 1))


def attention_ratio(rows: Sequence[Sequence[int]], row_len: int, attention: str) -> float:
    """Blocks the rows' document masks compute over those of causal attention on the same rows (the factor
    ``stage_costs.evaluate`` applies to GPT blocks' causal attention)."""
    return sum(document_blocks(r, row_len, attention) for r in rows) / (len(rows) * causal_blocks(row_len))


def dense_mask_bytes(rows, row_len):
    """SDPA's dense boolean document mask of a micro-batch (scalars or arrays): one byte per (query, key) pair of
    every row."""
    length = np.asarray(row_len, dtype=np.float64)
    return np.asarray(rows, dtype=np.float64) * length * length
