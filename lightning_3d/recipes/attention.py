"""Which SDPA backends the GPT and T5 recipes' attention may run (the models' ``sdpa_backends`` option).

``"no_cudnn"`` lets SDPA pick among flash attention, the memory-efficient kernel and math, never cuDNN: recent torch
prefers cuDNN's attention on Hopper, and cuDNN builds an execution plan for every new (batch, heads, length) shape
before it runs, which micro-batches whose shapes change (padding, token budgets, dynamic micro-batching) pay again and
again (docs/dynamic.md, "Attention for changing shapes"). ``"torch"`` leaves torch's own choice, which on static shapes
may be the faster kernel (docs/speed.md). ``"auto"`` (the default) is one of the two, chosen once per model before it
is built, never switched mid-run: ``"no_cudnn"`` when the training data declares that its micro-batch shapes vary
(``varies_microbatch_shapes`` on the data module, the train loader, its collate function or its dataset; see
:func:`data_varies_microbatch_shapes`), ``"torch"`` otherwise, and ``"torch"`` for a model built outside a Trainer.

The selection only removes a backend, with no priority order: torch then chooses among the rest by its fixed order
(flash, efficient, math), the same in eager code, in compiled code and in activation checkpointing's recomputation, so
a forward and its recomputation always run the same kernel (an explicit priority order skipped under compilation once
made them differ, and torch's checkpoint refused the recomputed tensors). ``sdpa_kernel`` with a plain list, the form
Dynamo has handled longest (``set_priority`` is the newer argument), traces into a compiled graph without a graph break
and the graph then holds the kernel it allows (tests/test_sdpa_backends.py; benchmarks/speed/peers.py reports graph breaks
per system on the GPU's torch).

Also the configs' shared vocabulary check (:func:`check_vocabulary`): both recipes pad the vocabulary the same way.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

# The backends each resolved value allows (None: torch's own order, no context entered).
SDPA_BACKENDS: dict[str, list[SDPBackend] | None] = {
    "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "torch": None,
}
# What the option accepts: "auto" resolves to one of SDPA_BACKENDS (resolve_sdpa_backends).
SDPA_BACKENDS_CHOICES = ("auto", *SDPA_BACKENDS)
DEFAULT_SDPA_BACKENDS = "auto"


def check_sdpa_backends(value: str) -> None:
    if value not in SDPA_BACKENDS_CHOICES:
        raise ValueError(f"sdpa_backends={value!r} is not supported; choose one of {list(SDPA_BACKENDS_CHOICES)}"
                         " ('auto': 'no_cudnn' when the data's micro-batch shapes vary, else 'torch'; 'no_cudnn':"
                         " flash, memory-efficient or math attention, never cuDNN's per-shape plans; 'torch': torch's"
                         " own choice).")


def resolve_sdpa_backends(value: str, varies_microbatch_shapes: bool) -> str:
    """``value`` as the key of ``SDPA_BACKENDS`` that runs: explicit values unchanged; ``"auto"``: ``"no_cudnn"`` for
    changing micro-batch shapes (cuDNN would build a plan per new shape), ``"torch"`` for static ones."""
    check_sdpa_backends(value)
    if value != "auto":
        return value
    return "no_cudnn" if varies_microbatch_shapes else "torch"


def data_varies_microbatch_shapes(*sources: Any) -> bool:
    """Whether the first of ``sources`` (a data module, a loader, a collate function, a dataset, or None) that declares
    ``varies_microbatch_shapes`` says that the training micro-batches change shape; a loader also answers through its
    ``collate_fn`` and ``dataset``. Nothing declared: False (fixed shapes, as the fixed-length data modules make).
    Duck-typed, so that the recipes' attention depends on no data module."""
    for source in sources:
        if source is None:
            continue
        for obj in (source, getattr(source, "collate_fn", None), getattr(source, "dataset", None)):
            declared = getattr(obj, "varies_microbatch_shapes", None) if obj is not None else None
            if declared is not None:
                return bool(declared)
    return False


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, sdpa_backends: str, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` with the backends ``sdpa_backends`` (a resolved value,
    ``"no_cudnn"`` or ``"torch"``) allows."""
    backends = SDPA_BACKENDS[sdpa_backends]
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def check_vocabulary(vocab_size: object, vocab_multiple: object) -> None:
    """The recipes pad the vocabulary to a multiple of ``vocab_multiple * tensor_parallel_size`` so that tensor
    parallelism splits the embedding and the head into equal shards (``padded_vocab_size``); a size or multiple that
    is not a positive integer would give an empty or fractional vocabulary there, found only when the model is built."""
    for name, value, fix in (("vocab_size", vocab_size, "the tokenizer's vocabulary size"),
                             ("vocab_multiple", vocab_multiple, "128 (the default: even tensor-parallel shards and"
                              " aligned GEMMs), or 1 to pad only to a multiple of tensor_parallel_size")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}={value!r}` must be a positive integer, e.g. {fix}: the vocabulary is padded to a"
                             " multiple of vocab_multiple x tensor_parallel_size so tensor parallelism can split it"
                             " evenly.")
