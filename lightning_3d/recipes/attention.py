"""Which SDPA backends the GPT and T5 recipes' attention may run (the models' ``sdpa_backends`` option).

``"no_cudnn"`` (the default) lets SDPA pick among flash attention, the memory-efficient kernel and math, never cuDNN:
recent torch prefers cuDNN's attention on Hopper, and cuDNN builds an execution plan for every new (batch, heads,
length) shape before it runs, which micro-batches whose shapes change (padding, token budgets, dynamic micro-batching)
pay again and again (docs/dynamic.md, "Attention for changing shapes"). ``"torch"`` leaves torch's own choice.

The selection only removes a backend, with no priority order: torch then chooses among the rest by its fixed order
(flash, efficient, math), the same in eager code, in compiled code and in activation checkpointing's recomputation, so
a forward and its recomputation always run the same kernel (an explicit priority order skipped under compilation once
made them differ, and torch's checkpoint refused the recomputed tensors). ``sdpa_kernel`` with a plain list, the form
Dynamo has handled longest (``set_priority`` is the newer argument), traces into a compiled graph without a graph break
and the graph then holds the kernel it allows (tests/test_sdpa_backends.py; benchmarks/peers.py reports graph breaks
per system on the GPU's torch).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

# The backends each value allows (None: torch's own order, no context entered).
SDPA_BACKENDS: dict[str, list[SDPBackend] | None] = {
    "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "torch": None,
}
# The models' default; one name to flip if cuDNN turns out faster on static shapes (benchmarks/peers.py +torchsdpa).
DEFAULT_SDPA_BACKENDS = "no_cudnn"


def check_sdpa_backends(value: str) -> None:
    if value not in SDPA_BACKENDS:
        raise ValueError(f"sdpa_backends={value!r} is not supported; choose one of {list(SDPA_BACKENDS)} ('no_cudnn':"
                         " flash, memory-efficient or math attention, never cuDNN's per-shape plans; 'torch': torch's"
                         " own choice).")


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, sdpa_backends: str, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` with the backends ``sdpa_backends`` allows."""
    backends = SDPA_BACKENDS[sdpa_backends]
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
