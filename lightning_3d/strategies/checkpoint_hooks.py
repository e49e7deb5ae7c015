"""Lightning's checkpoint hooks for ``Compressed3DStrategy``: sharded model and optimizer state through
``strategies.checkpoint`` (DCP), plus each rank's compression state in its own file, kept only for the same layout.

A mixin of the strategy, for the file size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_3d.strategies import checkpoint as ckpt
from lightning_3d.strategies import checkpoint_files as files


class CheckpointHooksMixin:
    """Save, load and remove sharded checkpoints (see the module docstring)."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return ckpt.model_state(self.lightning_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return ckpt.optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("Compressed3DStrategy writes sharded checkpoints itself and takes no storage_options.")
        path = Path(self.broadcast(str(filepath)))
        staging = Path(self.broadcast(str(files.staging_path(path))))  # rank 0's choice: all write into one directory
        step = checkpoint.get("global_step")
        checkpoint["compressed_3d"] = self.compression_record()  # SC's link decision, kept on resume
        ckpt.save(checkpoint, staging, {}, self.global_rank)
        ckpt.save_rank_state(staging, self.global_rank, self._layout_key(), self.rank_state_dict())
        files.commit(staging, path, step)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """``weights_only`` changes nothing: loading never unpickles code, whatever it says."""
        path = Path(checkpoint_path)
        path = Path(self.broadcast(str(files.resolve(path) if self.is_global_zero else path)))
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        module = self.lightning_module
        padded = module.padded_parameters() if callable(getattr(module, "padded_parameters", None)) else []
        tied = module.pipeline_tied_parameters() if callable(getattr(module, "pipeline_tied_parameters", None)) else {}
        aliases = {**{last: first for first, last in tied.items()}, **tied}
        meta = ckpt.load(path, module, optimizers, {}, strict=module.strict_loading, padded=padded, aliases=aliases)
        self.restore_compression_record(meta.get("compressed_3d"))  # before the SC state below is loaded into it
        states = ckpt.load_rank_state(path, self.global_rank, self._layout_key(), self.root_device)
        if states is not None:
            self.load_rank_state_dict(states)
        elif self.rank_state_dict():
            rank_zero_warn(
                f"{path} holds no compression state for this layout {self._layout_key()}; error-feedback buffers"
                " and warm-start factors start afresh."
            )
        return meta

    def _layout_key(self) -> tuple:
        return (self.dims.dp, self.dims.pp, self.dims.tp, self.virtual_stages, self.schedule)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            for path in (Path(filepath), *files.leftovers(Path(filepath))):
                files.remove(path)
