"""Every private torch and Lightning API lightning_3d touches, in one place.

Each name here is underscore-private upstream and may change in any release. ``tests/test_compat.py`` checks the
signature and behaviour we rely on, so an upgrade that breaks one fails there, naming it, instead of deep inside a
distributed run. Code elsewhere in the package imports these wrappers, never the private names themselves.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.distributed.checkpoint.planner_helpers import _create_read_items
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

# Lightning's own helpers for the default process group, used as its DDP strategy uses them (environment variables,
# backend per device type, the all-reduce behind ``Strategy.reduce``).
distributed_is_initialized = _distributed_is_initialized
default_process_group_backend = _get_default_process_group_backend_for_device
init_dist_connection = _init_dist_connection
sync_ddp_if_available = _sync_ddp_if_available

# The launcher Lightning's DDP strategy uses for script runs (one process per device, the script started again).
SubprocessScriptLauncher = _SubprocessScriptLauncher

# DCP's read items for one state-dict entry: our resharding load planner builds its plan from them per entry.
create_read_items = _create_read_items


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions. They hold the device meshes they were computed on, and meshes
    compare equal by shape and names alone, so after the strategy destroys one run's groups and builds an equal mesh
    on new ones, a cache hit would hand the next run an output spec on the old mesh, whose collectives then name a
    destroyed group."""
    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()


def set_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """Make ``module.device_mesh`` return ``mesh`` (the property reads a private attribute that only Lightning's
    ModelParallelStrategy sets; ``configure_model`` of a user's module may read it)."""
    module._device_mesh = mesh


def logger_connector(trainer: pl.Trainer) -> Any:
    """The trainer's logger connector (``should_update_logs``, ``log_metrics``): how Lightning's own
    ThroughputMonitor logs at the trainer's logging cadence."""
    return trainer._logger_connector
