from lightning_3d.recipes.t5 import costs  # noqa: F401  (registers the recipe with the planner: docs/planner.md)
from lightning_3d.recipes.t5.config import PRESETS, T5Config, preset
from lightning_3d.recipes.t5.model import T5Model
from lightning_3d.recipes.t5.module import T5

__all__ = ["PRESETS", "T5", "T5Config", "T5Model", "preset"]
