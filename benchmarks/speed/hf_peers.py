"""The one-GPU peers of benchmarks/speed/peers.py that run in a plain loop: what a user would train with instead of us.

- ``plain``: our recipe's model (GPT or T5) in a hand-written loop; ``+compile`` compiles it per block, as the recipe
  does, ``+whole`` compiles the model *and its loss* as one ``torch.compile`` graph, as a user compiling a plain PyTorch
  model would (nanoGPT's ``model = torch.compile(model)`` with the loss inside ``forward``).
- ``hf``: transformers' ``GPT2LMHeadModel`` (SDPA attention) or ``T5ForConditionalGeneration`` built from a config (no
  download) with the recipe's initial weights copied in through our export mapping, so every system starts from the
  same weights and its first loss can be compared; ``+compile`` compiles the whole model and the loss.

Every system gets the same tokens, micro-batch and accumulation, bf16 autocast and fused AdamW; the loss is the same
fp32 token cross-entropy summed over the micro-batch and divided by its tokens and by the accumulation count.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_3d.recipes.training import COMPILE_BACKEND, summed_token_cross_entropy

Batch = dict[str, Tensor]


def sdpa_backends_of(system: dict) -> str | None:
    """The recipes' ``sdpa_backends`` for a system: +torchsdpa "torch", +nocudnn "no_cudnn", else the default (None:
    "auto", which on the peers' fixed shapes resolves to "torch")."""
    return "torch" if system.get("torchsdpa") else "no_cudnn" if system.get("nocudnn") else None


def recipe_module(args: argparse.Namespace, system: dict, compile: bool | str | None = None) -> Any:
    """The recipe's LightningModule (GPT or T5) with the system's options; ``compile`` overrides the system's."""
    from lightning_3d.recipes import GPT, T5

    if compile is None:
        compile = "max-autotune-no-cudagraphs" if system["autotune"] else system["compile"]
    common = dict(preset_name=args.preset, vocab_size=args.vocab_size, activation_checkpointing=system["ckpt"],
                  compile=compile, optimizer_fused=True, decay_steps=1000,
                  compile_scope="stage" if system.get("stage") else "block",
                  sdpa_backends=sdpa_backends_of(system))
    if args.model == "t5":
        module = T5(attention="explicit" if system.get("explicit") else "sdpa", **common)
    else:
        extra = {"fused_head_loss": True} if system.get("fusedce") else {}
        module = GPT(seq_length=args.seq_length, fp32_residual=system["fp32res"], **common, **extra)
    return module


def build_recipe_model(args: argparse.Namespace, system: dict, device: torch.device, compile: bool | str | None = None):
    """The recipe's module with its model built on ``device`` and initialised by name (as outside our strategy),
    compiled per block when its ``compile`` says so."""
    from lightning_3d.recipes.gpt.model import GPTModel
    from lightning_3d.recipes.t5.model import T5Model
    from lightning_3d.recipes.training import compile_blocks
    from lightning_3d.utils.tensors import materialize_

    module = recipe_module(args, system, compile)
    cls = T5Model if args.model == "t5" else GPTModel
    with torch.device("meta"):
        extra = {"attention": module.hparams.attention} if args.model == "t5" else {}
        module.model = cls(module.config, module.config.padded_vocab_size(1), system["ckpt"], **extra)
    if args.model == "gpt" and system.get("fusedce"):
        module.model.head.fused_with_loss = True  # what GPT.configure_model sets for fused_head_loss=True
    materialize_(module.model, device)
    module.init_weights()
    blocks = ([*module.model.encoder.values(), *module.model.decoder.values()] if args.model == "t5"
              else module.model.layers.values())
    compile_blocks(blocks, module.hparams.compile)
    return module


def model_inputs(args: argparse.Namespace, batch: Batch) -> dict[str, Tensor]:
    if args.model == "t5":
        return {k: batch[k] for k in ("input_ids", "decoder_input_ids", "attention_mask")}
    return {"input_ids": batch["input_ids"]}


class RecipeLoss(nn.Module):
    """Our model and its summed loss in one module: what ``+whole`` hands to ``torch.compile``."""

    def __init__(self, module: Any, args: argparse.Namespace) -> None:
        super().__init__()
        self.model, self.recipe, self.args = module.model, [module], args  # the LightningModule kept off the tree

    def forward(self, batch: Batch) -> Tensor:
        return self.recipe[0].pipeline_loss(self.model(**model_inputs(self.args, batch)), batch)


