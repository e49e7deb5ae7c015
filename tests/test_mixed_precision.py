"""The GPT recipe under mixed precision: the residual stream runs in the autocast dtype unless ``fp32_residual``
(the pipeline-boundary byte counts are checked in the distributed ``features`` scenario)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_3d.recipes import GPT
from lightning_3d.recipes.gpt.config import preset
from lightning_3d.recipes.gpt.model import GPTModel


@pytest.mark.parametrize("fp32_residual", [False, True])
def test_residual_stream_dtype_under_autocast(fp32_residual: bool) -> None:
    torch.manual_seed(0)
    model = GPTModel(preset("tiny", fp32_residual=fp32_residual))
    seen = []
    for block in model.layers.values():
        block.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    ids = torch.randint(0, 4096, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(ids)
    exact = model(ids)
    expected = torch.float32 if fp32_residual else torch.bfloat16
    assert seen == [expected] * 4 + [torch.float32] * 4  # without autocast the stream is fp32 either way
    assert F.cross_entropy(mixed.float().flatten(0, 1), ids.flatten()).item() == pytest.approx(
        F.cross_entropy(exact.flatten(0, 1), ids.flatten()).item(), rel=1e-2)


def test_recipe_passes_fp32_residual_to_the_model_config() -> None:
    assert GPT("tiny").config.fp32_residual is False
    assert GPT("tiny", fp32_residual=True).config.fp32_residual is True
