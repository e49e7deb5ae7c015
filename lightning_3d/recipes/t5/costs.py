"""How the planner and the profiler read the T5 recipe (registered with ``lightning_3d.costs.register_recipe``):
a training config's model and data sections as a ``ModelShape`` with input and target lengths (span corruption's
target length by T5's rule), a ``T5Config`` as a ``ModelShape``, the recipe's own layers (shared embedding,
``EncoderBlock``, ``DecoderBlock``, final norm + head + loss) as modules the profiler times one at a time, and the
tiny model it trains for the step's overheads (docs/planner.md)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.costs import ModelShape, RecipeCosts, TinyModel, register_recipe
from lightning_3d.recipes.data.span_corruption import span_lengths
from lightning_3d.recipes.gpt.model import LMHead
from lightning_3d.recipes.t5.config import T5Config, preset
from lightning_3d.recipes.t5.model import DecoderBlock, EncoderBlock, RMSNorm, position_bias
from lightning_3d.recipes.training import adamw_arguments

CLASS_PATHS = ("lightning_3d.recipes.T5", "lightning_3d.recipes.t5.T5", "lightning_3d.recipes.t5.module.T5")
# tie_embeddings: the planner counts a tied head once where one stage holds it (ModelShape.tied_embeddings)
SHAPE_ARGS = ("num_layers", "num_decoder_layers", "hidden_size", "num_heads", "head_dim", "ffn_hidden_size", "feed_forward",
              "tie_embeddings")
SPECIAL_TOKENS = 101  # <pad> and 100 sentinels on top of the text tokenizer (Seq2SeqDataModule)


def config_of(model_args: dict, data_args: dict) -> T5Config:
    config = preset(model_args.get("preset_name", "tiny"), **{k: model_args[k] for k in SHAPE_ARGS if model_args.get(k) is not None})
    if model_args.get("vocab_size"):
        return replace(config, vocab_size=int(model_args["vocab_size"]))
    if data_args.get("tokenizer_vocab_size"):
        return replace(config, vocab_size=int(data_args["tokenizer_vocab_size"]) + SPECIAL_TOKENS)
    return config


def lengths(data_args: dict) -> tuple[int, int]:
    seq = int(data_args.get("input_length", 128))
    target = data_args.get("target_length")
    if target is None:
        if data_args.get("objective", "span_corruption") == "span_corruption":
            target = span_lengths(seq, float(data_args.get("noise_density", 0.15)),
                                  float(data_args.get("mean_noise_span_length", 3.0)))[1]
        else:
            target = seq
    return seq, int(target)


def shape_of(config: T5Config, bytes_per_element: int = 2, tensor_parallel_size: int = 1) -> ModelShape:
    """``config`` as the planner's ``ModelShape`` (vocabulary padded for ``tensor_parallel_size``; any feed-forward
    but plain ReLU has two input projections)."""
    return ModelShape("t5", config.num_layers, config.hidden_size, config.num_heads, config.ffn_hidden_size,
                      config.padded_vocab_size(tensor_parallel_size), num_decoder_layers=config.decoder_layers,
                      head_dim=config.head_dim, gated_ffn=config.feed_forward != "relu",
                      bytes_per_element=bytes_per_element, tied_embeddings=bool(config.tie_embeddings))


def workload(model_args: dict, data_args: dict, bytes_per_element: int) -> tuple[ModelShape, int, int]:
    return (shape_of(config_of(model_args, data_args), bytes_per_element), *lengths(data_args))


def layers(model_args: dict, data_args: dict, shape: ModelShape, device: torch.device) -> dict:
    config = replace(config_of(model_args, data_args), vocab_size=shape.vocab_size)
    h, heads, vocab = config.hidden_size, config.num_heads, config.vocab_size
    table = torch.randn(config.relative_attention_num_buckets, heads, device=device)
    head = nn.ModuleDict({"norm": RMSNorm(h, config.layer_norm_eps), "head": LMHead(h, vocab, vocab)})

    def x_(b, n, dtype):
        return torch.randn(b, n, h, device=device, dtype=dtype, requires_grad=True)

    # The blocks' attention inputs as training passes them (model.run_stage): the position bias (1, heads, q, k) is
    # computed from a trained table, so every block's backward also reduces its gradient over the batch (a leaf here:
    # the profiler's repeats each run their own backward); the padding mask is an fp32 addend (batch, 1, 1, keys) on
    # the encoder's and the cross-attention's scores, one more pass over them (docs/planner.md "Profiles").
    def bias_(q, k, bidirectional):
        return position_bias(table, q, k, bidirectional, config).detach().requires_grad_()

    def keys_(b, k):
        return torch.zeros(b, 1, 1, k, device=device)

    return {
        "embedding": (nn.Embedding(vocab, h), lambda b, s, t, dtype: (torch.randint(0, vocab, (b, s + t), device=device),),
                      lambda m, ids: m(ids)),
        "encoder_block": (EncoderBlock(config),
                          lambda b, s, t, dtype: (x_(b, s, dtype), bias_(s, s, True), keys_(b, s)),
                          lambda m, x, bias, keys: m(x, bias, keys)),
        "decoder_block": (DecoderBlock(config), lambda b, s, t, dtype: (x_(b, t, dtype), x_(b, s, dtype),
                                                                        bias_(t, t, False), keys_(b, s)),
                          lambda m, y, memory, bias, cross: m(y, memory, bias, cross)),
        "head": (head, lambda b, s, t, dtype: (x_(b, t, dtype), torch.randint(0, vocab, (b, t), device=device)),
                 lambda m, x, y: F.cross_entropy(m["head"](m["norm"](x)).float().flatten(0, 1), y.flatten())),
    }


def build_tiny(model_args: dict, data_args: dict, batch_size: int, num_samples: int):
    """A ``T5`` and its synthetic data module, the model taking the data's special tokens (``RecipeCosts.tiny``)."""
    from lightning_3d.recipes.data.synthetic import SyntheticSeq2SeqDataModule
    from lightning_3d.recipes.t5.module import T5

    data = SyntheticSeq2SeqDataModule(batch_size=batch_size, num_samples=num_samples, **data_args)
    return T5(**model_args, pad_token_id=data.pad_token_id, eos_token_id=data.eos_token_id), data


def tiny_at_depth(model_args: dict, shape: ModelShape) -> dict:
    return dict(model_args, num_layers=shape.num_layers, num_decoder_layers=shape.num_decoder_layers)


TINY = TinyModel(dict(preset_name="tiny", vocab_size=512, num_layers=1, num_decoder_layers=1),
                 dict(vocab_size=512, input_length=32, target_length=16), build_tiny, tiny_at_depth)

register_recipe(CLASS_PATHS, RecipeCosts(workload, layers, shape=shape_of, config_types=(T5Config,), tiny=TINY,
                                         optimizer=adamw_arguments))
