from lightning_3d.recipes.gpt.config import PRESETS, GPTConfig, preset
from lightning_3d.recipes.gpt.model import GPTModel
from lightning_3d.recipes.gpt.module import GPT

__all__ = ["GPT", "GPTConfig", "GPTModel", "PRESETS", "preset"]
