"""Fused computations for the recipes' training step, each behind an option and equal to the plain path up to
summation order (tests/test_kernels.py checks them against it with tolerances from an error analysis).

``linear_cross_entropy``: the LM head's projection and the summed token cross-entropy, a chunk of tokens at a time,
so that the full-vocabulary logits of a micro-batch never exist at once. The plain path keeps the micro-batch's
logits (tokens x vocabulary, 0.8 GB in bf16 for GPT-1.3B at 8k tokens) for the backward and writes a gradient of the
same size; here each chunk's logits are made, reduced to the chunk's loss and turned into their gradient at once,
which is multiplied into the hidden states' and the weight's gradients before the next chunk (Liger-Kernel's and
Apple's cut-cross-entropy's idea; our own code). What stays for the backward is the hidden states' gradient (tokens x
hidden) and the weight's (vocabulary x hidden, fp32): the backward only scales them by the incoming gradient. The
arithmetic is the plain path's: logits in the autocast dtype (bf16), log-softmax in fp32, the logits' gradient rounded
to the autocast dtype before the two products; only the weight gradient's sum over chunks is kept in fp32 (the plain
path rounds one product over all tokens to bf16 before adding it to the fp32 gradient). See docs/speed.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_3d.recipes.training import COMPILE_BACKEND, IGNORE_INDEX

# Tokens per chunk are chosen so that one chunk's logits hold at most this many elements (512 MiB in bf16): small next
# to a micro-batch's activations, large enough that the chunk's GEMMs stay efficient.
CHUNK_ELEMENTS = 2**28


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, vocab_size: int | None = None,
                         chunk_tokens: int | None = None, compiled: bool = False) -> Tensor:
    """``sum over tokens with label != -100 of cross_entropy(hidden @ weight[:vocab_size].T, label)``, in fp32.

    ``hidden``: (..., h) in any float dtype (cast to the autocast dtype when autocast is on, as ``F.linear`` would);
    ``weight``: (padded vocabulary, h), rows from ``vocab_size`` on are padding and never scored (the recipes' -inf
    mask); ``labels``: hidden's leading shape. ``chunk_tokens``: tokens per chunk (default: logits of at most
    ``CHUNK_ELEMENTS`` elements, in equal chunks). ``compiled``: the chunk's softmax and gradient as one compiled kernel.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels have shape {tuple(labels.shape)} but the hidden states {tuple(hidden.shape)}: one label"
                         f" per position is needed (use {IGNORE_INDEX} to ignore one).")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not project hidden states of width"
                         f" {hidden.shape[-1]}: expected (vocabulary, {hidden.shape[-1]}).")
    vocab = weight.shape[0] if vocab_size is None else vocab_size
    if not 0 < vocab <= weight.shape[0]:
        raise ValueError(f"vocab_size={vocab_size} must be in 1..{weight.shape[0]} (the weight's rows).")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be a positive number of tokens.")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    x, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    tokens = x.shape[0]
    if chunk_tokens is None:
        most = max(1, CHUNK_ELEMENTS // weight.shape[0])
        chunk_tokens = math.ceil(tokens / max(1, math.ceil(tokens / most)))  # equal chunks: one compiled shape
    body = _compiled_chunk() if compiled else _chunk_loss_and_grad
    return _LinearCrossEntropy.apply(x, weight, flat_labels, vocab, max(1, chunk_tokens), dtype, body)


def _chunk_loss_and_grad(logits: Tensor, labels: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """(summed fp32 cross-entropy of the chunk, gradient of that sum w.r.t. the logits in their dtype)."""
    scores = logits.float()
    if vocab < scores.shape[1]:  # padding columns: -inf, as the recipes' head mask makes them (zero probability)
        columns = torch.arange(scores.shape[1], device=scores.device)
        scores = scores.masked_fill(columns >= vocab, float("-inf"))
    lse = torch.logsumexp(scores, dim=1)
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    picked = scores.gather(1, target[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    grad = torch.exp(scores - lse[:, None])
    grad = grad.scatter_add(1, target[:, None], torch.full_like(picked[:, None], -1.0))
    grad = torch.where(valid[:, None], grad, 0.0)
    return loss, grad.to(logits.dtype)


@functools.cache
def _compiled_chunk() -> Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]:
    # dynamic=None (automatic dynamic shapes): the chunk's token count is static in the first graph and symbolic from
    # the second on, so the chunk sizes of variable micro-batches share a symbolic graph instead of compiling one
    # each up to dynamo's recompile limit (past it the chunk ran eagerly; docs/speed.md, "Compiled loss").
    return torch.compile(_chunk_loss_and_grad, backend=COMPILE_BACKEND, dynamic=None)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients chunk by chunk; backward scales the gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, labels: Tensor, vocab: int, chunk: int, dtype: torch.dtype,  # type: ignore[override]
                body: Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]) -> Tensor:
        device = x.device.type
        with torch.autocast(device, enabled=False):  # the casts autocast would make for F.linear, made once, here
            x_cast, w_cast = x.to(dtype), weight.to(dtype)
            grad_x = torch.empty_like(x_cast)
            # fp32 accumulation (or the weight's own dtype if wider): the chunks' products are added, never rounded
            # to the autocast dtype in between.
            acc_dtype = torch.promote_types(weight.dtype, torch.float32)
            grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            # cuBLAS adds a bf16 product straight into the fp32 sum (beta = 1); elsewhere the product is cast, then added.
            fused_add = x_cast.is_cuda and dtype != acc_dtype
            for start in range(0, x.shape[0], chunk):
                xc, lc = x_cast[start : start + chunk], labels[start : start + chunk]
                chunk_loss, g = body(xc @ w_cast.t(), lc, vocab)
                loss += chunk_loss
                torch.mm(g, w_cast, out=grad_x[start : start + chunk])
                if fused_add:
                    torch.addmm(grad_w, g.t(), xc, out_dtype=acc_dtype, out=grad_w)
                elif dtype == acc_dtype:
                    grad_w.addmm_(g.t(), xc)
                else:
                    grad_w += (g.t() @ xc).to(acc_dtype)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):  # type: ignore[override]
        grad_x, grad_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        # The loss is a scalar: its gradient only scales what the forward computed. Scaled in fp32 (at least), so the
        # scale adds no bf16 rounding; then in the dtypes autograd expects.
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (grad_x.to(torch.promote_types(grad_x.dtype, torch.float32)) * grad_loss).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = (grad_w * grad_loss).to(w_dtype)
        return dx, dw, None, None, None, None, None
