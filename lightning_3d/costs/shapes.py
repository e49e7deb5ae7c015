"""``model_shape``: a recipe's config (GPT or T5) as the recipe-independent ``ModelShape``.

This layer cannot import the recipes (they sit above it), so the conversion reads the configs' field names: a
T5 config is recognised by ``decoder_layers`` / ``feed_forward``, anything else with ``num_layers``,
``hidden_size`` and ``num_heads`` is read as a GPT.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_3d.costs.model import ModelShape


def model_shape(config: object, *, bytes_per_element: int = 2, tensor_parallel_size: int = 1) -> ModelShape:
    """The ``ModelShape`` of a ``GPTConfig`` or ``T5Config`` (padded vocabulary at ``tensor_parallel_size``)."""
    for name in ("num_layers", "hidden_size", "num_heads", "vocab_size"):
        if not hasattr(config, name):
            raise TypeError(f"{type(config).__name__} has no {name!r}: model_shape reads GPTConfig or T5Config.")
    padded = getattr(config, "padded_vocab_size", None)
    vocab = padded(tensor_parallel_size) if callable(padded) else config.vocab_size
    if hasattr(config, "decoder_layers") and hasattr(config, "feed_forward"):
        return ModelShape("t5", config.num_layers, config.hidden_size, config.num_heads, config.ffn_hidden_size, vocab,
                          num_decoder_layers=config.decoder_layers, head_dim=config.head_dim,
                          gated_ffn=config.feed_forward != "relu", bytes_per_element=bytes_per_element,
                          tied_embeddings=bool(getattr(config, "tie_embeddings", False)))
    ffn = getattr(config, "ffn_size", None) or getattr(config, "ffn_hidden_size", None) or 4 * config.hidden_size
    return ModelShape("gpt", config.num_layers, config.hidden_size, config.num_heads, ffn, vocab,
                      bytes_per_element=bytes_per_element, tied_embeddings=bool(getattr(config, "tie_embeddings", False)))


# ----- recipes register how the planner and the profiler read them -------------------------------------------------
# The planner and the profiler sit beside the recipes (they may not import them); a recipe registers, under its class
# paths, how a training config's model and data sections become a workload (shape and lengths) and, for the profiler,
# its layers as modules. ``import lightning_3d.recipes`` registers the GPT and T5 recipes (the CLI does it).

@dataclass(frozen=True)
class RecipeCosts:
    """``workload(model_args, data_args, bytes_per_element) -> (ModelShape, seq_len, target_len or None)``;
    ``layers(model_args, data_args, shape, device) -> {kind: (module, make_inputs(b, s, t, dtype), run(module, *inputs))}``
    (``run`` returns the layer's output, or the loss for the head); ``tensor_parallel(kind, module, mesh) -> bool``
    shards one of those modules as the recipe's tensor-parallel plan does (False: that kind is not sharded by it),
    for the profiler's measured tensor-parallel grids."""

    workload: Callable[[dict, dict, int], tuple[ModelShape, int, int | None]]
    layers: Callable[..., dict] | None = None
    tensor_parallel: Callable[..., bool] | None = None


RECIPES: dict[str, RecipeCosts] = {}


def register_recipe(class_paths: Sequence[str], costs: RecipeCosts) -> None:
    for path in class_paths:
        RECIPES[path] = costs


def recipe_costs(class_path: str) -> RecipeCosts:
    """The registered ``RecipeCosts`` of a model class path (a clear error naming the known ones otherwise)."""
    found = RECIPES.get(class_path)
    if found is None:
        known = ", ".join(sorted(RECIPES)) or "none (import lightning_3d.recipes first)"
        raise ValueError(f"The planner cannot read model.class_path {class_path!r}: no recipe registered it"
                         f" (lightning_3d.costs.register_recipe). Registered: {known}.")
    return found
