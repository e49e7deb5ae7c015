"""ShardedCheckpointIO: how ``Compressed3DStrategy`` writes, reads and removes its sharded checkpoint directories.

Model and optimizer state go through ``checkpoint.state`` (DCP entries keyed by parameter name, so any layout
loads any other), each rank's compression state into its own file that only the same layout reads back, and the
directory through ``checkpoint.files`` (a save is staged in a sibling directory and swapped in with a
manifest; a load verifies the manifest on every rank before any DCP collective). The strategy keeps Lightning's
checkpoint hooks and calls this with what they need; the component holds the strategy's ``broadcast`` (every rank
must agree on one path) and its ``CompressionState`` (whose link decision travels as ``checkpoint["compressed_3d"]``
and whose per-rank state fills the rank files). See docs/architecture.md (Checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_3d.checkpoint import files
from lightning_3d.checkpoint import state as ckpt
from lightning_3d.compression.backprop import CompressedBackprop
from lightning_3d.distributed.parallel_dims import ParallelDims
from lightning_3d.strategies.compression_state import CompressionState


class ShardedCheckpointIO:
    """Save, load and remove sharded checkpoints (see the module docstring)."""

    def __init__(self, broadcast: Callable[[Any], Any], compression: CompressionState) -> None:
        self.broadcast = broadcast  # rank 0's value on every rank (a collective)
        self.compression = compression

    def save(
        self, checkpoint: dict[str, Any], filepath: Any, global_rank: int, layout_key: tuple, dims: ParallelDims,
        codec: CompressedBackprop | None,
    ) -> None:
        """Write Lightning's ``checkpoint`` (model and optimizer state sharded), SC's link decision and this rank's
        compression state (``codec``: the runtime's CB codec, if any)."""
        checkpoint["compressed_3d"] = self.compression.record(dims)  # SC's link decision, kept on resume
        path = Path(self.broadcast(str(filepath)))
        staging = Path(self.broadcast(str(files.staging_path(path))))  # rank 0's choice: all write into one directory
        ckpt.save(checkpoint, staging, {}, global_rank)
        ckpt.save_rank_state(staging, global_rank, layout_key, self.compression.rank_state_dict(codec))
        files.commit(staging, path, checkpoint.get("global_step"))

    def load(
        self, checkpoint_path: Any, module: pl.LightningModule, optimizers: Sequence[Optimizer], global_rank: int,
        is_global_zero: bool, layout_key: tuple, device: torch.device, restore_record: Callable[[dict | None], None],
        codec_of: Callable[[], CompressedBackprop | None],
    ) -> dict[str, Any]:
        """Load model and optimizer state into this rank's shards, hand the recorded link decisions to
        ``restore_record`` (which may rebuild SC or install another CB codec) before this rank's compression state is
        loaded into it (``codec_of()``: the CB codec of this rank then); returns
        the rest of Lightning's checkpoint. Where another layout wrote the checkpoint, the compression state starts
        afresh, and says so."""
        path = Path(checkpoint_path)
        path = Path(self.broadcast(str(files.resolve(path) if is_global_zero else path)))
        padded = module.padded_parameters() if callable(getattr(module, "padded_parameters", None)) else []
        tied = module.pipeline_tied_parameters() if callable(getattr(module, "pipeline_tied_parameters", None)) else {}
        aliases = {**{last: first for first, last in tied.items()}, **tied}
        optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
        meta = ckpt.load(path, module, optimizers, {}, strict=module.strict_loading, padded=padded, aliases=aliases)
        restore_record(meta.get("compressed_3d"))  # before the SC and CB state below is loaded into them
        codec = codec_of()
        states = ckpt.load_rank_state(path, global_rank, layout_key, device)
        if states is not None:
            self.compression.load_rank_state_dict(states, codec)
        elif self.compression.rank_state_dict(codec):
            rank_zero_warn(
                f"{path} holds no compression state for this layout {layout_key}; error-feedback buffers"
                " and warm-start factors start afresh."
            )
        return meta

    @staticmethod
    def remove(filepath: Any, is_global_zero: bool) -> None:
        if is_global_zero:
            for path in (Path(filepath), *files.leftovers(Path(filepath))):
                files.remove(path)
