"""``lightning-3d export``: a sharded checkpoint of any (dp, pp, tp) layout -> a Hugging Face ``save_pretrained``
directory, choosing GPT-2 or T5 by the model the checkpoint records (its class path, else its hyper-parameters)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_3d.recipes.hf import checkpoint_hparams
from lightning_3d.recipes.hf import export_checkpoint as export_gpt_checkpoint
from lightning_3d.recipes.hf_t5 import export_t5_checkpoint, is_t5_hparams


def export_checkpoint(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Export a GPT (``GPT2LMHeadModel``) or T5 (``T5ForConditionalGeneration``) checkpoint with its ``tokenizer``."""
    if is_t5_hparams(checkpoint_hparams(Path(checkpoint_dir))):
        return export_t5_checkpoint(checkpoint_dir, output_dir, tokenizer)
    try:
        return export_gpt_checkpoint(checkpoint_dir, output_dir, tokenizer)
    except ValueError as err:
        if "is not a checkpoint of the GPT recipe" in str(err):
            raise ValueError(f"{err} Nor is it one of the T5 recipe: lightning-3d export handles checkpoints of the GPT"
                             " and T5 recipes.") from None
        raise
