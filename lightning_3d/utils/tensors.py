"""Tensor helpers the strategy and the recipes share (public, so that recipes need no strategy internals)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def materialize_(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device)`` that keeps shared (tied) parameters shared.

    Moving off the meta device replaces every parameter with a new ``Parameter`` per owning module, which
    silently unties an embedding from its output projection; record the sharing first and restore it.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((sub, name))
    module.to_empty(device=device)
    for places in owners.values():
        first_module, first_name = places[0]
        for sub, name in places[1:]:
            setattr(sub, name, getattr(first_module, first_name))
