"""ShardedCheckpointIO: how ``Compressed3DStrategy`` writes, reads and removes its sharded checkpoint directories.

Model and optimizer state go through ``strategies.checkpoint`` (DCP entries keyed by parameter name, so any layout
loads any other), each rank's compression state into its own file that only the same layout reads back, and the
directory through ``strategies.checkpoint_files`` (a save is staged in a sibling directory and swapped in with a
manifest; a load verifies the manifest on every rank before any DCP collective). The strategy keeps Lightning's
checkpoint hooks and calls this with what they need; the component holds only the strategy's ``broadcast`` (every
rank must agree on one path). See docs/architecture.md (Checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from lightning_3d.strategies import checkpoint as ckpt
from lightning_3d.strategies import checkpoint_files as files


class ShardedCheckpointIO:
    """Save, load and remove sharded checkpoints (see the module docstring)."""

    def __init__(self, broadcast: Callable[[Any], Any]) -> None:
        self.broadcast = broadcast  # rank 0's value on every rank (a collective)

    def save(
        self, checkpoint: dict[str, Any], filepath: Any, global_rank: int, layout_key: tuple, rank_state: dict[str, Any]
    ) -> None:
        """Write Lightning's ``checkpoint`` (model and optimizer state sharded) and this rank's ``rank_state``."""
        path = Path(self.broadcast(str(filepath)))
        staging = Path(self.broadcast(str(files.staging_path(path))))  # rank 0's choice: all write into one directory
        ckpt.save(checkpoint, staging, {}, global_rank)
        ckpt.save_rank_state(staging, global_rank, layout_key, rank_state)
        files.commit(staging, path, checkpoint.get("global_step"))

    def resolve(self, checkpoint_path: Any, is_global_zero: bool) -> Path:
        """The checkpoint directory every rank loads (rank 0 resolves it, e.g. a path inside it)."""
        path = Path(checkpoint_path)
        return Path(self.broadcast(str(files.resolve(path) if is_global_zero else path)))

    @staticmethod
    def load(path: Path, module: pl.LightningModule, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
        """Load model and optimizer state into this rank's shards; returns the rest of Lightning's checkpoint."""
        padded = module.padded_parameters() if callable(getattr(module, "padded_parameters", None)) else []
        tied = module.pipeline_tied_parameters() if callable(getattr(module, "pipeline_tied_parameters", None)) else {}
        aliases = {**{last: first for first, last in tied.items()}, **tied}
        optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
        return ckpt.load(path, module, optimizers, {}, strict=module.strict_loading, padded=padded, aliases=aliases)

    @staticmethod
    def load_rank_state(path: Path, global_rank: int, layout_key: tuple, device: torch.device) -> dict[str, Any] | None:
        """This rank's compression state, or None where the checkpoint was written by another layout."""
        return ckpt.load_rank_state(path, global_rank, layout_key, device)

    @staticmethod
    def remove(filepath: Any, is_global_zero: bool) -> None:
        if is_global_zero:
            for path in (Path(filepath), *files.leftovers(Path(filepath))):
                files.remove(path)
