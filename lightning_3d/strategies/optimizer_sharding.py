"""The optimizer's side of the strategy: ZeRO-1 (``RuntimeConfig.shard_optimizer_state``: each replica steps its
range of every gradient bucket, distributed/sharded_optimizer.py) or, without it, tensor parallelism's local shards
(``local_optimizer``); and the refusal of distributed optimizer wrappers that would cross pipeline and tensor ranks.
Called by the ``PipelineEngine`` once the user's optimizers exist (docs/sharded_optimizer.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_3d.distributed.grad_sync import GradientSynchronizer
from lightning_3d.distributed.process_groups import ProcessGroups
from lightning_3d.distributed.sharded_optimizer import ShardedOptimizer, local_optimizer, units_of

_DISTRIBUTED_OPTIMIZER_MODULES = ("torch.distributed.optim", "apex.contrib.optimizers", "deepspeed", "megatron")


def shard_optimizers(optimizers: Sequence[Optimizer], module: pl.LightningModule, g: ProcessGroups,
                     tied: list[nn.Parameter], grad_sync: GradientSynchronizer, enabled: bool,
                     ) -> tuple[ShardedOptimizer | None, list[ShardedOptimizer]]:
    """With ``shard_optimizer_state``: rewrite the optimizer to step on this replica's range of every gradient
    bucket and have the synchronizer reduce-scatter those buckets (docs/sharded_optimizer.md). With dp = 1 there
    is nothing to shard over: the option does nothing. The replicas are dp x cp (context-parallel ranks hold the
    same parameters and reduce gradients with the data-parallel ones), ranked as in ``dp_group``."""
    local_pieces: list[ShardedOptimizer] = []
    fqns = {id(p): n for n, p in module.named_parameters()}
    tied_skip = {id(p) for p in tied} if g.pp_rank == g.dims.pp - 1 else set()
    if not enabled or g.dims.replicas == 1:
        if enabled:
            rank_zero_info("Compressed3DStrategy: shard_optimizer_state=True does nothing with one replica"
                           " (data_parallel_size x context_parallel_size = 1: nothing to shard over).")
        # Tensor-parallel (DTensor) parameters: the optimizer steps their local shards (local_optimizer says why).
        for opt in optimizers:
            opt = getattr(opt, "_optimizer", opt)
            pieces = local_optimizer(opt, fqns, g.tp_rank, tied_skip)
            if pieces is not None:
                local_pieces.append(pieces)
            elif any(isinstance(p, DTensor) for group in opt.param_groups for p in group["params"]):
                rank_zero_info(f"Compressed3DStrategy: {type(opt).__name__} is not a known element-wise optimizer,"
                               " so it steps the DTensor parameters themselves (correct, but slow on the host).")
        return None, local_pieces
    if len(optimizers) != 1:
        raise ValueError(
            f"shard_optimizer_state=True shards one optimizer, but configure_optimizers returned {len(optimizers)};"
            " put all parameters into one optimizer (param groups may differ), or pass shard_optimizer_state=False."
        )
    optimizer = getattr(optimizers[0], "_optimizer", optimizers[0])
    sharded = ShardedOptimizer(optimizer, units_of(optimizer, [b.params for b in grad_sync.buckets]),
                               fqns, g.dp_group, g.dims.replicas, dist.get_rank(g.dp_group), g.tp_rank, tied_skip)
    grad_sync.scatter = sharded.scatter_keys(full={id(p) for p in tied})
    return sharded, []


def check_optimizers(optimizers: Sequence[Optimizer]) -> None:
    """No distributed optimizer wrapper (``ZeroRedundancyOptimizer``, apex's ``DistributedFusedAdam``, ...): the
    strategy already averages every gradient over its replicas and steps each pipeline/tensor rank's own parameters;
    those wrappers shard or synchronise optimizer work over the default group, which spans pipeline and tensor ranks
    holding different parameters. The strategy's own ``shard_optimizer_state`` does what they are for."""
    wrapped = [f"{type(o).__name__} ({type(o).__module__})" for o in (getattr(o, "_optimizer", o) for o in optimizers)
               if type(o).__module__.startswith(_DISTRIBUTED_OPTIMIZER_MODULES)]
    if wrapped:
        raise TypeError(
            f"Compressed3DStrategy does not take {', '.join(wrapped)}: it would shard or synchronise optimizer state"
            " across ranks that hold different parameters (pipeline stages, tensor shards). Return a plain torch.optim"
            " optimizer (e.g. AdamW) from configure_optimizers and pass Compressed3DStrategy(shard_optimizer_state=True)"
            " to shard its state over the data-parallel replicas."
        )
