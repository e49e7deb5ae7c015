"""FlexAttention training on CPU, for the tests (the ``flex_on_cpu`` fixture of tests/conftest.py), the 2-rank flex
scenario and the CPU smoke run of benchmarks/dynamic/flex_packing_check.py: one definition of the workaround.

torch has no FlexAttention backward on CPU: its public ``flex_attention`` refuses inputs that require grad there, in
one device check (``_validate_device``). Lifting that check and compiling with "aot_eager" (the same dynamo capture
and autograd tracing as on the GPU, torch's reference math kernels for the forward and the backward) lets a CPU run
check everything but the fused Triton kernel: the mask (``mask_mod``), its plumbing through the blocks, activation
checkpointing, compiled blocks and stages, and the gradients. The reference math path evaluates ``mask_mod`` on every
score and never reads the block tables; tests/test_flex_packing.py checks those by counts and through the fused CPU
kernel (inductor, forward only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.attention.flex_attention as torch_flex

import lightning_3d.recipes.gpt.model as gpt_model
import lightning_3d.recipes.training as training

Patch = Callable[[Any, str, Any], None]


def allow_flex_backward_on_cpu(patch: Patch = setattr) -> None:
    """Let ``flex_attention`` train on CPU through torch's reference math path, compiled (flex, the recipes' blocks
    and stages) with "aot_eager". ``patch(obj, name, value)`` sets each attribute: a test passes
    ``monkeypatch.setattr`` (undone after it), a scenario or script process the default ``setattr`` (for good)."""
    original = torch_flex._validate_device

    def validate(query, key, value):
        if query.device.type != "cpu":
            original(query, key, value)

    patch(torch_flex, "_validate_device", validate)
    patch(training, "COMPILE_BACKEND", "aot_eager")


def count_flex_calls(patch: Patch = setattr) -> list[int]:
    """A one-element list counting the calls of the compiled flex kernel that eager blocks make (forward calls,
    recomputation included; compiled blocks trace flex into their own graph and do not call it)."""
    calls = [0]
    compiled = gpt_model._compiled_flex_attention

    def counting(backend):
        kernel = compiled(backend)

        def run(*args, **kw):
            calls[0] += 1
            return kernel(*args, **kw)
        return run

    patch(gpt_model, "_compiled_flex_attention", counting)
    return calls
