"""Cost models: how long a layer's forward and backward take and how much activation memory it holds, for a
micro-batch shape. Dynamic micro-batching (``lightning_3d.dynamic``) and the planner (``lightning_3d.planner``)
both ask these questions; a profile measured on a GPU (``lightning-3d profile``, ``ProfiledCostModel``) or an
analytic estimate (``AnalyticCostModel``) answers. ``ClusterSpec`` describes the machines a plan targets.

The interface is ``CostModel`` in ``lightning_3d.costs.model``; see docs/extending.md ("a planner cost term") and
docs/planner.md.
"""

from lightning_3d.costs.analytic import AnalyticCostModel, layer_parameters, weight_matrices
from lightning_3d.costs.devices import KNOWN_DEVICES, ClusterSpec, device_spec
from lightning_3d.costs.host import layer_host_time, microbatch_overhead, stage_pass_seconds
from lightning_3d.costs.model import CostModel, DeviceSpec, LayerKind, ModelShape
from lightning_3d.costs.profiled import PROFILE_FORMAT, PROFILE_VERSION, READABLE_VERSIONS, ProfiledCostModel, check_profile, new_profile
from lightning_3d.costs.registry import CONFIGS, RECIPES, RecipeCosts, TinyModel, model_shape, recipe_costs, register_recipe

__all__ = [
    "AnalyticCostModel", "ClusterSpec", "CostModel", "DeviceSpec", "KNOWN_DEVICES", "LayerKind", "ModelShape",
    "layer_host_time", "microbatch_overhead", "stage_pass_seconds",
    "PROFILE_FORMAT", "PROFILE_VERSION", "READABLE_VERSIONS", "ProfiledCostModel", "check_profile", "device_spec", "layer_parameters",
    "model_shape", "new_profile", "CONFIGS", "RECIPES", "RecipeCosts", "TinyModel", "recipe_costs", "register_recipe",
    "weight_matrices",
]
