"""Split backwards: the weight gradients of ``nn.Linear`` layers deferred from B to a later W action.

A zero-bubble schedule (``zero_bubble.py``) runs a stage's backward in two actions: B computes the input gradient
(sent to the previous stage at once) and W, later, the weight gradients. Layers split the backward themselves, as
Megatron-LM's and InternEvo's ``WeightGradStore`` do: while the runtime runs a B inside ``deferring(into)``, the
backward of a ``SplitGradLinear`` (and of a ``FusedGradLinear``, distributed/wgrad_fusion.py) computes its input
gradient and appends the weight-gradient product to ``into`` instead of computing it; W calls what was appended.
Outside ``deferring`` the same layers compute everything in their backward, with the same operations on the same
tensors, so a split backward's gradients are bitwise those of the whole one.

Why not torch.distributed.pipelining's graph split (``stage_backward_input`` / ``stage_backward_weight``): it runs
the autograd graph twice from saved intermediates, which (a) recomputes a checkpointed block's forward a second time
in W, (b) writes ``.grad`` directly, so post-accumulate-grad hooks (the data-parallel buckets) never fire, and (c)
would run a fused layer's gradient accumulation twice. Deferring inside the layer needs none of that: a checkpointed
block is recomputed once, in B, and W keeps only what the weight product needs (the layer's input and output
gradient). What is not a plain linear weight (norms, embeddings, biases, tensor-parallel DTensor weights) gets its
gradient in B.

The deferral target is a module global, not thread-local: on GPUs autograd runs backward functions on its device
threads, not on the thread that called ``backward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

_into: list[Callable[[], None]] | None = None


@contextlib.contextmanager
def deferring(into: list[Callable[[], None]]) -> Iterator[None]:
    """Within: split layers append their weight-gradient work to ``into`` instead of running it."""
    global _into
    previous, _into = _into, into
    try:
        yield
    finally:
        _into = previous


def defer(work: Callable[[], None]) -> bool:
    """Hand ``work`` (a weight-gradient product and its accumulation) to the current B's list; False outside one."""
    if _into is None:
        return False
    _into.append(work)
    return True


def run_deferred(work: list[Callable[[], None]]) -> None:
    """W: run what a B deferred, in order. Grad mode off, as inside a backward: the saved inputs require grad, and a
    product of them taken with grad mode on would put a graph on the gradient (and on its data-parallel bucket)."""
    with torch.no_grad():
        for run in work:
            run()


def weight_grad_operands(grad_output: Tensor, saved_input: Tensor) -> tuple[Tensor, Tensor]:
    """The weight-gradient GEMM's operands: the (out, tokens) transposed output gradient and the (tokens, in) input,
    every leading dimension flattened into tokens (views, no copy)."""
    return grad_output.reshape(-1, grad_output.shape[-1]).t(), saved_input.reshape(-1, saved_input.shape[-1])


def weight_grad(grad_output: Tensor, saved_input: Tensor) -> Tensor:
    """(out, in) = grad_outputᵀ · input over every leading dimension: one GEMM, the same in B and in W."""
    g_t, x = weight_grad_operands(grad_output, saved_input)
    return g_t.mm(x)


def cast_linear_forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The forward of a linear layer's ``autograd.Function`` whose backward computes the weight gradient itself (here
    and in distributed/wgrad_fusion.py): ``F.linear`` under the caller's autocast state, with the casts autocast would
    make made once, here, so that the backward's GEMMs use the same cast tensors. Saves them on ``ctx`` for
    ``linear_backward_parts``."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device, enabled=False):
        x_cast, w_cast = x.to(dtype), weight.to(dtype)
        out = F.linear(x_cast, w_cast, bias.to(dtype) if bias is not None else None)
    ctx.save_for_backward(x_cast, w_cast)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    return out


def linear_backward_parts(ctx, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """What the backward of a ``cast_linear_forward`` layer computes besides its weight gradient: the input gradient
    and the bias gradient (None where not needed), and the saved cast input, the weight GEMM's other operand."""
    x_cast, w_cast = ctx.saved_tensors
    grad_input = grad_output @ w_cast if ctx.needs_input_grad[0] else None
    grad_bias = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0).to(ctx.bias_dtype)
    return grad_input, grad_bias, x_cast


def accumulate(weight: nn.Parameter, grad: Tensor) -> None:
    """Add ``grad`` to ``weight.grad`` through the weight's own AccumulateGrad node, exactly as autograd would at the
    end of a backward (assign or add, hooks included: the data-parallel buckets learn that the gradient is ready)."""
    with torch.enable_grad():
        torch.autograd.backward(weight.view_as(weight), grad)


class _SplitLinear(torch.autograd.Function):
    """``F.linear`` under the caller's autocast state, whose weight gradient may be deferred (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.weight = weight
        return cast_linear_forward(ctx, x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        grad_input, grad_bias, x_cast = linear_backward_parts(ctx, grad_output)
        weight = ctx.weight
        grad_weight = None
        if ctx.needs_input_grad[1]:
            def work(g: Tensor = grad_output, x: Tensor = x_cast) -> None:
                accumulate(weight, weight_grad(g, x).to(weight.dtype))

            if not defer(work):
                grad_weight = weight_grad(grad_output, x_cast).to(weight.dtype)
        return grad_input, grad_weight, grad_bias


class SplitGradLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient a zero-bubble schedule computes in W (module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        return _SplitLinear.apply(x, self.weight, self.bias)


def splittable_linears(module: nn.Module, exclude: Iterable[int] = ()) -> list[nn.Linear]:
    """Plain ``nn.Linear`` layers of ``module`` whose weight can take a split backward: a trainable plain tensor
    (tensor-parallel DTensor weights keep their gradient in B) used by this one layer only (a weight with two uses
    would reach its data-parallel bucket twice, in B and in W), and not in ``exclude`` (ids: tied weights)."""
    excluded = set(exclude)
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return [m for m in module.modules() if type(m) is nn.Linear and not isinstance(m.weight, DTensor)
            and m.weight.requires_grad and uses[id(m.weight)] == 1 and id(m.weight) not in excluded]


def split_linears(linears: Iterable[nn.Linear]) -> list[nn.Linear]:
    """Turn ``linears`` into ``SplitGradLinear`` in place (names, parameters and state dicts unchanged)."""
    done = []
    for m in linears:
        m.__class__ = SplitGradLinear
        done.append(m)
    return done


def unsplit_linears(linears: Iterable[nn.Linear]) -> None:
    """Undo ``split_linears``: plain ``nn.Linear`` again."""
    for m in linears:
        if type(m) is SplitGradLinear:
            m.__class__ = nn.Linear