class HFLoss(nn.Module):
    """A transformers model and the same summed fp32 token cross-entropy as ours (labels are already shifted)."""

    def __init__(self, hf: nn.Module, args: argparse.Namespace) -> None:
        super().__init__()
        self.hf, self.args = hf, args

    def forward(self, batch: Batch) -> Tensor:
        logits = self.hf(**model_inputs(self.args, batch), use_cache=False).logits
        return summed_token_cross_entropy(logits, batch["labels"])


def hf_model(args: argparse.Namespace, system: dict, device: torch.device) -> nn.Module:
    """transformers' model of the preset's shape, holding the recipe's initial weights (unpadded vocabulary)."""
    from transformers import AutoModelForCausalLM, T5ForConditionalGeneration

    module = build_recipe_model(args, system, device, compile=False)
    state = {k: v for k, v in module.model.state_dict().items() if not k.endswith("padding_mask")}
    if args.model == "t5":
        from lightning_3d.recipes.hf_t5 import hf_config_for, t5_to_hf_state_dict

        config = hf_config_for(module.config)
        config.use_cache = False
        with torch.device(device):
            hf = T5ForConditionalGeneration(config)  # T5 has one attention implementation (explicit, relative bias)
        weights = t5_to_hf_state_dict(state, module.config)
    else:
        from lightning_3d.recipes.hf import gpt_to_hf_state_dict, hf_config_for

        config = hf_config_for(module.config)
        config.use_cache = False
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        weights = gpt_to_hf_state_dict(state, module.config)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    # Only non-persistent buffers may be absent from our state; an unmatched weight would make the peer another model.
    left = [k for k in missing if k in dict(hf.named_parameters())]
    if left or unexpected:
        raise RuntimeError(f"transformers' model does not take our weights: missing {left}, unexpected {unexpected}")
    return hf.train()


def plain_peer(args: argparse.Namespace, system: dict, device: torch.device) -> tuple[Callable[[Batch], Tensor],
                                                                                      torch.optim.Optimizer]:
    """(summed loss of a micro-batch, fused AdamW) of a ``plain`` or ``hf`` system."""
    if system["name"] == "hf":
        model = HFLoss(hf_model(args, system, device), args)
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wpe" not in n and "relative_attention" not in n]
        rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "wpe" not in n and "relative_attention" not in n)]
        hp = recipe_module(args, system, compile=False).hparams
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}],
                                      lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.adam_eps, fused=True)
        return (torch.compile(model, backend=COMPILE_BACKEND) if system["compile"] else model), optimizer
    module = build_recipe_model(args, system, device, compile=False if system["whole"] else None)
    optimizer = module.configure_optimizers()["optimizer"]
    loss = RecipeLoss(module, args)
    if not system["whole"]:
        return loss, optimizer
    # +cudagraphs: the compiled model and loss replayed as CUDA graphs (what a launch-bound step gains without host
    # work); +autotune: inductor benchmarks GEMM kernels (Triton templates with fused epilogues) against cuBLAS.
    modes = {(False, False): None, (True, False): "reduce-overhead", (False, True): "max-autotune-no-cudagraphs",
             (True, True): "max-autotune"}
    mode = modes[bool(system.get("cudagraphs")), bool(system.get("autotune"))] if COMPILE_BACKEND == "inductor" else None
    return torch.compile(loss, backend=COMPILE_BACKEND, mode=mode), optimizer


def synthetic_data(args: argparse.Namespace):
    """The samples every system trains on, in order (the recipes' synthetic data modules use the same sets)."""
    from lightning_3d.recipes.data.synthetic import SyntheticPairs, SyntheticTokens

    if args.model == "t5":
        return SyntheticPairs(args.vocab_size, args.seq_length, args.target_length, 10**9, seed=1234)
    return SyntheticTokens(args.vocab_size, args.seq_length, 10**9, seed=1234)


def synthetic_datamodule(args: argparse.Namespace, batch: int, num_samples: int):
    from lightning_3d.recipes.data import SyntheticLMDataModule, SyntheticSeq2SeqDataModule

    workers = args.num_workers  # peers.py's --num-workers
    if args.model == "t5":
        return SyntheticSeq2SeqDataModule(vocab_size=args.vocab_size, input_length=args.seq_length,
                                          target_length=args.target_length, batch_size=batch, num_samples=num_samples,
                                          shuffle=False, num_workers=workers)
    return SyntheticLMDataModule(vocab_size=args.vocab_size, seq_length=args.seq_length, batch_size=batch,
                                 num_samples=num_samples, shuffle=False, num_workers=workers)


def compile_counters() -> dict[str, int]:
    """torch.compile's own counts for the run (graphs, graph breaks, recompilations): a system that recompiles or
    breaks its graphs shows it here. Read from dynamo's counters (a private table; a benchmark may read it)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without dynamo
        return {}
    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(counters["recompiles"].values()))}
