"""Hugging Face ``T5ForConditionalGeneration`` interop: exact weight mapping both ways, :func:`export_t5_checkpoint`
of sharded checkpoints of any (dp, pp, tp) layout, and :func:`t5_from_pretrained` to start the T5 recipe from a local
``save_pretrained`` directory under any layout (its ``init_weights`` copies every rank's shards from the files).

Our names map one to one onto transformers' (``encoder.3.ff.wi_0`` <-> ``encoder.block.3.layer.1.DenseReluDense.wi_0``);
the relative-bias tables are transformers' block-0 ``relative_attention_bias`` of each stack.
"""

from __future__ import annotations

import inspect
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_3d.recipes.gpt.model import copy_full_into
from lightning_3d.recipes.hf import (
    RECIPE_CLASS_PATHS,
    checkpoint_entries,
    checkpoint_hparams,
    hf_tokenizer,
    hf_weights,
    load_model_tensors,
    pad_rows,
)
from lightning_3d.recipes.t5.config import FEED_FORWARD, T5Config
from lightning_3d.recipes.t5.model import T5Model
from lightning_3d.recipes.t5.module import T5

_BLOCK = {
    "encoder": {"self_attn_norm": "layer.0.layer_norm", "self_attn": "layer.0.SelfAttention",
                "ff_norm": "layer.1.layer_norm", "ff": "layer.1.DenseReluDense"},
    "decoder": {"self_attn_norm": "layer.0.layer_norm", "self_attn": "layer.0.SelfAttention",
                "cross_attn_norm": "layer.1.layer_norm", "cross_attn": "layer.1.EncDecAttention",
                "ff_norm": "layer.2.layer_norm", "ff": "layer.2.DenseReluDense"},
}
_FIXED = {"shared.weight": "shared.weight", "lm_head.weight": "lm_head.weight",
          "encoder_norm.weight": "encoder.final_layer_norm.weight", "decoder_norm.weight": "decoder.final_layer_norm.weight",
          "encoder_relative_bias.weight": "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
          "decoder_relative_bias.weight": "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"}
_MUST_MATCH = ("vocab_size", "num_layers", "num_decoder_layers", "hidden_size", "num_heads", "head_dim", "ffn_hidden_size",
               "feed_forward", "tie_embeddings", "relative_attention_num_buckets", "relative_attention_max_distance")
_FROM_HF = (*_MUST_MATCH, "layer_norm_eps", "dropout", "pad_token_id", "eos_token_id", "decoder_start_token_id")
_VOCAB_ROWS = ("shared.weight", "lm_head.weight")


def t5_param_names(config: T5Config) -> list[str]:
    """Our parameter names in model order (``lm_head.weight`` only when untied)."""
    with torch.device("meta"):
        return [name for name, _ in T5Model(config).named_parameters()]


def hf_key(name: str) -> str:
    """transformers' name of our parameter ``name``."""
    if name in _FIXED:
        return _FIXED[name]
    stack, index, module, rest = name.split(".", 3)
    return f"{stack}.block.{index}.{_BLOCK[stack][module]}.{rest}"


def t5_to_hf_state_dict(state: dict[str, Tensor], config: T5Config) -> dict[str, Tensor]:
    """Our full (possibly vocab-padded) state dict -> ``T5ForConditionalGeneration``'s, padding rows dropped."""
    v = config.vocab_size
    out = {hf_key(n): (state[n][:v] if n in _VOCAB_ROWS else state[n]) for n in t5_param_names(config)}
    out["encoder.embed_tokens.weight"] = out["decoder.embed_tokens.weight"] = out["shared.weight"]
    if config.tie_embeddings:
        out["lm_head.weight"] = out["shared.weight"]
    return {k: t.detach().contiguous() for k, t in out.items()}


