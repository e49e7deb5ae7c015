"""Gradient-accumulation fusion: weight gradients of ``nn.Linear`` layers added straight into fp32 buffers.

Under autocast a linear layer's weight gradient takes three passes over memory per micro-batch: the GEMM writes a
bf16 gradient, its cast back to the fp32 parameter writes an fp32 copy, and autograd's ``AccumulateGrad`` reads the
running ``.grad`` and that copy and writes the sum. Megatron-LM's ``gradient_accumulation_fusion`` has the GEMM
accumulate into an fp32 buffer instead (cuBLAS with bf16 inputs, fp32 C and beta = 1): one pass, no temporaries, and
the micro-batch's contribution is never rounded to bf16. (In fp32 training on a GPU the GEMM likewise adds into the
slot, saving the product's temporary and the separate add.) PyTorch has the GEMM (``torch.addmm(..., out_dtype=)``) but
no layer that uses it, so this file adds the layer; the data-parallel synchronizer lays the buffers out as its
all-reduce buckets, so no gradient is copied into a bucket either (what DDP's ``gradient_as_bucket_view`` saves).

A fused layer's weight gets its gradient from a custom op called in the layer's backward, which torch.compile keeps
as one opaque call inside a compiled block. The op keeps autograd's contract: it writes into ``weight.grad`` (the
weight's slot of its bucket, once the synchronizer owns the layer), assigning when ``grad`` is None and adding
otherwise, and then tells the synchronizer that the gradient moved, as a post-accumulate-grad hook would.

Outside the strategies, code uses three functions: ``check_fusion_mode`` (the setting's validation),
``fuse_standalone`` (a module's layers fused as the strategy would, with slots of their own) and
``unfuse_gradient_accumulation`` (undo it); the rest is the strategy's machinery.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_3d.pipeline.weight_grad import cast_linear_forward, defer, linear_backward_parts, weight_grad_operands

# ``gradient_accumulation_fusion="auto"`` fuses only layers whose weight has at least this many elements. The fused op
# saves device memory traffic in proportion to the weight (the bf16 gradient, its fp32 copy and AccumulateGrad's
# read-read-write: about 18 bytes per element and micro-batch) but costs a fixed amount of host time per call (a Python
# kernel); below about this size the saved bandwidth time on current GPUs is smaller than that host time, so fusing
# can only lose. docs/speed.md ("Which layers") gives the rule and its derivation.
FUSION_MIN_ELEMENTS = 2**23

# data_ptr of a weight's gradient slot -> (weight, called after every accumulation). Filled by the synchronizer; the op
# looks the slot up at run time, which works inside compiled code where a Python closure per layer would not.
_SLOTS: dict[int, tuple[nn.Parameter, Callable[[nn.Parameter], None] | None]] = {}


def register_slot(weight: nn.Parameter, slot: Tensor, on_accumulated: Callable[[nn.Parameter], None] | None) -> None:
    """Make ``slot`` (a tensor shaped like ``weight``) the place ``weight``'s gradient accumulates in."""
    owner = _owner_of(weight)
    owner.grad_slot = slot
    _SLOTS[slot.data_ptr()] = (weight, on_accumulated)


def unregister_slot(weight: nn.Parameter) -> None:
    slot = getattr(_owner_of(weight), "grad_slot", None)
    if slot is not None:
        _SLOTS.pop(slot.data_ptr(), None)


def _owner_of(weight: nn.Parameter) -> FusedGradLinear:
    owner = getattr(weight, "_fused_grad_owner", None)
    if owner is None:
        raise ValueError("This parameter is not the weight of a FusedGradLinear (see fuse_gradient_accumulation).")
    return owner


# The op is defined with ``torch.library.Library`` and one CompositeExplicitAutograd kernel rather than with
# ``torch.library.custom_op``: it runs once per fused layer and micro-batch (384 times per micro-batch for T5-770M), on
# the host thread that feeds the GPU, and custom_op's Python layers around the kernel (its autograd wrapper, the
# redispatch, the dynamo-disable context) cost more host time than the kernel's own work. The op returns nothing and is
# only ever called in a backward (grad mode off), so it needs no autograd formula.
#
# Declared pure on purpose: with a declared mutation, AOTAutograd would hand the op a copy of the slot and write it back
# after the block's backward, when the slot's bucket may already be in its in-place all-reduce. Pure, it must be kept
# from dead-code elimination (it returns nothing): registered as side-effectful, as compiled autograd's
# ``accumulate_grad_`` is. The synchronizer checks every step that the accumulations happened.
_LIBRARY = torch.library.Library("lightning_3d", "FRAGMENT")
_LIBRARY.define("accumulate_weight_grad(Tensor slot, Tensor grad_output_t, Tensor saved_input) -> ()")


