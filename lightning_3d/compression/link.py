"""How fast the data-parallel link is, measured once, so that SC's default follows the hardware.

SC trades compute for bandwidth: its power steps over a large model's gradients cost more than an exact all-reduce
at NVLink's bus bandwidth and much less than one at InfiniBand-class bandwidth (the measurements:
benchmarks/RESULTS.md#2026-11-22d-sc-kernels and #2026-11-22f-defaults). So SC pays off on slow links and costs time
on fast ones. A timed all-reduce tells the two apart before training starts; nothing is known about the link until
then.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

PROBE_BYTES = 64 * 2**20  # large enough that latency does not decide: NCCL reaches most of its bandwidth by 64 MB
PROBE_ITERATIONS = 3


def allreduce_bus_gbps(group: dist.ProcessGroup, device: torch.device, nbytes: int = PROBE_BYTES,
                       iterations: int = PROBE_ITERATIONS) -> float:
    """Bus bandwidth in GB/s of an fp32 all-reduce of ``nbytes`` over ``group``, as nccl-tests defines it:
    2 (n - 1) / n * bytes / seconds. Collective: every rank of ``group`` must call it at the same point."""
    size = dist.get_world_size(group)
    buffer = torch.ones(nbytes // 4, device=device)
    dist.all_reduce(buffer, group=group)  # the first collective sets up the communicator: not timed; aligns ranks
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(buffer, group=group)
    _synchronize(device)
    seconds = (time.perf_counter() - start) / iterations
    return 2 * (size - 1) / size * nbytes / seconds / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
