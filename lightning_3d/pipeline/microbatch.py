"""Splitting a batch into micro-batches, and the shape signature that keys the boundary-shape cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor


class MicroBatches(list):
    """A batch that is already a list of micro-batches, each with its own shapes.

    Return one from a data loader (or a collate function) to run a step with a different number of
    micro-batches or different micro-batch shapes than the strategy's ``num_microbatches``: the pipeline
    takes the list as is. Dynamic micro-batching produces these.

    ``orders`` (optional): this step's explicit schedule, one tuple of ``Action`` per pipeline rank, in place of the
    strategy's named schedule (e.g. a memory-aware order of micro-batches of different sizes). The runtime checks it
    with the schedule simulator (``check_schedule``) before any communication and recomputes the ``epilogue``
    marks from the order, so only ``kind``, ``stage`` and ``microbatch`` matter. Every rank must pass the same
    orders. The attribute survives Lightning's device transfer (the strategy copies it).
    """

    def __init__(self, microbatches: Any = (), orders: Sequence[Sequence[Any]] | None = None) -> None:
        super().__init__(microbatches)
        self.orders = None if orders is None else tuple(tuple(order) for order in orders)


def split_batch(batch: Any, num_microbatches: int, uneven: bool = False) -> list[Any]:
    """Split every tensor of a (nested dict/list/tuple) batch into equal chunks along dim 0.

    ``uneven`` (evaluation): a batch that does not divide, such as the last, partial batch of a validation set, is
    split into ``min(num_microbatches, size)`` chunks whose sizes differ by at most one. The loss is a token-weighted
    sum over micro-batches, so the result is exact; training keeps the error, which points at a misconfiguration.
    """
    if isinstance(batch, MicroBatches):
        if len(batch) == 0:
            raise ValueError("A MicroBatches batch must hold at least one micro-batch.")
        return MicroBatches(batch, orders=getattr(batch, "orders", None))
    sizes = {t.shape[0] for t in _tensors(batch)}
    if not sizes:
        raise ValueError("The batch holds no tensors to split into micro-batches.")
    if len(sizes) > 1:
        raise ValueError(f"The batch's tensors disagree on the batch dimension: sizes {sorted(sizes)}.")
    size = sizes.pop()
    if uneven and size % num_microbatches != 0:
        count = min(num_microbatches, size)
        bounds = [size * i // count for i in range(count + 1)]
        return [_slice(batch, bounds[i], bounds[i + 1]) for i in range(count)]
    if size % num_microbatches != 0:
        raise ValueError(
            f"The batch of {size} samples cannot be split into num_microbatches={num_microbatches} equal"
            f" micro-batches. Make the per-replica batch size a multiple of {num_microbatches}, or pass a"
            f" `MicroBatches` list."
        )
    chunk = size // num_microbatches
    return [_slice(batch, i * chunk, (i + 1) * chunk) for i in range(num_microbatches)]


def signature(microbatch: Any) -> tuple:
    """Shapes and dtypes of a micro-batch's tensors, in a fixed traversal order."""
    return tuple((tuple(t.shape), t.dtype) for t in _tensors(microbatch))


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_slice(v, start, stop) for v in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return type(batch)(_slice(v, start, stop) for v in batch)
    return batch


def _tensors(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for k in sorted(batch, key=str) for t in _tensors(batch[k])]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return [t for item in batch for t in _tensors(item)]
    return []

