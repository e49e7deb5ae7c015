"""Context parallelism inside ``Compressed3DStrategy``: what a module must offer, and each rank's slice of a batch.

The strategy's part of docs/context_parallel.md: before any collective, ``check_context_module`` refuses modules
that cannot run attention over a cp group (a plain LightningModule, a protocol module without
``enable_context_parallel``); after the stages are built, ``enable_context_parallel`` hands each stage the cp group;
at every step ``shard_microbatches`` gives this rank its (zigzag or contiguous) slice of every sequence entry of
every micro-batch, plus the slice's global ``position_ids``. Gradients, loss normalisation and checkpoints need no
code here: the strategy's "data-parallel" group is the dp x cp group (``ProcessGroups.dp_group``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.context import ContextParallelConfig, check_layout, shard_batch
from lightning_3d.pipeline.microbatch import MicroBatches

DEFAULT_KEYS = ("input_ids", "labels")


def check_context_module(module: nn.Module, config: ContextParallelConfig, protocol: bool) -> None:
    """Raise (on every rank alike: same module, no communication) where ``module`` cannot train with
    ``config.size`` > 1 context-parallel ranks."""
    if not config.enabled:
        return
    name = type(module).__name__
    if not protocol or not callable(getattr(module, "enable_context_parallel", None)):
        raise TypeError(
            f"context_parallel_size={config.size} needs a module whose attention runs over the context-parallel group:"
            f" {name} does not implement `enable_context_parallel(stage, group, layout, attention)` (with the"
            " `lightning_3d.Parallel3DModule` protocol; the GPT recipe does). Use context_parallel_size=1 for it."
        )


def enable_context_parallel(module: nn.Module, stages: dict[int, nn.Module], group: dist.ProcessGroup,
                            config: ContextParallelConfig) -> None:
    """Let every stage of this rank attend over ``group`` (the module validates what it supports and raises)."""
    for stage in stages.values():
        module.enable_context_parallel(stage, group, config.layout, config.attention)


def sequence_keys(module: nn.Module) -> tuple[str, ...]:
    """The batch entries holding a sequence dimension (dim 1) to slice: the module's ``context_parallel_keys``, else
    ``("input_ids", "labels")``."""
    return tuple(getattr(module, "context_parallel_keys", DEFAULT_KEYS))


def shard_microbatches(microbatches: Sequence[Any], config: ContextParallelConfig, cp_rank: int,
                       keys: tuple[str, ...], sequence_parallel_size: int = 1) -> Sequence[Any]:
    """This cp rank's slice of every micro-batch (``MicroBatches`` keep their explicit ``orders``). Every check runs
    on the whole list before anything is returned, so all cp ranks of a replica (which hold the same batch) raise the
    same error before the step's first collective."""
    if not config.enabled:
        return microbatches
    for i, mb in enumerate(microbatches):
        where = f"micro-batch {i}"
        if not isinstance(mb, dict):
            raise TypeError(f"Context parallelism slices dict micro-batches, got {type(mb).__name__} ({where}).")
        if mb.get("document_ids") is not None:
            raise ValueError(
                f"Packed documents (`document_ids` in {where}) are not supported with context_parallel_size="
                f"{config.size}: ring attention has no per-document mask. Train packed rows with"
                " context_parallel_size=1, or unpacked sequences."
            )
        if "position_ids" in mb:
            raise ValueError(f"{where} already holds `position_ids`; with context_parallel_size={config.size} the strategy"
                             " sets them from each rank's slice (global positions). Drop them from the batch.")
        for key in keys:
            value = mb.get(key)
            if not isinstance(value, Tensor) or value.dim() < 2:
                raise ValueError(f"Context parallelism slices `{key}` of every micro-batch along dim 1, but {where} has"
                                 f" {type(value).__name__ if not isinstance(value, Tensor) else tuple(value.shape)};"
                                 f" give (batch, sequence) tensors, or name the sequence entries in the module's"
                                 " `context_parallel_keys`.")
        check_layout(mb[keys[0]].shape[1], config.size, config.layout, sequence_parallel_size)
    sliced = [shard_batch(mb, config.size, cp_rank, config.layout, keys) for mb in microbatches]
    if isinstance(microbatches, MicroBatches):
        return MicroBatches(sliced, orders=getattr(microbatches, "orders", None))
    return sliced
