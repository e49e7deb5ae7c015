"""ProcessGroups: every process group one run of ``Compressed3DStrategy`` needs, and their lifetime in the process.

A ``ProcessGroups`` is built at ``setup_environment`` from the layout (``ParallelDims``) and holds the
("dp", "pp", ["cp",] "tp") device mesh, the context-parallel ring's group and the dp x cp group of the replicated
parameters' gradients (docs/context_parallel.md), the extra groups (the model-parallel group of the global gradient norm, the
tied-embedding pairs and the fused embedding-sync groups) and the pipeline's transport (one group per pipeline, see
``_pipeline_channels``), all created with the strategy's ``timeout``, plus this rank's coordinates. The groups of the last
run stay alive after its
teardown, because a prepared module is bound to them (its stages hold the channels, its tensor-parallel parameters
the mesh); ``claim_live_groups`` destroys the previous run's groups (after its owner released its model) before new
ones are made, so a process holds one set of groups, with their threads and sockets, however many models it trains.
``register_exit_hook`` destroys them while the interpreter still runs normally (see ``_shutdown_at_exit``).
See docs/architecture.md (Lifecycle).
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_3d.distributed.parallel_dims import ParallelDims, new_subgroups
from lightning_3d.pipeline.p2p import PipelineChannels
from lightning_3d.utils.compat import clear_dtensor_caches


class ProcessGroups:
    """The mesh, the extra groups and the pipeline channels of one run, and this rank's place in them.

    Collective over the world: every rank constructs it at the same point (``setup_environment``). The groups it
    creates (this rank's own ones) are listed in ``created``, in creation order, for ``destroy``. ``virtual_stages``
    is accepted for its callers and unused: a pipeline has one stream however many stages each rank holds.
    """

    def __init__(
        self, dims: ParallelDims, rank: int, device: torch.device, virtual_stages: int, timeout: timedelta | None
    ) -> None:
        self.dims = dims
        self.rank = rank
        self.dp_rank, self.pp_rank, self.tp_rank = dims.coordinates(rank)
        self.cp_rank = dims.cp_rank(rank)
        self.created: list[dist.ProcessGroup] = []
        try:
            self._build(device, timeout)
        except BaseException:
            self.destroy()  # the groups made before the failure must not outlive it
            raise

    def _build(self, device: torch.device, timeout: timedelta | None) -> None:
        made, d, rank = self.created, self.dims, self.rank
        self.device_mesh: DeviceMesh | None = d.build_mesh(device.type, timeout, made)
        self.tp_mesh: DeviceMesh | None = self.device_mesh["tp"]
        # Context parallelism: the ring of each (dp, pp, tp) position, and the group every use of ``dp_group`` needs
        # then, the ranks holding the same parameters (fixed pp, tp; all dp, cp): gradient reduction (and SC), the
        # loss terms' normalisation, the initial parameter broadcast. With cp = 1 it is the mesh's "dp" group.
        self.cp_group: dist.ProcessGroup | None = self.device_mesh.get_group("cp") if d.cp > 1 else None
        self.dp_group: dist.ProcessGroup | None = self.device_mesh.get_group("dp")
        if d.cp > 1:
            replicas = [[d.rank_of(dp, p, t, c) for dp in range(d.dp) for c in range(d.cp)]
                        for p in range(d.pp) for t in range(d.tp)]
            self.dp_group = new_subgroups(replicas, rank, timeout=timeout, created=made)
        positions = [(dp, c) for dp in range(d.dp) for c in range(d.cp)]  # (dp, cp): one model replica's ranks each
        # All pipeline and tensor ranks of one replica: the group a global gradient norm is summed over.
        self.model_parallel_group = new_subgroups(
            [[d.rank_of(dp, p, t, c) for p in range(d.pp) for t in range(d.tp)] for dp, c in positions], rank,
            timeout=timeout, created=made,
        )
        # First and last pipeline rank of each (dp, cp, tp) pipeline: where tied embedding gradients meet.
        tied_pairs = [[d.rank_of(dp, 0, t, c), d.rank_of(dp, d.pp - 1, t, c)] for dp, c in positions for t in range(d.tp)]
        self.tied_group = new_subgroups(tied_pairs, rank, timeout=timeout, created=made) if d.pp > 1 else None
        # Fused embedding sync: first and last stage of every replica, one group per tensor-parallel rank
        # (a group spanning tensor ranks would add up different vocabulary shards).
        fused = [[d.rank_of(dp, p, t, c) for dp, c in positions for p in (0, d.pp - 1)] for t in range(d.tp)]
        self.fused_tied_group = new_subgroups(fused, rank, timeout=timeout, created=made) if d.pp > 1 else None
        self.channels: PipelineChannels | None = self._pipeline_channels(device, timeout)

    def _pipeline_channels(self, device: torch.device, timeout: timedelta | None) -> PipelineChannels:
        """The transport of this rank's pipeline, on a group of its own per pipeline (docs/architecture.md, "Pipeline
        transport"): nothing else is ever issued on it, so its order is the schedule's, and it carries the strategy's
        ``timeout`` (the mesh's "pp" dimension is the default group when it spans the world, with the user's timeout).
        On NCCL the shape headers travel on a CPU (gloo) group per pipeline. ``new_group`` is called for every pipeline
        (one per (dp, cp, tp) position), as torch requires of every rank; a rank joins only its own pipeline's groups."""
        d = self.dims
        ranks = d.pipeline_ranks(self.dp_rank, self.tp_rank, self.cp_rank)
        if d.pp == 1:
            return PipelineChannels(ranks, self.rank, device)
        pipelines = [d.pipeline_ranks(dp, t, c) for dp in range(d.dp) for c in range(d.cp) for t in range(d.tp)]
        group = new_subgroups(pipelines, self.rank, timeout=timeout, created=self.created)
        meta_group = None
        if dist.get_backend() != "gloo":
            meta_group = new_subgroups(pipelines, self.rank, backend="gloo", timeout=timeout, created=self.created)
        return PipelineChannels(ranks, self.rank, device, group, meta_group)

    def destroy(self) -> None:
        """Destroy this rank's groups (local: no collective) and drop every reference to them. Idempotent."""
        groups, self.created = list(self.created), []
        self.device_mesh = self.tp_mesh = self.channels = None
        self.dp_group = self.cp_group = self.model_parallel_group = self.tied_group = self.fused_tied_group = None
        for group in reversed(groups):
            try:
                dist.destroy_process_group(group)
            except ValueError:  # already gone: the user destroyed the world, which destroys every group with it
                pass
        if groups:
            clear_dtensor_caches()  # cached sharding decisions hold meshes on the destroyed groups


# The groups of the last run of any Compressed3DStrategy in this process, and how to release the model bound to
# them (a weak reference to its owner's method: the registry must not keep a finished strategy alive).
_live_groups: ProcessGroups | None = None
_live_release: weakref.WeakMethod | None = None
_exit_hook: list[bool] = []  # whether _shutdown_at_exit is registered


def live_groups_of(owner: object) -> ProcessGroups | None:
    """The live groups if ``owner`` made them (the run that prepared its module may reuse them), else None."""
    release = _live_release() if _live_release is not None else None
    return _live_groups if release is not None and release.__self__ is owner else None


def destroy_live_groups() -> None:
    """Release the last run's model state on its owner and destroy its groups (local: no collective)."""
    global _live_groups, _live_release
    release = _live_release() if _live_release is not None else None
    groups, _live_groups, _live_release = _live_groups, None, None
    if release is not None:
        release()
    if groups is not None and groups.created:
        groups.destroy()
        # A destroyed group's C++ object (with its threads) lives until its last reference goes, and the released
        # model usually holds it in reference cycles (module <-> trainer). Collected here, while the process runs
        # normally; left to the collector, it could be finalised during interpreter shutdown (see _shutdown_at_exit).
        gc.collect()


def claim_live_groups(
    release: Callable[[], None], dims: ParallelDims, rank: int, device: torch.device, virtual_stages: int,
    timeout: timedelta | None,
) -> ProcessGroups:
    """Destroy the previous run's groups (calling its owner's release first), then create this run's, owned by the
    object whose bound method ``release`` is: it is called when the next run claims the groups."""
    global _live_groups, _live_release
    destroy_live_groups()
    _live_groups = ProcessGroups(dims, rank, device, virtual_stages, timeout)
    _live_release = weakref.WeakMethod(release)
    return _live_groups


def register_exit_hook() -> None:
    """Register ``_shutdown_at_exit`` once per process."""
    if not _exit_hook:
        atexit.register(_shutdown_at_exit)
        _exit_hook.append(True)


def _shutdown_at_exit() -> None:
    destroy_all_groups()


def destroy_all_groups() -> None:
    """Release the last run and destroy every process group while the interpreter still runs normally. Left to
    interpreter shutdown, gloo's group destructors occasionally abort the process ("terminate called without an
    active exception", exit code -6) after all the work is done, which fails a torchrun or SLURM job that succeeded.
    Destroying is local to this process (no collective), so a rank that exits early does not wait for the others."""
    destroy_live_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