def hf_config_for(config: T5Config):
    """The transformers ``T5Config`` of our config."""
    from transformers import T5Config as HFConfig

    return HFConfig(vocab_size=config.vocab_size, d_model=config.hidden_size, d_kv=config.head_dim, d_ff=config.ffn_size,
                    num_layers=config.num_layers, num_decoder_layers=config.decoder_layers, num_heads=config.num_heads,
                    relative_attention_num_buckets=config.relative_attention_num_buckets,
                    relative_attention_max_distance=config.relative_attention_max_distance, dropout_rate=config.dropout,
                    layer_norm_epsilon=config.layer_norm_eps, initializer_factor=config.init_factor,
                    feed_forward_proj=config.feed_forward, tie_word_embeddings=config.tie_embeddings,
                    pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id,
                    decoder_start_token_id=config.start_token_id)


def t5_config_from_hf(hf: dict, source: str = "The model") -> T5Config:
    """Our config for a transformers T5 config dict; refuses what our model cannot reproduce, naming it."""
    if hf.get("model_type") != "t5":
        raise ValueError(f"{source} has model_type={hf.get('model_type')!r}; only T5 ('t5') models can be imported"
                         " into the T5 recipe (GPT-2 models: gpt_from_pretrained).")
    if (proj := hf.get("feed_forward_proj", "relu")) not in FEED_FORWARD:
        raise ValueError(f"{source} has feed_forward_proj={proj!r}; the T5 recipe supports {list(FEED_FORWARD)}.")
    # transformers >= 5 always sets tie_word_embeddings and says "untied" with scale_decoder_outputs=False.
    tied = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True)) is not False
    pad, start = hf.get("pad_token_id", 0), hf.get("decoder_start_token_id")
    return T5Config(vocab_size=hf["vocab_size"], num_layers=hf["num_layers"], num_decoder_layers=hf.get("num_decoder_layers"),
                    hidden_size=hf["d_model"], num_heads=hf["num_heads"], head_dim=hf["d_kv"], ffn_hidden_size=hf["d_ff"],
                    feed_forward=proj, tie_embeddings=tied,
                    relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
                    relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
                    dropout=hf.get("dropout_rate", 0.0), layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6),
                    init_factor=hf.get("initializer_factor", 1.0), pad_token_id=pad, eos_token_id=hf.get("eos_token_id", 1),
                    decoder_start_token_id=None if start in (None, pad) else start)


@lru_cache(maxsize=8)
def _shapes(config: T5Config) -> dict[str, torch.Size]:
    """Unpadded shape of every parameter of ``config`` (a tied ``lm_head.weight`` included)."""
    with torch.device("meta"):
        model = T5Model(config, config.vocab_size)
    return {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}


def _from_hf(name: str, get, config: T5Config, source: str) -> Tensor:
    """The full, unpadded tensor of our parameter ``name``; its shape must be what ``config`` implies."""
    tensor = get("shared.weight" if name == "lm_head.weight" and config.tie_embeddings else hf_key(name))
    if tensor.shape != (expected := _shapes(config)[name]):
        raise ValueError(f"{source}: {hf_key(name)} has shape {list(tensor.shape)} but its config implies {list(expected)}"
                         " (mismatched sizes: the weights do not belong to this config).")
    return tensor


def hf_to_t5_state_dict(hf_state: dict[str, Tensor], hf_config: Any) -> tuple[dict[str, Tensor], T5Config]:
    """transformers T5 weights and config (or its dict) -> (our state dict, vocab zero-padded, ``lm_head.weight``, config)."""
    config = t5_config_from_hf(hf_config if isinstance(hf_config, dict) else hf_config.to_dict())
    fallback = {"lm_head.weight": "shared.weight", "shared.weight": "encoder.embed_tokens.weight"}
    get = lambda k: hf_state[k] if k in hf_state or k not in fallback else hf_state[fallback[k]]  # noqa: E731
    names = t5_param_names(config) + ["lm_head.weight"] * config.tie_embeddings
    out = {n: _from_hf(n, get, config, "The state dict") for n in names}
    out.update({n: pad_rows(out[n], config.padded_vocab_size(1)) for n in _VOCAB_ROWS})
    return {k: v.contiguous() for k, v in out.items()}, config


