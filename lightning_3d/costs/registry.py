"""The recipe registry: how the planner, the profiler and the fit check read a recipe they may not import.

The cost layer sits below the recipes, so a recipe registers, under its model class paths, a ``RecipeCosts``: how a
training config's model and data sections become a workload, its config object a ``ModelShape``, its layers modules
the profiler times, and a tiny model the profiler trains for the step's costs outside the layers. Everything the
planner knows of a recipe comes from here: nothing reads a class by its dotted name or guesses a family from a
config's field names. ``import lightning_3d.recipes`` registers the GPT and T5 recipes (the CLI does it);
docs/planner.md (the paragraph "Recipes register how they are read") describes the entries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_3d.costs.model import ModelShape


@dataclass(frozen=True)
class TinyModel:
    """A small model of a recipe that the profiler trains under the strategy (``lightning_3d.planner.overheads``).

    ``model_args``/``data_args``: the one-layer model's and its synthetic data module's keyword arguments;
    ``build(model_args, data_args, batch_size, num_samples) -> (LightningModule, LightningDataModule)``;
    ``at_depth(model_args, shape) -> model_args``: the same widths at ``shape``'s depth. The functions are
    module-level, so that the entry travels to the profiler's fresh processes by pickling (which imports the
    recipe's module there, registering it)."""

    model_args: Mapping[str, Any]
    data_args: Mapping[str, Any]
    build: Callable[[dict, dict, int, int], tuple[Any, Any]]
    at_depth: Callable[[dict, ModelShape], dict]


@dataclass(frozen=True)
class RecipeCosts:
    """``workload(model_args, data_args, bytes_per_element) -> (ModelShape, seq_len, target_len or None)``;
    ``layers(model_args, data_args, shape, device) -> {kind: (module, make_inputs(b, s, t, dtype), run(module, *inputs))}``
    (``run`` returns the layer's output, or the loss for the head); ``tensor_parallel(kind, module, mesh) -> bool``
    shards one of those modules as the recipe's tensor-parallel plan does (False: that kind is not sharded by it),
    for the profiler's measured tensor-parallel grids; ``shape(config, bytes_per_element, tensor_parallel_size) ->
    ModelShape`` reads the recipe's config objects, whose classes are ``config_types`` (``model_shape``);
    ``tiny``: the model the profiler trains for the per-step and per-micro-batch overheads (None: not measured);
    ``optimizer(model_args, device) -> {"foreach": ..., "fused": ...}``: the arguments of the AdamW the recipe builds
    for a model of ``model_args`` on ``device``, which the profiler times (None: torch's defaults);
    ``context_parallel(model_args, data_class_path, data_args) -> str | None``: why a config of the recipe cannot train
    with context parallelism (its attention dropout, a data module whose micro-batches the strategy cannot slice), or
    None where it can; a recipe without the rule has no context-parallel attention (the planner does not search cp)."""

    workload: Callable[[dict, dict, int], tuple[ModelShape, int, int | None]]
    layers: Callable[..., dict] | None = None
    tensor_parallel: Callable[..., bool] | None = None
    shape: Callable[[Any, int, int], ModelShape] | None = None
    config_types: tuple[type, ...] = ()
    tiny: TinyModel | None = None
    optimizer: Callable[[dict, Any], dict] | None = None
    context_parallel: Callable[[dict, str | None, dict], str | None] | None = None


RECIPES: dict[str, RecipeCosts] = {}
#: config class -> the registered entry that reads it (``RecipeCosts.config_types``)
CONFIGS: dict[type, RecipeCosts] = {}


def register_recipe(class_paths: Sequence[str], costs: RecipeCosts) -> None:
    if costs.config_types and costs.shape is None:
        raise ValueError(f"RecipeCosts(config_types={costs.config_types}) needs shape=, the function that reads them.")
    for path in class_paths:
        RECIPES[path] = costs
    for config_type in costs.config_types:
        CONFIGS[config_type] = costs


def recipe_costs(class_path: str) -> RecipeCosts:
    """The registered ``RecipeCosts`` of a model class path (a clear error naming the known ones otherwise)."""
    found = RECIPES.get(class_path)
    if found is None:
        known = ", ".join(sorted(RECIPES)) or "none (import lightning_3d.recipes first)"
        raise ValueError(f"The planner cannot read model.class_path {class_path!r}: no recipe registered it"
                         f" (lightning_3d.costs.register_recipe). Registered: {known}.")
    return found


def model_shape(config: object, *, bytes_per_element: int = 2, tensor_parallel_size: int = 1) -> ModelShape:
    """The ``ModelShape`` of a registered recipe's config object (``GPTConfig``, ``T5Config``; padded vocabulary at
    ``tensor_parallel_size``), read by the function the recipe registered for its class."""
    found = next((CONFIGS[t] for t in type(config).__mro__ if t in CONFIGS), None)
    if found is None:
        known = ", ".join(sorted(t.__name__ for t in CONFIGS)) or "none (import lightning_3d.recipes first)"
        missing = next((n for n in ("num_layers", "hidden_size", "num_heads", "vocab_size") if not hasattr(config, n)),
                       None)
        what = f"has no {missing!r} (not a model config)" if missing else "is no registered recipe's config"
        raise TypeError(f"{type(config).__name__} {what}: model_shape reads the configs recipes register with"
                        f" lightning_3d.costs.register_recipe(..., RecipeCosts(config_types=..., shape=...))."
                        f" Registered: {known}.")
    return found.shape(config, bytes_per_element, tensor_parallel_size)
