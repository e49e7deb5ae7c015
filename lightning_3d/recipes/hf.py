"""Hugging Face ``GPT2LMHeadModel`` interop: exact weight mapping both ways, :func:`export_checkpoint` of sharded
checkpoints of any (dp, pp, tp) layout (``lightning-3d export``), and :func:`gpt_from_pretrained` for fine-tuning
GPT-2 weights under any layout (its ``init_weights`` copies them into every rank's pruned, sharded parameters)."""

from __future__ import annotations

import inspect
import json
import os
import warnings
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from lightning_3d.checkpoint.files import META_FILE, check_dcp_metadata, safe_load, verify
from lightning_3d.recipes.data.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_STATE_KEY,
    ByteTokenizer,
    FastTokenizer,
    PretrainedTokenizer,
    load_tokenizer,
)
from lightning_3d.recipes.gpt.config import GPTConfig
from lightning_3d.recipes.gpt.model import copy_full_into
from lightning_3d.recipes.gpt.module import GPT

# Our block sub-modules -> GPT-2's; all but the LayerNorms are Conv1D (weight stored as [in, out]).
_BLOCK = {"ln1": "ln_1", "ln2": "ln_2", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_MUST_MATCH = ("vocab_size", "num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "layer_norm_eps", "tie_embeddings")
_FROM_HF = (*_MUST_MATCH, "seq_length", "dropout", "key_bias")
_PRETRAINED_ONLY = ("pretrained_path", "layer_norm_eps")  # PretrainedGPT's arguments beyond GPT's
# Hyper-parameters `lightning-3d fit` links from the data module into every model's (for T5); a GPT checkpoint written
# by the CLI records them although GPT takes no such argument: read, never refused.
CLI_LINKED = ("pad_token_id", "eos_token_id")
_UNSUPPORTED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
                "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,)}


def gpt_param_names(config: GPTConfig) -> list[str]:
    """Our parameter names in model order (``head.weight`` only when untied)."""
    names = ["embed.wte.weight", "embed.wpe.weight"]
    for i in range(config.num_layers):
        for mod in ("ln1", "attn.q", "attn.k", "attn.v", "attn.proj", "ln2", "mlp.fc", "mlp.proj"):
            names += [f"layers.{i}.{mod}.weight"] + [f"layers.{i}.{mod}.bias"] * (mod != "attn.k" or config.key_bias)
    return names + ["norm.weight", "norm.bias"] + ["head.weight"] * (not config.tie_embeddings)


def gpt_to_hf_state_dict(state: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Our full (possibly vocab-padded) state dict -> ``GPT2LMHeadModel``'s, padding rows dropped."""
    v, h = config.vocab_size, config.hidden_size
    out = {"transformer.wte.weight": state["embed.wte.weight"][:v], "transformer.wpe.weight": state["embed.wpe.weight"]}
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        qkv = [state[f"{ours}attn.{x}.weight"] for x in "qkv"]
        k_bias = state.get(f"{ours}attn.k.bias", qkv[0].new_zeros(h))
        out[theirs + "attn.c_attn.weight"] = torch.cat(qkv).t()
        out[theirs + "attn.c_attn.bias"] = torch.cat([state[f"{ours}attn.q.bias"], k_bias, state[f"{ours}attn.v.bias"]])
        for mod, hf in _BLOCK.items():
            w = state[f"{ours}{mod}.weight"]
            out[f"{theirs}{hf}.weight"], out[f"{theirs}{hf}.bias"] = w if "ln" in mod else w.t(), state[f"{ours}{mod}.bias"]
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = state["norm.weight"], state["norm.bias"]
    out["lm_head.weight"] = out["transformer.wte.weight"] if config.tie_embeddings else state["head.weight"][:v]
    return {k: t.detach().contiguous() for k, t in out.items()}


def _hf_name(key: str) -> str:
    """GPT2Model files (and the original GPT-2 ones) name weights without the ``transformer.`` prefix."""
    return key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key


def _from_hf(name: str, get, config: GPTConfig) -> Tensor:
    """The full, unpadded tensor of our parameter ``name``; ``get(hf_name)`` reads one of GPT-2's."""
    h = config.hidden_size
    if name.startswith("embed."):
        t = get(f"transformer.{name[6:]}")
        return t[: config.seq_length] if "wpe" in name else t
    if name == "head.weight" or name.startswith("norm."):
        return get("lm_head.weight" if name == "head.weight" else "transformer.ln_f." + name[5:])
    _, i, rest = name.split(".", 2)
    mod, kind = rest.rsplit(".", 1)
    if mod in ("attn.q", "attn.k", "attn.v"):
        j, t = "qkv".index(mod[-1]), get(f"transformer.h.{i}.attn.c_attn.{kind}")
        return t[:, j * h : (j + 1) * h].t() if kind == "weight" else t[j * h : (j + 1) * h]
    t = get(f"transformer.h.{i}.{_BLOCK[mod]}.{kind}")
    return t.t() if kind == "weight" and "ln" not in mod else t


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """``t`` with zero rows appended up to ``rows`` (the vocabulary padded to a multiple of 128 x tp)."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _gpt_config_from_hf(hf: dict, get, source: str = "The model") -> GPTConfig:
    """Our config for a GPT-2 config (key bias on iff one is non-zero); refuses what our model cannot reproduce."""
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"{source} has model_type={hf.get('model_type')!r}; only GPT-2 ('gpt2') models can be imported.")
    for field, ok in _UNSUPPORTED.items():
        if hf.get(field, ok[0]) not in ok:
            raise ValueError(f"{source} has {field}={hf[field]!r}; the GPT recipe supports only {list(ok)}.")
    h = hf["n_embd"]
    key_bias = any(get(f"transformer.h.{i}.attn.c_attn.bias")[h : 2 * h].any().item() for i in range(hf["n_layer"]))
    return GPTConfig(vocab_size=hf["vocab_size"], seq_length=hf["n_positions"], num_layers=hf["n_layer"], hidden_size=h,
                     num_heads=hf["n_head"], ffn_hidden_size=hf.get("n_inner"), dropout=hf.get("resid_pdrop", 0.0),
                     layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5), tie_embeddings=hf.get("tie_word_embeddings", True),
                     key_bias=key_bias, init_std=hf.get("initializer_range", 0.02))


def hf_to_gpt_state_dict(hf_state: dict[str, Tensor], hf_config: Any) -> tuple[dict[str, Tensor], GPTConfig]:
    """GPT-2 weights and config (or its dict) -> (our state dict with vocab zero-padded and ``head.weight``, config)."""
    state = {_hf_name(k): v for k, v in hf_state.items()}
    get = lambda k: state[k] if k in state or k != "lm_head.weight" else state["transformer.wte.weight"]  # noqa: E731
    config = _gpt_config_from_hf(hf_config if isinstance(hf_config, dict) else hf_config.to_dict(), get)
    out = {n: _from_hf(n, get, config) for n in gpt_param_names(config) + ["head.weight"] * config.tie_embeddings}
    out.update({n: pad_rows(out[n], config.padded_vocab_size(1)) for n in ("embed.wte.weight", "head.weight")})
    return {k: v.contiguous() for k, v in out.items()}, config


def hf_config_for(config: GPTConfig, eos_token_id: int | None = None):
    """The ``GPT2Config`` of our config (our one dropout for all three of GPT-2's)."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=config.vocab_size, n_positions=config.seq_length, n_embd=config.hidden_size,
                      n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.ffn_hidden_size,
                      activation_function="gelu_new", resid_pdrop=config.dropout, embd_pdrop=config.dropout,
                      attn_pdrop=config.dropout, layer_norm_epsilon=config.layer_norm_eps, initializer_range=config.init_std,
                      tie_word_embeddings=config.tie_embeddings, bos_token_id=eos_token_id, eos_token_id=eos_token_id)


# ----- export ------------------------------------------------------------------------------------------------
def config_from_hparams(hparams: dict | None, source: str = "The checkpoint") -> GPTConfig:
    """The config of a GPT (or PretrainedGPT) module's hyper-parameters; a clear error for any other module."""
    hp = dict(hparams or {})
    class_path = hp.pop("_class_path", None)  # LightningCLI's; "_instantiator" is dropped with it
    hp = {k: v for k, v in hp.items() if not k.startswith("_") and k not in CLI_LINKED}
    unknown = sorted(set(hp) - (set(inspect.signature(GPT.__init__).parameters) | set(_PRETRAINED_ONLY)))
    recipe = RECIPE_CLASS_PATHS.get(class_path) if class_path else "gpt"
    if recipe != "gpt" or unknown or not hp:
        found = f"class {class_path}, " if class_path else ""
        known = f" (known classes: {sorted(RECIPE_CLASS_PATHS)}; a class path read from a checkpoint is matched against" \
                " these, never imported)" if class_path and recipe is None else ""
        raise ValueError(f"{source} is not a checkpoint of the GPT recipe: found {found}hyper-parameters "
                         f"{sorted(hp) or 'none'}{f' (not GPT arguments: {unknown})' if unknown else ''}{known}.")
    config = GPT(**{k: v for k, v in hp.items() if k not in _PRETRAINED_ONLY}).config
    return replace(config, layer_norm_eps=hp.get("layer_norm_eps") or config.layer_norm_eps)


# The recipe modules export knows, by every class path LightningCLI may record for them, and the recipe each belongs
# to. A class path read from a checkpoint is looked up here, never imported (importing runs a module's code);
# tests/test_checkpoint_safety.py checks that each path names a subclass of its recipe.
RECIPE_CLASS_PATHS: dict[str, str] = {
    "lightning_3d.recipes.GPT": "gpt", "lightning_3d.recipes.gpt.GPT": "gpt",
    "lightning_3d.recipes.gpt.module.GPT": "gpt", "lightning_3d.recipes.hf.PretrainedGPT": "gpt",
    "lightning_3d.recipes.T5": "t5", "lightning_3d.recipes.t5.T5": "t5",
    "lightning_3d.recipes.t5.module.T5": "t5", "lightning_3d.recipes.hf_t5.PretrainedT5": "t5",
}


def checkpoint_hparams(path: Path) -> dict | None:
    """The module hyper-parameters a lightning_3d checkpoint directory records (verified against its manifest,
    read without running code); an error for anything else."""
    verify(path, collective=False)  # export may run on one rank of a job
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a lightning_3d checkpoint: expected a directory with .metadata and "
                                f"{META_FILE}, as Compressed3DStrategy's trainer.save_checkpoint writes.")
    return safe_load(path / META_FILE, map_location="cpu").get("hyper_parameters")


def stored_tokenizer_files(path: Path) -> dict[str, bytes] | None:
    """The tokenizer files the data module of a checkpoint stored in it (the recipes' data modules do, see
    ``TOKENIZER_STATE_KEY``), else None. Call after :func:`checkpoint_hparams` (which verifies the directory)."""
    meta = safe_load(path / META_FILE, map_location="cpu")
    for value in meta.values():
        if isinstance(value, dict) and isinstance(value.get(TOKENIZER_STATE_KEY), dict):
            return value[TOKENIZER_STATE_KEY]
    return None


def checkpoint_entries(path: Path, names: list[str], what: str) -> dict[str, tuple[str, Any]]:
    """Our name -> (DCP name, tensor metadata) of the model tensors of a checkpoint that must hold all ``names``
    (and all its shard files); ``what`` names the model in the error."""
    check_dcp_metadata(path)  # DCP unpickles .metadata: refuse anything but its own classes first
    md = dcp.FileSystemReader(str(path)).read_metadata()
    found = {where[1].removeprefix("model."): (where[1], md.state_dict_metadata[key])
             for key, where in md.planner_data.items() if len(where) == 2 and where[0] == "model"}
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"Checkpoint {path} is incomplete for its {what}: missing "
                         f"{missing[:5]}{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}.")
    absent = sorted({i.relative_path for i in md.storage_data.values()} - {f.name for f in path.iterdir()})
    if absent:
        raise ValueError(f"Checkpoint {path} is incomplete: shard files {absent[:5]} are missing.")
    return found


def load_model_tensors(path: Path, entries: dict[str, tuple[str, Any]], names: list[str]) -> dict[str, Tensor]:
    """Full tensors of ``names`` (no optimizer state), shards merged by DCP, without a process group."""
    state = {entries[n][0]: torch.empty(entries[n][1].size, dtype=entries[n][1].properties.dtype) for n in names}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    return {n: state[entries[n][0]] for n in names}


def _check_checkpoint(path: Path) -> tuple[GPTConfig, dict[str, tuple[str, Any]]]:
    """(config, our name -> (DCP name, tensor metadata)) of a complete GPT checkpoint directory, else an error."""
    config = config_from_hparams(checkpoint_hparams(path), f"Checkpoint {path}")
    found = checkpoint_entries(path, gpt_param_names(config), f"{config.num_layers}-layer GPT")
    if (shape := found["embed.wte.weight"][1].size)[0] < config.vocab_size or shape[1] != config.hidden_size:
        raise ValueError(f"Checkpoint {path}: embed.wte.weight is {list(shape)}, not [>={config.vocab_size}, {config.hidden_size}].")
    return config, found


def _byte_level_tokenizer():
    """The ``tokenizers`` twin of :class:`ByteTokenizer`: id b for byte b, ``<|endoftext|>`` is 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    shown = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's bytes_to_unicode
    chars = [chr(b) if b in shown else chr(256 + sum(c not in shown for c in range(b))) for b in range(256)]
    tokenizer = Tokenizer(models.BPE(vocab={**{c: b for b, c in enumerate(chars)}, EOS_TOKEN: 256}, merges=[]))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN])
    return tokenizer


def hf_tokenizer(tokenizer: Any, model_max_length: int | None = None):
    """A ``transformers`` tokenizer (eos = bos = unk = the end-of-text token) from a ``tokenizer.json`` or
    tokenizer directory, ``"bytes"``, one of our tokenizer objects, or a ``CausalLMDataModule``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    if hasattr(tokenizer, "load_text_tokenizer"):  # a CausalLMDataModule: its (cached) tokenizer
        tokenizer = tokenizer.load_text_tokenizer()
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(str(tokenizer))  # "bytes" or a local path; errors name what it accepts
    tokenizer = FastTokenizer(tokenizer) if isinstance(tokenizer, Tokenizer) else tokenizer
    tokenizer = FastTokenizer(_byte_level_tokenizer()) if isinstance(tokenizer, ByteTokenizer) else tokenizer
    tokenizer = tokenizer.tokenizer if isinstance(tokenizer, PretrainedTokenizer) else tokenizer
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    if not isinstance(tokenizer, FastTokenizer):
        raise TypeError(f"Cannot export a tokenizer of type {type(tokenizer).__name__}.")
    eos = tokenizer.tokenizer.id_to_token(tokenizer.eos_token_id)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer, eos_token=eos, bos_token=eos, unk_token=eos,
                                   clean_up_tokenization_spaces=False, model_max_length=model_max_length or int(1e30))


