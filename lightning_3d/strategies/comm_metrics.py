"""The job's communication metrics (``comm/bytes_sent``, ``comm/compression_ratio``), logged by the strategy at every
training batch: this rank's byte counters of the previous optimizer step (``utils.comm_stats``) summed over all
ranks, so the number a logger shows on rank 0 is the whole job's traffic, not rank 0's share."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_3d.distributed.process_groups import ProcessGroups
from lightning_3d.utils.comm_stats import CommunicationStats


def log_job_communication(
    module: Any, stats: CommunicationStats, groups: ProcessGroups | None, device: torch.device, world_size: int
) -> None:
    """Log the previous step's bytes of the job on ``module``.

    Two numbers are all-reduced on the device at the same point of every rank's batch, over the strategy's own
    groups, which carry its timeout (a frozen peer fails the job in time): a replica's pipeline and tensor ranks, then
    the replicas. No host synchronisation: the logged values stay tensors until a logger reads them.
    """
    last = stats.as_dict("last_step")
    before = sum(v["bytes_before"] for v in last.values())
    after = sum(v["bytes_after"] for v in last.values())
    if world_size == 1 or not dist.is_initialized() or groups is None:
        if before:
            module.log_dict({"comm/bytes_sent": float(after), "comm/compression_ratio": before / max(after, 1)},
                            on_step=True, on_epoch=False, sync_dist=False)
        return
    totals = torch.tensor([before, after], dtype=torch.float64, device=device)
    for group in (groups.model_parallel_group, groups.dp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
    ratio = torch.where(totals[1] > 0, totals[0] / totals[1].clamp(min=1), torch.ones_like(totals[0]))
    module.log_dict({"comm/bytes_sent": totals[1], "comm/compression_ratio": ratio},
                    on_step=True, on_epoch=False, sync_dist=False)
