"""The profiler times T5's blocks on the attention inputs training passes them (``recipes/t5/costs.layers``): the
position bias as a tensor that takes a gradient, the padding mask as an fp32 addend on the encoder's and the
cross-attention's scores, of the shapes and dtypes ``run_stage`` gives a padded micro-batch (docs/planner.md
"Profiles": a block timed without them is priced below what training runs)."""

from __future__ import annotations

import torch

import lightning_3d.recipes  # noqa: F401  (registers the recipes)
from lightning_3d.costs import recipe_costs
from lightning_3d.recipes.t5.config import preset
from lightning_3d.recipes.t5.model import T5Model


def _signature(args) -> list:
    """Per argument: None, or (shape, dtype, takes a gradient)."""
    return [None if a is None else (tuple(a.shape), a.dtype, a.requires_grad) for a in args]


B, S, T = 3, 16, 8


def test_the_profiled_blocks_get_the_attention_inputs_of_a_padded_micro_batch() -> None:
    config = preset("tiny")
    model = T5Model(config)
    seen = {}
    for name, stack in (("encoder_block", model.encoder), ("decoder_block", model.decoder)):
        # Records the first call's arguments; returns None, which leaves the block's inputs as they are.
        stack["0"].register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, args) and None)
    ids = torch.randint(0, config.vocab_size, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, -4:] = 0  # a padded sample: the encoder's keys are masked
    model(ids, torch.randint(0, config.vocab_size, (B, T)), attention_mask=mask)

    recipe = recipe_costs("lightning_3d.recipes.T5")
    shape, _, _ = recipe.workload({"preset_name": "tiny"}, {"input_length": S, "target_length": T}, 4)
    layers = recipe.layers({"preset_name": "tiny"}, {"input_length": S, "target_length": T}, shape, torch.device("cpu"))
    for kind in ("encoder_block", "decoder_block"):
        module, make, run = layers[kind]
        inputs = make(B, S, T, torch.float32)
        # The activations (first inputs) aside: the bias and the masks as training passes them.
        assert _signature(inputs[1:])[-2:] == _signature(seen[kind][1:])[-2:], kind
        out = run(module, *inputs)
        out.float().sum().backward()
        bias = inputs[-2]
        assert bias.is_leaf and bias.grad is not None and bias.grad.abs().sum() > 0, kind  # its gradient is computed
