"""Ready-made LightningModules (GPT, T5) and data modules that implement the 3D protocol."""

from lightning_3d.recipes.gpt import GPT, GPTConfig
from lightning_3d.recipes.hf import gpt_from_pretrained
from lightning_3d.recipes.hf_t5 import t5_from_pretrained
from lightning_3d.recipes.t5 import T5, T5Config

__all__ = ["GPT", "GPTConfig", "T5", "T5Config", "gpt_from_pretrained", "t5_from_pretrained"]
