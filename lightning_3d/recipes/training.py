"""Loss and optimisation shared by the GPT and T5 recipes (one definition, so both train the same way)."""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_3d.recipes.attention import data_varies_microbatch_shapes, resolve_sdpa_backends
from lightning_3d.strategies.protocol import read_on_host
from lightning_3d.tensor_parallel import compile_on_local_tensors
from lightning_3d.tensor_parallel.mappings import ASYNC_TP_VARIABLE, async_tp_from_environment
from lightning_3d.utils.compat import fit_train_dataloaders

IGNORE_INDEX = -100
# What ``compile=True`` hands to torch.compile, and what GPT's FlexAttention and its block-mask builder are compiled
# with (read from here at each call: one name for every compiled piece). Tests use "aot_eager" (same graph capture
# and autograd tracing, no C++/Triton build): in-process by patching this name, in subprocesses through
# L3D_COMPILE_BACKEND.
COMPILE_BACKEND = os.environ.get("L3D_COMPILE_BACKEND", "inductor")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# What one torch.compile graph covers: a transformer block (the default), or a whole pipeline stage (embedding, blocks,
# final norm and head: one graph per stage and direction, so per-block launch wrappers and guards leave the host).
COMPILE_SCOPES = ("block", "stage")


@torch.no_grad()
def init_full_(param: Tensor, fill: Callable[[Tensor, torch.Generator], Any], seed: int, name: str = "") -> None:
    """Initialise ``param`` exactly as one process would, whatever this rank holds of it: ``fill(full, generator)``
    fills the full (unsharded) fp32 tensor on the parameter's device with a generator seeded by ``(seed, name)``
    (key it by the parameter's name, so every layout draws the same values), then this rank's part is copied in (for
    a DTensor shard its local slice, computed without communication). For ``init_weights`` of a module of your own:
    ``init_full_(p, lambda t, g: t.normal_(0, 0.02, generator=g), seed, name)``. Costs one full tensor per call."""
    device = param.to_local().device if isinstance(param, DTensor) else param.device
    full = torch.empty(tuple(param.shape), device=device, dtype=torch.float32)
    fill(full, torch.Generator(device=device).manual_seed(seed_for(seed, name)))
    copy_full_into(param, full.to(param.dtype))


def seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def copy_full_into(param: Tensor, full: Tensor) -> None:
    """Copy a full (unsharded) tensor into a parameter that may be a DTensor shard, without communication."""
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def summed_token_cross_entropy(output: Tensor, labels: Tensor, compiled: bool = False) -> Tensor:
    """Summed token cross-entropy (the pipeline divides by the token count); vocab-parallel when the logits are a
    vocabulary-sharded DTensor, fp32 otherwise.

    ``compiled``: one fused kernel reads the (bf16) logits, upcasts in registers and reduces, instead of writing an
    fp32 copy of the logits and reading it twice (for GPT-1.3B at 8k tokens that copy is 1.6 GB per micro-batch).
    """
    logits = output.flatten(0, 1)
    if isinstance(logits, DTensor):
        loss = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return loss.full_tensor()
    if compiled:
        return _compiled_fp32_cross_entropy()(logits, labels.flatten())
    return _fp32_cross_entropy(logits, labels.flatten())


def _fp32_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


@functools.cache
def _compiled_fp32_cross_entropy() -> Callable[[Tensor, Tensor], Tensor]:
    # dynamic=None (torch's automatic dynamic shapes): the first token count gets a static graph, a second one a graph
    # with the token count symbolic, which serves the later counts (the backend may add one where its kernels guard
    # on a size range). Variable micro-batches (packing's shorter last micro-batch, dynamic and packed-dynamic plans)
    # thus compile a few times; with one graph per count they reached dynamo's recompile limit and ran the loss
    # eagerly from then on (docs/speed.md, "Compiled loss").
    return torch.compile(_fp32_cross_entropy, backend=COMPILE_BACKEND, dynamic=None)