def _accumulate_weight_grad(slot: Tensor, grad_output_t: Tensor, saved_input: Tensor) -> None:
    """weight.grad (= ``slot`` or None) += ``grad_output_t`` · ``saved_input``: the (out, tokens) transposed output
    gradient and the (tokens, in) input, every leading dimension already flattened into tokens (by the caller, so that
    inside a compiled block these views are part of the graph instead of host work here)."""
    entry = _SLOTS.get(slot.data_ptr())
    if entry is None:
        raise RuntimeError(
            "A FusedGradLinear ran its backward without a registered gradient slot (the strategy that owned it was torn"
            " down, or the layer was moved to another device or dtype after the strategy laid its gradients out in"
            " buckets). Train it under Compressed3DStrategy, moving the model before the strategy's setup, or build the"
            " model again without gradient_accumulation_fusion."
        )
    weight, on_accumulated = entry
    g, x = grad_output_t, saved_input
    grad = weight.grad
    if grad is not None and grad.data_ptr() != slot.data_ptr():  # someone put another tensor there: add to it
        grad.add_(torch.mm(g, x))
    elif slot.is_cuda and g.dtype != slot.dtype:
        # The fused path: bf16 inputs, fp32 output, accumulated in the GEMM's epilogue (beta = 1), or written (beta = 0).
        if grad is None:
            torch.mm(g, x, out_dtype=slot.dtype, out=slot)
        else:
            torch.addmm(slot, g, x, out_dtype=slot.dtype, out=slot)
    elif slot.is_cuda:
        # fp32 training on a GPU: the same epilogue, without the mixed-precision output (no temporary, no extra pass).
        if grad is None:
            torch.mm(g, x, out=slot)
        else:
            slot.addmm_(g, x)
    elif grad is None:
        # Elsewhere exactly what autograd does: the product in the input dtype, then cast (first micro-batch) or added.
        slot.copy_(torch.mm(g, x))
    else:
        slot.add_(torch.mm(g, x))
    if grad is None:
        weight.grad = slot
    if on_accumulated is not None:
        on_accumulated(weight)


_LIBRARY.impl("accumulate_weight_grad", _accumulate_weight_grad, "CompositeExplicitAutograd")


@torch.library.register_fake("lightning_3d::accumulate_weight_grad", lib=_LIBRARY)
def _(slot: Tensor, grad_output_t: Tensor, saved_input: Tensor) -> None:
    return None


accumulate_weight_grad = torch.ops.lightning_3d.accumulate_weight_grad.default
torch.fx.node.has_side_effect(accumulate_weight_grad)


class _LinearWithFusedWeightGrad(torch.autograd.Function):
    """``F.linear`` under the caller's autocast state, with the weight gradient handed to ``accumulate_weight_grad``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, slot: Tensor) -> Tensor:  # type: ignore[override]
        # Kept off save_for_backward on purpose: the slot is written by earlier micro-batches' backwards while later
        # ones still hold it, which autograd's saved-tensor version check would reject.
        ctx.slot = slot
        return cast_linear_forward(ctx, x, weight, bias)  # the same forward as a split layer's (weight_grad.py)

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        grad_input, grad_bias, x_cast = linear_backward_parts(ctx, grad_output)
        slot, (g_t, x) = ctx.slot, weight_grad_operands(grad_output, x_cast)
        if not defer(lambda: accumulate_weight_grad(slot, g_t, x)):  # a zero-bubble B: done in its W (weight_grad.py)
            accumulate_weight_grad(slot, g_t, x)
        return grad_input, None, grad_bias, None


class FusedGradLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient accumulates in ``grad_slot`` (fp32) inside the backward's GEMM.

    The slot is a non-persistent buffer (out of the state dict): torch.compile then passes it into a compiled block
    like a parameter, so one compiled graph still serves every block."""

    grad_slot: Tensor

    def forward(self, x: Tensor) -> Tensor:
        return _LinearWithFusedWeightGrad.apply(x, self.weight, self.bias, self.grad_slot)

    def _apply(self, fn, recurse=True):
        # ``.to()``, ``.cuda()``, ``.cpu()`` replace the slot buffer with a new tensor at a new address, which the
        # registry (keyed by address) does not know. A slot of its own follows the layer: its registration moves to
        # the new tensor. A slot that is a view into a synchronizer's bucket cannot follow (the bucket stays where
        # it was): its registration is dropped, so the next backward raises the op's error instead of writing into
        # a stale address that a later allocation may reuse.
        old = self._buffers.get("grad_slot")
        entry = _SLOTS.pop(old.data_ptr(), None) if old is not None and old.numel() else None
        out = super()._apply(fn, recurse)
        new = self._buffers.get("grad_slot")
        if entry is not None and old._base is None and new is not None and new.numel():
            _SLOTS[new.data_ptr()] = entry
        return out