def export_checkpoint(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Write a GPT checkpoint directory of any layout as a ``GPT2LMHeadModel`` ``save_pretrained`` directory
    (plus ``tokenizer``, see :func:`hf_tokenizer`). Every check runs before anything is loaded or written."""
    from transformers import GPT2LMHeadModel

    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    config, entries = _check_checkpoint(checkpoint_dir)
    if output_dir.resolve() == checkpoint_dir.resolve() or output_dir.is_file():
        raise ValueError(f"Output {output_dir} must be a directory other than the checkpoint.")
    tok = None if tokenizer is None else hf_tokenizer(tokenizer, config.seq_length)
    if tok is not None and len(tok) > config.vocab_size:
        raise ValueError(f"The tokenizer has {len(tok)} tokens but the model only vocab_size={config.vocab_size}.")
    state = gpt_to_hf_state_dict(load_model_tensors(checkpoint_dir, entries, gpt_param_names(config)), config)
    with torch.device("meta"):  # no random init: every weight is assigned
        model = GPT2LMHeadModel(hf_config_for(config, None if tok is None else tok.eos_token_id))
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()  # lm_head is wte again when tied (a no-op otherwise)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    if tok is not None:
        tok.save_pretrained(output_dir)
    return output_dir


# ----- import for fine-tuning --------------------------------------------------------------------------------
def hf_weights(path: Path, rename=None, fallbacks: dict[str, str] | None = None):
    """``get(name)`` over a ``save_pretrained`` directory, reading one tensor at a time from safetensors. Names are the
    files' keys through ``rename`` (default: GPT-2's, with the ``transformer.`` prefix); a missing name is read as its
    ``fallbacks`` entry (a tied weight stored once). ``get.names`` is the set of stored names."""
    rename = rename or _hf_name
    fallbacks = {"lm_head.weight": "transformer.wte.weight"} if fallbacks is None else fallbacks
    from safetensors import safe_open

    index, single, pickled = (path / n for n in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin"))
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            files = dict.fromkeys(f.keys(), single)
    elif index.is_file():
        files = {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    elif pickled.is_file():
        files = dict.fromkeys(state := torch.load(pickled, map_location="cpu", weights_only=True, mmap=True))
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors(.index.json) or pytorch_model.bin.")
    files = {rename(k): (k, v) for k, v in files.items()}

    @lru_cache(maxsize=4)  # q, k and v are slices of one c_attn tensor
    def get(name: str) -> Tensor:
        raw, file = files[name if name in files or name not in fallbacks else fallbacks[name]]
        if file is None:
            return state[raw]
        with safe_open(str(file), "pt") as f:
            return f.get_tensor(raw)

    get.names = set(files)
    return get


def _pretrained_kwargs(path: Path, overrides: dict) -> dict:
    """GPT arguments for the GPT-2 model at ``path``; requested overrides of its shape must agree with it."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json).")
    hf = json.loads((path / "config.json").read_text())  # weights are opened only once the config is a GPT-2's
    config = _gpt_config_from_hf(hf, lambda name: hf_weights(path)(name), str(path))
    ours = {**config.to_dict(), "ffn_hidden_size": config.ffn_size}
    for field in _MUST_MATCH:
        if overrides.get(field) is not None and overrides[field] != ours[field]:
            raise ValueError(f"{field}={overrides[field]} was requested but the GPT-2 model at {path} has {field}={ours[field]}.")
    if (overrides.get("seq_length") or 0) > config.seq_length:
        raise ValueError(f"seq_length={overrides['seq_length']} was requested but {path} has only {config.seq_length} positions.")
    return {**{f: getattr(config, f) for f in _FROM_HF}, **{k: v for k, v in overrides.items() if v is not None}}