# ----- export ------------------------------------------------------------------------------------------------
def _t5_arguments() -> set[str]:
    return set(inspect.signature(T5.__init__).parameters) | {"pretrained_path"}


def is_t5_hparams(hparams: dict | None) -> bool:
    """Whether a checkpoint's hyper-parameters are the T5 recipe's (its class path, else its argument names)."""
    hp = dict(hparams or {})
    if class_path := hp.get("_class_path"):
        return RECIPE_CLASS_PATHS.get(class_path) == "t5"  # looked up, never imported
    keys = {k for k in hp if not k.startswith("_")}
    return bool(keys) and keys <= _t5_arguments() and "feed_forward" in keys


def t5_config_from_hparams(hparams: dict | None, source: str = "The checkpoint") -> T5Config:
    """The config of a T5 (or PretrainedT5) module's hyper-parameters; a clear error for any other module."""
    hp = dict(hparams or {})
    class_path = hp.pop("_class_path", None)
    hp = {k: v for k, v in hp.items() if not k.startswith("_")}
    unknown = sorted(set(hp) - _t5_arguments())
    if not is_t5_hparams({**hp, **({"_class_path": class_path} if class_path else {})}) or unknown:
        found = f"class {class_path}, " if class_path else ""
        known = f" (known classes: {sorted(RECIPE_CLASS_PATHS)}; a class path read from a checkpoint is matched against" \
                " these, never imported)" if class_path and class_path not in RECIPE_CLASS_PATHS else ""
        raise ValueError(f"{source} is not a checkpoint of the T5 recipe: found {found}hyper-parameters "
                         f"{sorted(hp) or 'none'}{f' (not T5 arguments: {unknown})' if unknown else ''}{known}.")
    return T5(**{k: v for k, v in hp.items() if k != "pretrained_path"}).config


def t5_hf_tokenizer(tokenizer: Any, config: T5Config):
    """A transformers tokenizer for the model: :func:`~lightning_3d.recipes.hf.hf_tokenizer`'s, plus (unless it has
    them, as a T5 tokenizer does) ``<pad>`` at ``pad_token_id`` and ``<extra_id_k>`` sentinels after it, the layout of
    :class:`~lightning_3d.recipes.data.Seq2SeqDataModule`."""
    tok = hf_tokenizer(tokenizer)
    if tok.pad_token_id is None or tok.pad_token_id != config.pad_token_id:
        if len(tok) > config.pad_token_id:
            raise ValueError(f"The tokenizer has {len(tok)} tokens, so <pad> cannot get the model's pad_token_id="
                             f"{config.pad_token_id}; export with the tokenizer the model was trained with.")
        tok.add_tokens([f"<unused_{i}>" for i in range(len(tok), config.pad_token_id)], special_tokens=True)
        sentinels = [f"<extra_id_{k}>" for k in range(config.vocab_size - config.pad_token_id - 1)]
        tok.add_special_tokens({"pad_token": "<pad>", "additional_special_tokens": sentinels})
    if len(tok) > config.vocab_size:
        raise ValueError(f"The tokenizer has {len(tok)} tokens but the model only vocab_size={config.vocab_size}.")
    return tok


