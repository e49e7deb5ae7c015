"""Cost models: how long a layer's forward and backward take and how much activation memory it holds, for a
micro-batch shape. Dynamic micro-batching (``lightning_3d.dynamic``) and the planner (``lightning_3d.planner``)
both ask these questions; a profile measured on a GPU (``lightning-3d profile``) or an analytic estimate answers.

The interface is ``CostModel`` in ``lightning_3d.costs.model``; see docs/extending.md ("a planner cost term").
"""

from lightning_3d.costs.model import CostModel, DeviceSpec, LayerKind, ModelShape

__all__ = ["CostModel", "DeviceSpec", "LayerKind", "ModelShape"]
