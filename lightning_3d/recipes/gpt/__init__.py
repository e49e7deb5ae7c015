from lightning_3d.recipes.gpt import costs  # noqa: F401  (registers the recipe with the planner: docs/planner.md)
from lightning_3d.recipes.gpt.config import PRESETS, GPTConfig, preset
from lightning_3d.recipes.gpt.model import GPTModel
from lightning_3d.recipes.gpt.module import GPT

__all__ = ["GPT", "GPTConfig", "GPTModel", "PRESETS", "preset"]