def export_t5_checkpoint(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Write a T5 checkpoint directory of any layout as a ``T5ForConditionalGeneration`` ``save_pretrained`` directory
    (plus ``tokenizer``, see :func:`t5_hf_tokenizer`). Every check runs before anything is loaded or written."""
    from transformers import T5ForConditionalGeneration

    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    config = t5_config_from_hparams(checkpoint_hparams(checkpoint_dir), f"Checkpoint {checkpoint_dir}")
    names = t5_param_names(config)
    entries = checkpoint_entries(checkpoint_dir, names, f"{config.num_layers}+{config.decoder_layers}-layer T5")
    if (shape := entries["shared.weight"][1].size)[0] < config.vocab_size or shape[1] != config.hidden_size:
        raise ValueError(f"Checkpoint {checkpoint_dir}: shared.weight is {list(shape)}, not [>={config.vocab_size},"
                         f" {config.hidden_size}].")
    if output_dir.resolve() == checkpoint_dir.resolve() or output_dir.is_file():
        raise ValueError(f"Output {output_dir} must be a directory other than the checkpoint.")
    tok = None if tokenizer is None else t5_hf_tokenizer(tokenizer, config)
    state = t5_to_hf_state_dict(load_model_tensors(checkpoint_dir, entries, names), config)
    with torch.device("meta"):  # no random init: every weight is assigned
        model = T5ForConditionalGeneration(hf_config_for(config))
    model.load_state_dict(state, assign=True, strict=True)
    model.set_input_embeddings(model.shared)  # encoder/decoder embed_tokens are the shared embedding again
    if config.tie_embeddings:
        model.lm_head.weight = model.shared.weight
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    if tok is not None:
        tok.save_pretrained(output_dir)
    return output_dir


# ----- import -----------------------------------------------------------------------------------------------
def _pretrained(path: Path) -> tuple[T5Config, Any]:
    """(config, ``get(transformers name)``) of the T5 model at ``path``; weights opened only for a T5 config."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json).")
    config = t5_config_from_hf(json.loads((path / "config.json").read_text()), str(path))
    get = hf_weights(path, rename=lambda k: k, fallbacks={"lm_head.weight": "shared.weight",
                                                            "shared.weight": "encoder.embed_tokens.weight"})
    if config.tie_embeddings and "lm_head.weight" in get.names and not torch.equal(get("lm_head.weight"), get("shared.weight")):
        raise ValueError(f"{path} ties lm_head to the shared embedding in its config, but stores a different lm_head.weight;"
                         " fix its config (tie_word_embeddings / scale_decoder_outputs) to describe the weights.")
    return config, get


class PretrainedT5(T5):
    """:class:`T5` starting from a transformers T5 ``save_pretrained`` directory instead of random weights. Fields left
    ``None`` come from its config; given architecture fields must agree (``dropout`` and the special token ids may
    differ). Resolved values land in ``hparams``: checkpoints export without the directory."""

    def __init__(self, pretrained_path: str, **kwargs: Any) -> None:
        path = Path(pretrained_path)
        config, _ = _pretrained(path)
        ours = config.to_dict() | {"num_decoder_layers": config.decoder_layers}
        for field in _MUST_MATCH:
            if kwargs.get(field) is not None and kwargs[field] != ours[field]:
                raise ValueError(f"{field}={kwargs[field]!r} was requested but the T5 model at {path} has"
                                 f" {field}={ours[field]!r} (mismatched sizes).")
        kwargs = {**{f: ours[f] for f in _FROM_HF}, **{k: v for k, v in kwargs.items() if v is not None}}
        super().__init__(**kwargs)  # literally `**kwargs`: jsonargparse then offers T5's arguments on the CLI
        self.hparams.update(pretrained_path=str(pretrained_path), **kwargs)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter (this rank's shard of it) gets its transformers tensor; vocabulary padding rows are zero."""
        path = Path(self.hparams.pretrained_path)
        config, get = _pretrained(path)
        for name, param in self.model.named_parameters():
            full = _from_hf(name, get, config, str(path))
            full = pad_rows(full, param.shape[0]) if name in _VOCAB_ROWS else full
            copy_full_into(param, full.to(param.device, param.dtype))
        self._reset_padding_mask()


def t5_from_pretrained(path: str | os.PathLike, **t5_kwargs: Any) -> PretrainedT5:
    """A :class:`T5` (:class:`PretrainedT5`) that materialises with the weights of the transformers T5 model at ``path``."""
    return PretrainedT5(str(path), **t5_kwargs)