def compile_blocks(blocks: Iterable[nn.Module], mode: bool | str = True) -> None:
    """Compile each transformer block in place (torchtitan's per-block compile): the repeated block is traced once and
    reused, graphs stay small enough to compile quickly, and ``Module.compile`` keeps parameter names unchanged, so
    checkpoints, optimizer state and export are the same with and without compilation.

    ``mode``: ``False`` (nothing to do), ``True`` for torch.compile's default, or one of its mode names
    (``"max-autotune-no-cudagraphs"`` also tunes Triton GEMMs with fused epilogues; CUDA-graph modes are refused:
    pipeline stages run variable shapes)."""
    if mode is False:
        return
    if mode is True:
        mode = None
    elif mode not in COMPILE_MODES:
        raise ValueError(f"compile={mode!r}: use True or one of {COMPILE_MODES}.")
    for block in blocks:
        # Module.compile, except that a tensor-parallel block's graph computes on local tensors, not DTensors.
        compile_on_local_tensors(block, backend=COMPILE_BACKEND, mode=mode if COMPILE_BACKEND == "inductor" else None)


def check_speed_options(compile: bool | str, optimizer_foreach: bool | None, optimizer_fused: bool | None,
                        compile_scope: str = "block") -> None:
    """The recipes' ``compile`` / ``compile_scope`` / ``optimizer_*`` arguments, refused at construction (before any
    process starts)."""
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope={compile_scope!r}: use one of {COMPILE_SCOPES} (what one compiled graph covers).")
    if optimizer_foreach and optimizer_fused:
        raise ValueError("optimizer_foreach=True and optimizer_fused=True exclude each other; set one of them.")
    if compile not in (False, True, *COMPILE_MODES):
        raise ValueError(f"compile={compile!r}: use False, True or one of {COMPILE_MODES} (a torch.compile mode).")
    if compile is False and async_tp_from_environment():
        raise ValueError(f"{ASYNC_TP_VARIABLE}=1 fuses collectives with GEMMs inside compiled blocks (inductor), but"
                         f" compile=False: set compile=True, or unset {ASYNC_TP_VARIABLE}.")


def sdpa_backends_for_run(trainer: pl.Trainer | None, value: str) -> str:
    """The recipes' ``sdpa_backends`` ``value`` resolved for the run of ``trainer`` (recipes/attention.py): ``"auto"``
    reads whether the training data's micro-batch shapes vary from the trainer's data module or, without one, from the
    loader(s) given to ``fit``. Called from ``configure_model``, before the model is built, compiled or run, so one
    value holds for the whole run (a forward and its checkpointed recomputation must run the same kernel); without a
    trainer ``"auto"`` is ``"torch"``."""
    if value != "auto" or trainer is None:
        return resolve_sdpa_backends(value, varies_microbatch_shapes=False)
    loaders = fit_train_dataloaders(trainer)
    if isinstance(loaders, (list, tuple)):
        sources = tuple(loaders)
    elif isinstance(loaders, dict):
        sources = tuple(loaders.values())
    else:
        sources = (loaders,)
    varies = data_varies_microbatch_shapes(trainer.datamodule, *sources)
    return resolve_sdpa_backends(value, varies)


def count_target_tokens(labels: Tensor) -> Tensor:
    return (labels != IGNORE_INDEX).sum()


