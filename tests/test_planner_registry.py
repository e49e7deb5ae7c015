"""The planner reads a model only through the recipe registry (docs/planner.md, "Recipes register how they are read"):
config objects by the shape function their recipe registered, the in-situ tiny model by the entry registered under
the config's class path; and the profiler fuses layers through wgrad_fusion's public ``fuse_standalone``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import lightning_3d.recipes  # noqa: F401  (registers GPT and T5)
from lightning_3d.costs import CONFIGS, RECIPES, ModelShape, RecipeCosts, TinyModel, model_shape, recipe_costs, register_recipe
from lightning_3d.distributed.wgrad_fusion import FusedGradLinear, fuse_standalone, unfuse_gradient_accumulation


@dataclass
class WideConfig:
    """A model config of a recipe of one's own: the four fields GPT's reading used, and a family of its own."""

    num_layers: int = 3
    hidden_size: int = 64
    num_heads: int = 4
    vocab_size: int = 100


class WiderConfig(WideConfig):
    pass


def _wide_shape(config: WideConfig, bytes_per_element: int, tensor_parallel_size: int) -> ModelShape:
    return ModelShape("t5", config.num_layers, config.hidden_size, config.num_heads, 8 * config.hidden_size,
                      config.vocab_size * tensor_parallel_size, num_decoder_layers=1, bytes_per_element=bytes_per_element)


@pytest.fixture
def restored_registry():
    recipes, configs = dict(RECIPES), dict(CONFIGS)
    yield
    RECIPES.clear()
    RECIPES.update(recipes)
    CONFIGS.clear()
    CONFIGS.update(configs)


def test_a_config_is_read_by_its_recipes_registered_shape_not_by_its_field_names(restored_registry) -> None:
    # GPT-like fields, but no recipe registered the class: refused (it is not read as a GPT by its field names).
    with pytest.raises(TypeError, match=r"WideConfig is no registered recipe's config: .* Registered: .*GPTConfig"):
        model_shape(WideConfig())
    with pytest.raises(ValueError, match=r"config_types=\(<class .*WideConfig'>,\)\) needs shape="):
        register_recipe(["tests.Wide"], RecipeCosts(recipe_costs("lightning_3d.recipes.GPT").workload,
                                                    config_types=(WideConfig,)))
    register_recipe(["tests.Wide"], RecipeCosts(recipe_costs("lightning_3d.recipes.GPT").workload, shape=_wide_shape,
                                                config_types=(WideConfig,)))
    assert model_shape(WideConfig(), bytes_per_element=4, tensor_parallel_size=2) == ModelShape(
        "t5", 3, 64, 4, 512, 200, num_decoder_layers=1, bytes_per_element=4)
    assert model_shape(WiderConfig(num_layers=5)).num_layers == 5  # a subclass is read as its registered base


def test_the_overheads_train_the_tiny_model_registered_under_the_configs_class_path(restored_registry) -> None:
    """A recipe registered under a class path of its own supplies the tiny model ``measure_overheads`` trains (here
    GPT's, through a builder that records its calls), and the overheads name that class path."""
    from lightning_3d.planner import measure_overheads

    gpt = recipe_costs("lightning_3d.recipes.GPT")
    built = []

    def build(model_args, data_args, batch_size, num_samples):
        built.append((model_args["num_layers"], batch_size))
        return gpt.tiny.build(model_args, data_args, batch_size, num_samples)

    tiny = TinyModel(dict(gpt.tiny.model_args, num_layers=2), gpt.tiny.data_args, build, gpt.tiny.at_depth)
    register_recipe(["tests.MyGPT"], RecipeCosts(gpt.workload, gpt.layers, shape=gpt.shape, tiny=tiny))
    shape = ModelShape(family="gpt", num_layers=4, hidden_size=128, num_heads=4, ffn_hidden_size=512, vocab_size=512)
    cfg = {"trainer": {"precision": "32-true"}, "model": {"class_path": "tests.MyGPT", "init_args": {}}}
    out = measure_overheads(cfg, shape, torch.device("cpu"), "32-true", microbatches=2, warmup=1, steps=1,
                            in_situ=False, fuse_gradients=False, fresh_process=False, log=lambda *a: None)
    assert built == [(2, 1), (2, 2)]  # the registered tiny model's arguments, at 1 and at 2 micro-batches
    assert out["model"] == "tests.MyGPT"
    assert out["tiny_fused_weights"] == {"embedding": 0, "block": 0, "head": 0}
    assert len(out["tiny_layers"]) == 3  # embedding, block, head of the registered tiny model's profile


def test_fuse_standalone_fuses_what_the_mode_fuses_with_slots_of_its_own() -> None:
    torch.manual_seed(0)
    model, plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                                                                                              nn.Linear(8, 2))
    plain.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match=r"`fuse_gradients='yes'` must be True"):
        fuse_standalone(model, "yes", "fuse_gradients")
    assert fuse_standalone(model, "auto") == []  # every weight below FUSION_MIN_ELEMENTS: none fused
    weights = fuse_standalone(model, True)
    try:
        assert [type(m) for m in model if not isinstance(m, nn.ReLU)] == [FusedGradLinear, FusedGradLinear]
        assert weights == [model[0].weight, model[2].weight]
        x = torch.randn(5, 4)
        for _ in range(2):  # two micro-batches accumulate into the slot, as autograd's .grad does
            model(x).square().sum().backward()
            plain(x).square().sum().backward()
        for w, p in zip(weights, (plain[0].weight, plain[2].weight)):
            torch.testing.assert_close(w.grad, p.grad, rtol=0, atol=0)
    finally:
        unfuse_gradient_accumulation(weights)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]


def test_the_profiler_times_the_adamw_the_recipe_registers(restored_registry) -> None:
    """The optimizer's arguments come from ``RecipeCosts.optimizer`` (the recipes' rule: the module's own
    optimizer_foreach/optimizer_fused, else fused on a GPU), not from the planner reading the config's field names."""
    from lightning_3d.planner.layers import profile_layers

    gpt = recipe_costs("lightning_3d.recipes.GPT")
    assert gpt.optimizer({}, torch.device("cuda")) == {"foreach": None, "fused": True}
    assert gpt.optimizer({}, torch.device("cpu")) == {"foreach": None, "fused": None}
    assert gpt.optimizer({"optimizer_foreach": True}, torch.device("cuda")) == {"foreach": True, "fused": None}
    asked = []

    def foreach_always(model_args, device):
        asked.append(dict(model_args))
        return {"foreach": True, "fused": None}

    register_recipe(["tests.ForeachGPT"], RecipeCosts(gpt.workload, gpt.layers, optimizer=foreach_always))
    cfg = {"trainer": {"precision": "32-true"},
           "model": {"class_path": "tests.ForeachGPT", "init_args": {"preset_name": "tiny", "vocab_size": 512,
                                                                      "num_layers": 1, "optimizer_fused": True}},
           "data": {"init_args": {"seq_length": 16}}}
    doc = profile_layers(cfg, torch.device("cpu"), microbatch_sizes=[1], seq_lens=[16], recompute=(False,), warmup=0,
                         repeats=1, log=lambda *a: None)
    assert asked == [cfg["model"]["init_args"]]
    assert doc["optimizer"]["implementation"] == {"foreach": True, "fused": None}
