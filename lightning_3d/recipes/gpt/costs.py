"""How the planner and the profiler read the GPT recipe (registered with ``lightning_3d.costs.register_recipe``):
a training config's model and data sections as a ``ModelShape`` and sequence length, a ``GPTConfig`` as a
``ModelShape``, the recipe's own layers (embedding, ``Block``, final norm + head + loss) as modules the profiler times
one at a time, and the tiny model it trains for the step's overheads (docs/planner.md)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.costs import ModelShape, RecipeCosts, TinyModel, register_recipe
from lightning_3d.recipes.gpt.config import GPTConfig, preset
from lightning_3d.recipes.gpt.model import Block, Embedding, LMHead
from lightning_3d.recipes.training import adamw_arguments

CLASS_PATHS = ("lightning_3d.recipes.GPT", "lightning_3d.recipes.gpt.GPT", "lightning_3d.recipes.gpt.module.GPT")
# tie_embeddings: the planner counts a tied head once where one stage holds it (ModelShape.tied_embeddings)
SHAPE_ARGS = ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "tie_embeddings")


def config_of(model_args: dict, data_args: dict) -> GPTConfig:
    """The GPTConfig a ``lightning-3d fit`` config builds (vocabulary and length from the data, as the CLI links them)."""
    overrides = {k: model_args.get(k) for k in SHAPE_ARGS}
    overrides["vocab_size"] = model_args.get("vocab_size") or data_args.get("tokenizer_vocab_size")
    overrides["seq_length"] = data_args.get("seq_length") or model_args.get("seq_length")
    return preset(model_args.get("preset_name", "tiny"), **overrides)


def shape_of(config: GPTConfig, bytes_per_element: int = 2, tensor_parallel_size: int = 1) -> ModelShape:
    """``config`` as the planner's ``ModelShape`` (vocabulary padded for ``tensor_parallel_size``)."""
    return ModelShape("gpt", config.num_layers, config.hidden_size, config.num_heads, config.ffn_size,
                      config.padded_vocab_size(tensor_parallel_size), bytes_per_element=bytes_per_element,
                      tied_embeddings=bool(config.tie_embeddings))


def workload(model_args: dict, data_args: dict, bytes_per_element: int) -> tuple[ModelShape, int, None]:
    config = config_of(model_args, data_args)
    return shape_of(config, bytes_per_element), config.seq_length, None


#: Data modules whose batches are whole sequences of one length (``varies_microbatch_shapes = False``): what the
#: strategy slices over the cp ranks. The multi-task module cuts variable-length or packed micro-batches (document
#: masks), which context-parallel attention refuses (docs/context_parallel.md).
WHOLE_SEQUENCE_DATA = ("lightning_3d.recipes.data.CausalLMDataModule", "lightning_3d.recipes.data.causal_lm.CausalLMDataModule",
                       "lightning_3d.recipes.data.SyntheticLMDataModule",
                       "lightning_3d.recipes.data.synthetic.SyntheticLMDataModule")


def context_parallel(model_args: dict, data_class_path: str | None, data_args: dict) -> str | None:
    """Why this config cannot train with context_parallel_size > 1 (``RecipeCosts.context_parallel``), or None: the
    GPT refuses attention dropout with cp (``GPT.enable_context_parallel``), and the strategy slices only whole
    sequences of one length (a config without a data module brings its own loaders: taken as such)."""
    dropout = model_args.get("dropout")
    if dropout is None:  # the preset's (config_of reads only the shape's fields)
        dropout = preset(model_args.get("preset_name", "tiny")).dropout
    if dropout > 0:
        return (f"the GPT's dropout={dropout} (attention dropout needs one mask around the ring, which context"
                " parallelism refuses; set model.init_args.dropout: 0.0 to plan with it)")
    if data_class_path is not None and data_class_path not in WHOLE_SEQUENCE_DATA:
        return (f"the data module {data_class_path} is not one whose batches are whole sequences of one length"
                f" ({', '.join(WHOLE_SEQUENCE_DATA[::2])}); context parallelism slices only those")
    return None


def layers(model_args: dict, data_args: dict, shape: ModelShape, device: torch.device) -> dict:
    # Positions for the longest profiled length; the vocabulary as the shape (padded) says.
    config = replace(config_of(model_args, data_args), vocab_size=shape.vocab_size)
    config = replace(config, seq_length=max(config.seq_length, 8192))
    h, vocab = config.hidden_size, config.vocab_size
    head = nn.ModuleDict({"norm": nn.LayerNorm(h), "head": LMHead(h, vocab, vocab)})

    def hidden(b, s, t, dtype):
        return (torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True),)

    return {
        "embedding": (Embedding(config, vocab), lambda b, s, t, dtype: (torch.randint(0, vocab, (b, s), device=device),),
                      lambda m, ids: m(ids)),
        "block": (Block(config), hidden, lambda m, x: m(x)),
        "head": (head, lambda b, s, t, dtype: (*hidden(b, s, t, dtype), torch.randint(0, vocab, (b, s), device=device)),
                 lambda m, x, y: F.cross_entropy(m["head"](m["norm"](x)).float().flatten(0, 1), y.flatten())),
    }


def tensor_parallel(kind: str, module: nn.Module, mesh) -> bool:
    """A block from ``layers`` sharded by the recipe's own plan (``parallelize_gpt``) over ``mesh``; the embedding and
    head are left to the planner's derivation (False)."""
    if kind != "block":
        return False
    from lightning_3d.recipes.gpt.parallelize import parallelize_gpt

    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": module})
    parallelize_gpt(holder, mesh)
    return True


def build_tiny(model_args: dict, data_args: dict, batch_size: int, num_samples: int):
    """A ``GPT`` and its synthetic data module (``RecipeCosts.tiny``: the profiler's in-situ runs)."""
    from lightning_3d.recipes.data.synthetic import SyntheticLMDataModule
    from lightning_3d.recipes.gpt.module import GPT

    data = SyntheticLMDataModule(batch_size=batch_size, num_samples=num_samples, **data_args)
    return GPT(**model_args), data


def tiny_at_depth(model_args: dict, shape: ModelShape) -> dict:
    return dict(model_args, num_layers=shape.num_layers)


TINY = TinyModel(dict(preset_name="tiny", vocab_size=512, seq_length=64, num_layers=1),
                 dict(vocab_size=512, seq_length=64), build_tiny, tiny_at_depth)

register_recipe(CLASS_PATHS, RecipeCosts(workload, layers, tensor_parallel, shape=shape_of, config_types=(GPTConfig,),
                                         tiny=TINY, optimizer=adamw_arguments, context_parallel=context_parallel))
