"""Ready-made LightningModules (GPT) and data modules that implement the 3D protocol."""

from lightning_3d.recipes.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
