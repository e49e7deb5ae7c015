"""``lightning-3d export``: a sharded checkpoint of any (dp, pp, tp) layout -> a Hugging Face ``save_pretrained``
directory, choosing GPT-2 or T5 by the model the checkpoint records (its class path, else its hyper-parameters),
with the tokenizer the checkpoint stores unless another is given."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from lightning_3d.recipes.data.tokenizer import write_tokenizer_files
from lightning_3d.recipes.hf import checkpoint_hparams, stored_tokenizer_files
from lightning_3d.recipes.hf import export_checkpoint as export_gpt_checkpoint
from lightning_3d.recipes.hf_t5 import export_t5_checkpoint, is_t5_hparams


def export_checkpoint(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Export a GPT (``GPT2LMHeadModel``) or T5 (``T5ForConditionalGeneration``) checkpoint with its tokenizer:
    ``tokenizer`` (a path, ``"bytes"`` or a tokenizer object), else the one stored in the checkpoint (the recipes'
    data modules store theirs), else none."""
    path = Path(checkpoint_dir)
    hparams = checkpoint_hparams(path)  # verifies every file against the manifest first
    with tempfile.TemporaryDirectory(prefix="l3d-tokenizer-") as tmp:
        if tokenizer is None and (files := stored_tokenizer_files(path)):
            tokenizer = str(write_tokenizer_files(files, tmp))
        if is_t5_hparams(hparams):
            return export_t5_checkpoint(checkpoint_dir, output_dir, tokenizer)
        try:
            return export_gpt_checkpoint(checkpoint_dir, output_dir, tokenizer)
        except ValueError as err:
            if "is not a checkpoint of the GPT recipe" in str(err):
                raise ValueError(f"{err} Nor is it one of the T5 recipe: lightning-3d export handles checkpoints of the"
                                 " GPT and T5 recipes.") from None
            raise
