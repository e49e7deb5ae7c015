"""The (dp, pp, cp, tp) layout of a job and the device mesh built from it.

Modelled on torchtitan's ``ParallelDims``: one small object that validates the sizes once, before any
process group exists, and then hands out the mesh and per-dimension coordinates. The mesh order is
("dp", "pp", "cp", "tp") with tp innermost so that tensor-parallel groups are consecutive ranks (one node), and the
context-parallel ring right outside it (its K/V traffic is the heaviest after tp's; docs/context_parallel.md). With
context_parallel_size 1 the "cp" dimension is left out of the mesh: ("dp", "pp", "tp"), ranks as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def resolve_sizes(
    world_size: int,
    data_parallel_size: int | Literal["auto"],
    pipeline_parallel_size: int,
    tensor_parallel_size: int,
    context_parallel_size: int = 1,
) -> tuple[int, int, int]:
    """Fill in ``"auto"`` for dp and check that dp * cp * pp * tp equals the world size; returns (dp, pp, tp)."""
    for name, value in (("pipeline_parallel_size", pipeline_parallel_size), ("tensor_parallel_size", tensor_parallel_size),
                        ("context_parallel_size", context_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}={value!r}` must be a positive integer.")
    model_parallel = pipeline_parallel_size * tensor_parallel_size * context_parallel_size
    sizes = f"pipeline_parallel_size * tensor_parallel_size = {pipeline_parallel_size} * {tensor_parallel_size}"
    if context_parallel_size > 1:
        sizes = (f"context_parallel_size * pipeline_parallel_size * tensor_parallel_size = {context_parallel_size} *"
                 f" {pipeline_parallel_size} * {tensor_parallel_size}")
    if data_parallel_size == "auto":
        if world_size % model_parallel != 0:
            raise ValueError(
                f"The world size {world_size} is not divisible by {sizes} = {model_parallel}, so"
                f" `data_parallel_size='auto'` cannot be resolved. Choose sizes whose product divides the number of"
                f" devices."
            )
        data_parallel_size = world_size // model_parallel
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"`data_parallel_size={data_parallel_size!r}` must be 'auto' or a positive integer.")
    if data_parallel_size * model_parallel != world_size:
        cp = f"{context_parallel_size} * " if context_parallel_size > 1 else ""
        names = "context_parallel_size * " if context_parallel_size > 1 else ""
        raise ValueError(
            f"data_parallel_size * {names}pipeline_parallel_size * tensor_parallel_size = {data_parallel_size} * {cp}"
            f"{pipeline_parallel_size} * {tensor_parallel_size} = {data_parallel_size * model_parallel}, but the job has"
            f" {world_size} processes (devices x nodes). Make the product equal {world_size}, or pass"
            f" data_parallel_size='auto'."
        )
    return data_parallel_size, pipeline_parallel_size, tensor_parallel_size


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four parallel dimensions and this rank's coordinates in them (``cp`` last: existing callers
    build ``ParallelDims(dp, pp, tp, world)``)."""

    dp: int
    pp: int
    tp: int
    world_size: int
    cp: int = 1

    def __post_init__(self) -> None:
        if self.dp * self.cp * self.pp * self.tp != self.world_size:
            raise ValueError(f"dp * cp * pp * tp = {self.dp * self.cp * self.pp * self.tp} != world size {self.world_size}")

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters: dp x cp (context-parallel ranks replicate the parameters and hold
        different tokens, so their gradients are reduced together with the data-parallel replicas')."""
        return self.dp * self.cp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank in the ("dp", "pp", "cp", "tp") row-major mesh."""
        return rank // (self.pp * self.cp * self.tp), (rank // (self.cp * self.tp)) % self.pp, rank % self.tp

    def cp_rank(self, rank: int) -> int:
        """The context-parallel coordinate of a global rank."""
        return (rank // self.tp) % self.cp

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((dp_rank * self.pp + pp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def pipeline_ranks(self, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> list[int]:
        """Global ranks of one pipeline, ordered by pipeline rank."""
        return [self.rank_of(dp_rank, p, tp_rank, cp_rank) for p in range(self.pp)]

    def build_mesh(
        self, device_type: str, timeout: timedelta | None = None, created: list[dist.ProcessGroup] | None = None
    ) -> DeviceMesh:
        """The ("dp", "pp", "cp", "tp") mesh (("dp", "pp", "tp") with cp = 1), on groups created with ``timeout``;
        the groups made are appended to ``created``.

        ``init_device_mesh`` creates its groups without a timeout, which torch turns into its 30-minute default
        whatever the default group's timeout is, so a frozen rank would hang its peers for half an hour. The groups are
        made here instead and handed to ``DeviceMesh.from_group``. A dimension spanning the world uses the default
        group, as ``init_device_mesh`` does.
        """
        names = ("dp", "pp", "cp", "tp") if self.cp > 1 else ("dp", "pp", "tp")
        shape = (self.dp, self.pp, self.cp, self.tp) if self.cp > 1 else (self.dp, self.pp, self.tp)
        mesh = torch.arange(self.world_size).reshape(shape)
        rank = dist.get_rank()
        groups = []
        for dim in range(len(names)):
            # Every group of this dimension: the mesh with the dimension moved last, one row per group.
            rows = mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist()
            if len(rows[0]) == self.world_size:
                groups.append(dist.group.WORLD)
            else:
                groups.append(new_subgroups(rows, rank, timeout=timeout, created=created))
        return DeviceMesh.from_group(groups, device_type, mesh, mesh_dim_names=names)


def new_subgroups(
    groups_ranks: list[list[int]],
    my_rank: int,
    backend: str | None = None,
    timeout: timedelta | None = None,
    created: list[dist.ProcessGroup] | None = None,
) -> dist.ProcessGroup | None:
    """Create every group in ``groups_ranks`` (all ranks must call this in the same order) and return mine.

    ``dist.new_group`` is collective over the world, so each rank creates all groups of a family, then keeps
    the one it belongs to. ``timeout`` must be given: ``new_group`` does not inherit the default group's but falls
    back to torch's 30 minutes. Mine is appended to ``created`` (the owner destroys it; the others are placeholders).
    """
    mine = None
    for ranks in groups_ranks:
        group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
        if my_rank in ranks:
            mine = group
    if mine is not None and created is not None:
        created.append(mine)
    return mine

