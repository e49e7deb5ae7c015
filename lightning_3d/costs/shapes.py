"""``model_shape``: a recipe's config (GPT or T5) as the recipe-independent ``ModelShape``.

This layer cannot import the recipes (they sit above it), so the conversion reads the configs' field names: a
T5 config is recognised by ``decoder_layers`` / ``feed_forward``, anything else with ``num_layers``,
``hidden_size`` and ``num_heads`` is read as a GPT.
"""

from __future__ import annotations

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
                          gated_ffn=config.feed_forward != "relu", bytes_per_element=bytes_per_element)
    ffn = getattr(config, "ffn_size", None) or getattr(config, "ffn_hidden_size", None) or 4 * config.hidden_size
    return ModelShape("gpt", config.num_layers, config.hidden_size, config.num_heads, ffn, vocab,
                      bytes_per_element=bytes_per_element)