def fusable_linears(module: nn.Module, exclude: Iterable[int] = ()) -> list[nn.Linear]:
    """The layers of ``module`` that can take gradient-accumulation fusion: plain ``nn.Linear`` (subclasses such as a
    tied output head are left alone) with a trainable fp32 weight that is a plain tensor (tensor-parallel DTensor
    weights are not fused) and belongs to no other module (a weight tied to an embedding gets gradients from both)."""
    excluded = set(exclude)
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    found = []
    for m in module.modules():
        if type(m) is not nn.Linear and type(m) is not FusedGradLinear:
            continue
        w = m.weight
        if (isinstance(w, DTensor) or w.dtype != torch.float32 or not w.requires_grad or uses[id(w)] != 1
                or id(w) in excluded):
            continue
        found.append(m)
    return found


def check_fusion_mode(mode: object, name: str = "gradient_accumulation_fusion") -> None:
    """Raise unless ``mode`` is a value of ``gradient_accumulation_fusion`` (``name``: the argument as the caller calls
    it, for the message)."""
    if not (isinstance(mode, bool) or mode == "auto"):
        raise ValueError(f"`{name}={mode!r}` must be True (every fusable nn.Linear), False (none) or 'auto' (only weights"
                         " of at least FUSION_MIN_ELEMENTS elements, the default; see docs/speed.md).")


def choose_fused(linears: Iterable[nn.Linear], mode: bool | str) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """The layers of ``linears`` (fusable ones, from ``fusable_linears``) that ``gradient_accumulation_fusion=mode``
    fuses, and those it leaves to autograd because they are small (``"auto"``: weights below ``FUSION_MIN_ELEMENTS``)."""
    linears = list(linears)
    if mode == "auto":
        # Read at call time (not bound as a default) so that a test can move the threshold.
        return ([m for m in linears if m.weight.numel() >= FUSION_MIN_ELEMENTS],
                [m for m in linears if m.weight.numel() < FUSION_MIN_ELEMENTS])
    return (linears, []) if mode else ([], [])


def fuse_gradient_accumulation(linears: Iterable[nn.Linear]) -> list[nn.Parameter]:
    """Turn ``linears`` into ``FusedGradLinear`` in place (names and state dicts unchanged); their weights."""
    weights = []
    for m in linears:
        if type(m) is nn.Linear:
            m.__class__ = FusedGradLinear
            m.register_buffer("grad_slot", torch.empty(0, device=m.weight.device), persistent=False)
        m.weight._fused_grad_owner = m
        weights.append(m.weight)
    return weights


def unfuse_gradient_accumulation(weights: Iterable[nn.Parameter]) -> None:
    """Undo ``fuse_gradient_accumulation`` for the layers of ``weights``: plain ``nn.Linear`` again (their gradients
    accumulate as autograd's), so a model a strategy has released no longer depends on that strategy's slots."""
    for weight in weights:
        owner = getattr(weight, "_fused_grad_owner", None)
        if owner is None:
            continue
        unregister_slot(weight)
        del weight._fused_grad_owner
        if type(owner) is FusedGradLinear:
            del owner.grad_slot  # the non-persistent buffer fuse_gradient_accumulation registered
            owner.__class__ = nn.Linear


def fuse_standalone(module: nn.Module, mode: bool | str, name: str = "gradient_accumulation_fusion") -> list[nn.Parameter]:
    """Fuse the layers of ``module`` that ``gradient_accumulation_fusion=mode`` fuses (``fusable_linears``, then
    ``choose_fused``), each weight with an fp32 gradient slot of its own and no synchronizer: the layers as the
    strategy trains them, for code that runs them outside a strategy (the planner's profiler times them one at a
    time). ``name``: the caller's argument, for the message when ``mode`` is invalid. Returns the fused weights, for
    ``unfuse_gradient_accumulation`` once done. The module must be on its final device first (a slot is a tensor on
    it, keyed by its address)."""
    check_fusion_mode(mode, name)
    weights = fuse_gradient_accumulation(choose_fused(fusable_linears(module), mode)[0])
    for w in weights:
        register_slot(w, torch.zeros_like(w), None)
    return weights