class PretrainedGPT(GPT):
    """:class:`GPT` starting from a GPT-2 ``save_pretrained`` directory instead of random weights. Fields left ``None``
    come from its config; given ones must agree (``seq_length`` may be shorter; ``dropout`` and ``key_bias`` may
    differ). Resolved values land in ``hparams``: checkpoints export without the directory."""

    def __init__(self, pretrained_path: str, layer_norm_eps: float | None = None, **kwargs: Any) -> None:
        kwargs = _pretrained_kwargs(Path(pretrained_path), {**kwargs, "layer_norm_eps": layer_norm_eps})
        eps = kwargs.pop("layer_norm_eps")
        super().__init__(**kwargs)  # literally `**kwargs`: jsonargparse then offers GPT's arguments on the CLI
        self.config = replace(self.config, layer_norm_eps=eps)
        self.hparams.update(pretrained_path=str(pretrained_path), layer_norm_eps=eps, **kwargs)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter (this rank's shard of it) gets its GPT-2 tensor; vocabulary padding rows are zero."""
        weights, config = hf_weights(Path(self.hparams.pretrained_path)), self.config
        for name, param in self.model.named_parameters():
            key = "embed.wte.weight" if name == "head.weight" and config.tie_embeddings else name
            copy_full_into(param, pad_rows(_from_hf(key, weights, config), param.shape[0]).to(param.device, param.dtype))
        head = self.model.head
        if head is not None and head.padding_mask is not None:
            mask = torch.zeros(head.out_features, device=head.weight.device)
            mask[config.vocab_size :] = float("-inf")
            copy_full_into(head.padding_mask, mask)


def gpt_from_pretrained(path: str | os.PathLike, **gpt_kwargs: Any) -> PretrainedGPT:
    """A :class:`GPT` (:class:`PretrainedGPT`) that materialises with the weights of the GPT-2 model at ``path``."""
    return PretrainedGPT(str(path), **gpt_kwargs)
