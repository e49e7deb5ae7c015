"""The private torch and Lightning APIs of ``lightning_3d.utils.compat``: what we rely on, checked on the installed
versions, so that an upgrade that changes one fails here by name. The package itself may import private names only
through that module (checked on the source below)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

from lightning_3d.utils import compat

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_3d"


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_lightning_distributed_helpers_keep_their_signatures() -> None:
    assert _params(compat.init_dist_connection)[:2] == ["cluster_environment", "torch_distributed_backend"]
    assert "timeout" not in _params(compat.init_dist_connection)  # passed through **kwargs to init_process_group
    assert _params(compat.sync_ddp_if_available) == ["result", "group", "reduce_op"]
    assert compat.default_process_group_backend(torch.device("cpu")) == "gloo"
    assert compat.distributed_is_initialized() is False


def test_subprocess_launcher_takes_environment_processes_nodes() -> None:
    launcher = compat.SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    assert launcher.is_interactive_compatible is False and hasattr(launcher, "launch")


def test_device_mesh_and_logger_connector_reach_what_lightning_reads() -> None:
    module = pl.LightningModule()
    mesh = object()
    compat.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh
    connector = compat.logger_connector(pl.Trainer(logger=False, enable_progress_bar=False,
                                                   enable_model_summary=False, enable_checkpointing=False))
    assert hasattr(connector, "should_update_logs") and _params(connector.log_metrics) == ["metrics", "step"]


def test_dcp_read_items_cover_one_entry() -> None:
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]),
                               [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3]))])
    items = compat.create_read_items("w", md, torch.zeros(4, 3))
    assert len(items) == 1 and items[0].dest_index.fqn == "w" and list(items[0].lengths) == [4, 3]


def test_private_names_are_imported_only_by_compat() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                private += [node.module] if any(part.startswith("_") for part in node.module.split(".")) else []
                if private:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.module} {private}")
    assert not offenders, "import these through lightning_3d.utils.compat:\n" + "\n".join(offenders)


def test_dtensor_sharding_caches_can_be_cleared() -> None:
    """The strategy clears DTensor's sharding caches when it destroys a run's groups (their entries hold meshes that
    compare equal to the next run's); the layouts scenario at world 4 fails without it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import _get_fast_path_sharding_prop_cache_stats

    propagator = DTensor._op_dispatcher.sharding_propagator
    compat.clear_dtensor_caches()
    assert propagator.propagate_op_sharding.cache_info().currsize == 0
    assert propagator._propagate_tensor_meta_cached.cache_info().currsize == 0
    assert len(_get_fast_path_sharding_prop_cache_stats()) == 2  # (hits, misses) of the C++ cache it also clears
