"""The default activation-memory budget of dynamic micro-batching (``MultiTaskDataModule(memory_budget_gb=None)``).

DynaPipe's planner fills at most this many bytes of stored activations per device. Without a value it is derived
from the device: 80 % of its memory (a CUDA card's total memory; on CPU the host's physical memory shared by the
processes of this node) minus the model state this rank holds for training (fp32 weights, gradients and AdamW's two
moments: 16 bytes per parameter of its stages), so ``microbatching="dynamic"`` runs as written on a GPU and on a CPU.
docs/multitask.md, "Dynamic micro-batching".
"""

from __future__ import annotations

import os

import torch

USABLE_FRACTION = 0.8  # headroom for the allocator, temporaries and communication buffers
STATE_BYTES_PER_PARAMETER = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq


def device_memory_bytes(device: torch.device, processes_on_host: int = 1) -> int:
    """A CUDA device's total memory, or this process's share of the host's physical memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): a conservative 8 GiB host
        host = 8 * 2**30
    return host // max(processes_on_host, 1)


def default_memory_budget_gb(device: torch.device, parameters: int, processes_on_host: int = 1) -> float:
    """``USABLE_FRACTION`` of the device's memory minus the training state of ``parameters`` (this rank's), in GiB.
    Raises, naming a value to pass, when the model state alone exceeds it."""
    memory = device_memory_bytes(device, processes_on_host)
    budget = USABLE_FRACTION * memory - STATE_BYTES_PER_PARAMETER * parameters
    if budget <= 0:
        raise ValueError(
            f"microbatching='dynamic' derives memory_budget_gb from the device: {USABLE_FRACTION:.0%} of"
            f" {memory / 2**30:.1f} GiB on {device} minus {STATE_BYTES_PER_PARAMETER * parameters / 2**30:.1f} GiB of"
            " model state leaves nothing for activations. Pass memory_budget_gb explicitly (e.g."
            " --data.memory_budget_gb=1), or shard the model over more pipeline or tensor-parallel ranks."
        )
    return budget / 2**30