def check_token_batch(microbatch: dict[str, Tensor], vocab_size: int, ids: Iterable[str], scored: str,
                      max_length: int | None = None, length_name: str = "seq_length") -> None:
    """Raise a ValueError naming the bad value when a micro-batch does not fit the model: a token id outside
    ``[0, vocab_size)`` in one of ``ids`` or in ``labels`` (which may also hold IGNORE_INDEX), ``labels`` of another
    shape than the ids they score (``scored``, when the micro-batch has it), or (``max_length``) sequences longer than
    the model's positions.

    Under pipeline parallelism these inputs are read on one stage only (embeddings on the first, labels on the last),
    and a failure there reaches the other stages as a lost peer; the strategy runs this check on every rank before
    the step (``check_pipeline_batch``), so every rank raises this message instead. The values are read through
    ``read_on_host``: under the strategy, one host synchronisation for all micro-batches of a step."""
    present = [name for name in ids if microbatch.get(name) is not None]
    for name in present:
        length = microbatch[name].shape[-1]
        if max_length is not None and name == "input_ids" and length > max_length:
            raise ValueError(
                f"input_ids has sequence length {length}, but the model has {max_length} positions ({length_name}):"
                f" truncate or pack the data to at most {max_length} tokens, or build the model with"
                f" {length_name} >= {length}."
            )
    labels = microbatch.get("labels")
    if labels is not None and scored in present and labels.shape != microbatch[scored].shape:
        raise ValueError(f"labels have shape {tuple(labels.shape)} but {scored} {tuple(microbatch[scored].shape)}:"
                         f" the data must give one label per {scored} position (use {IGNORE_INDEX} to ignore one).")
    checked = [(name, microbatch[name]) for name in present if microbatch[name].numel()]
    if labels is not None and labels.numel():
        checked.append(("labels", labels.masked_fill(labels == IGNORE_INDEX, 0)))
    if not checked:
        return

    def verdict(bounds: list[list[int]]) -> None:
        for (name, _), (low, high) in zip(checked, bounds, strict=True):
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                allowed = f" or {IGNORE_INDEX} (ignored)" if name == "labels" else ""
                raise ValueError(
                    f"{name} holds token id {bad}, outside the model's vocabulary of {vocab_size} ids (0 to"
                    f" {vocab_size - 1}{allowed}): tokenize with the model's tokenizer, or build the model with"
                    f" vocab_size > {max(high, 0)}."
                )

    read_on_host(torch.stack([torch.stack([t.min(), t.max()]) for _, t in checked]), verdict)


def default_fused(params: list[Tensor]) -> bool | None:
    """The recipes' AdamW implementation when ``optimizer_fused`` is left None: fused where every parameter is on a
    GPU (one kernel over all tensors, and the strategy's non-finite check then skips a bad step on the device and
    reads its verdict a step late instead of waiting for the backward: docs/speed.md), torch's own default elsewhere
    (None: foreach or a for-loop; the CPU reference runs of the tests keep it)."""
    return True if params and all(p.device.type == "cuda" for p in params) else None


def adamw_arguments(model_args: dict, device: torch.device) -> dict[str, bool | None]:
    """The ``foreach``/``fused`` arguments of the AdamW a recipe module built with ``model_args`` takes when its
    parameters are on ``device``: its ``optimizer_foreach``/``optimizer_fused``, else ``default_fused``'s rule.
    Registered as the recipes' ``RecipeCosts.optimizer``, so that the planner's profiler times this implementation
    (fused and foreach steps differ by several times on a GPU)."""
    foreach, fused = model_args.get("optimizer_foreach"), model_args.get("optimizer_fused")
    if fused is None and not foreach:
        fused = True if device.type == "cuda" else None
    return {"foreach": foreach, "fused": fused}


def adamw_warmup_cosine(module: pl.LightningModule, decays: Callable[[str, Tensor], bool]) -> dict[str, Any]:
    """AdamW with weight decay where ``decays(name, param)``; linear warm-up, then cosine decay to
    ``min_learning_rate`` over ``decay_steps`` (default: the trainer's ``max_steps``). Reads the module's hparams."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        (decay if decays(name, p) else no_decay).append(p)
    hp = module.hparams
    fused = hp.get("optimizer_fused")
    if fused is None and not hp.optimizer_foreach:
        fused = default_fused(decay + no_decay)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.adam_eps, foreach=hp.optimizer_foreach, fused=fused,
    )
    total = hp.decay_steps or (module.trainer.max_steps if module.trainer.max_steps > 0 else 10_000)
    floor = hp.min_learning_rate / hp.learning_rate

    def schedule(step: int) -> float:
        if step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        progress = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
