"""The distributed machinery under the strategy: the layout and its process groups, gradient synchronisation,
weight-gradient fusion, the sharded optimizer (ZeRO-1) and dropout's random streams.

None of it knows Lightning: the strategy (``lightning_3d.strategies``) composes these pieces, and the planner,
benchmarks and tests use them through the names below. One module per job (docs/architecture.md, "The pieces"):

- ``parallel_dims``: ``ParallelDims``, the validated (dp, pp, cp, tp) layout and its device mesh;
- ``process_groups``: ``ProcessGroups``, every group one run needs, and their lifetime in the process;
- ``grad_sync``: ``GradientSynchronizer``, data-parallel buckets, tied-embedding sync, global-norm clipping;
- ``wgrad_fusion``: weight gradients of ``nn.Linear`` accumulated inside the backward's GEMM;
- ``sharded_optimizer``: ``ShardedOptimizer``, each replica's 1/dp of the optimizer state;
- ``rng``: per-rank dropout streams (``ParallelDropout``, ``seed_parallel_rng``).
"""

from lightning_3d.distributed.grad_sync import DEFAULT_BUCKET_SIZE_MB, GradientSynchronizer, clip_grad_norm_
from lightning_3d.distributed.parallel_dims import ParallelDims, resolve_sizes
from lightning_3d.distributed.process_groups import ProcessGroups
from lightning_3d.distributed.rng import ParallelDropout, seed_parallel_rng
from lightning_3d.distributed.sharded_optimizer import ShardedOptimizer
from lightning_3d.distributed.wgrad_fusion import (
    check_fusion_mode,
    fusable_linears,
    fuse_gradient_accumulation,
    unfuse_gradient_accumulation,
)

__all__ = [
    "DEFAULT_BUCKET_SIZE_MB", "GradientSynchronizer", "ParallelDims", "ParallelDropout", "ProcessGroups",
    "ShardedOptimizer", "check_fusion_mode", "clip_grad_norm_", "fusable_linears", "fuse_gradient_accumulation",
    "resolve_sizes", "seed_parallel_rng", "unfuse_gradient_accumulation",
]
