"""Sharded checkpoints through ``torch.distributed.checkpoint``.

Model and optimizer state are keyed by parameter name (``get_model_state_dict`` /
``get_optimizer_state_dict``). Because pipeline stages keep the full model's names, the optimizer state of
stage 0's ``layers.0...`` and stage 1's ``layers.6...`` never collide, which a plain ``optimizer.state_dict()``
(keyed by position) would. DTensor shards are written once per shard; replicated tensors once per job.
Everything Lightning adds (loops, schedulers, callbacks) goes into one file written by rank 0.

The files themselves (reading without running code, atomic saves, manifests and their verification) are
``checkpoint_files``; see docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_3d.checkpoint.files import META_FILE, RANK_STATE_DIR, DamagedCheckpointError, gather_objects, safe_load, verify
from lightning_3d.distributed.sharded_optimizer import sharding_of
from lightning_3d.utils.compat import create_read_items

# Flattened optimizer state keys every setting by parameter name ("param_groups.<fqn>.lr"); unflattened, all
# stages would write a "param_groups" entry under the same key and DCP would keep only one of them.
_OPTIONS = StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True)


def model_state(module: nn.Module) -> dict[str, Any]:
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=False))


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The flattened per-parameter optimizer state; a sharded optimizer (``shard_optimizer_state``) writes the same
    keys and shapes, gathered over the replicas, so that either loads into the other (docs/sharded_optimizer.md)."""
    sharded = sharding_of(optimizer)
    if sharded is not None:
        return sharded.flat_state_dict()
    return get_optimizer_state_dict(module, optimizer, options=_OPTIONS)


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def save(checkpoint: dict[str, Any], path: Path, extra_sharded: dict[str, Any], global_rank: int) -> None:
    """Write model/optimizer shards (and ``extra_sharded``) with DCP; the rest of Lightning's dict on rank 0.

    ``path`` is a fresh staging directory (:func:`staging_path`); :func:`commit` verifies and moves it into place.
    """
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    sharded = {"model": checkpoint.pop("state_dict")}
    for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
        sharded[f"optimizer_{i}"] = state
    sharded.update(extra_sharded)
    dcp.save(sharded, checkpoint_id=path)
    if global_rank == 0:
        torch.save(checkpoint, path / META_FILE)


class ReshardingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus what a change of (dp, pp, tp) layout needs beyond DTensor resharding.

    - Keys containing a name in ``padded`` may differ in their first dimension: the vocabulary is padded to a
      multiple of 128 x tp, so a tp=2 embedding has more (all-zero, masked) rows than a tp=1 one. The rows
      both have are read; extra rows keep their initial zeros.
    - A key missing from the checkpoint is read from its tied partner (``aliases``): a one-stage run saves
      optimizer state for the shared embedding only, a pipelined run needs it for the last stage's copy too.
    This overrides ``create_local_plan``; ``compat.create_read_items`` is DCP's (private) helper for one entry.
    """

    def __init__(self, padded: Iterable[str], aliases: dict[str, str], strict: bool = True) -> None:
        super().__init__()
        self.padded = tuple(padded)
        self.aliases = aliases
        self.strict = strict

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        requests = []
        for fqn, obj in self.state_dict.items():
            source = fqn if fqn in saved else self._alias(fqn, saved)
            if source is None:  # strict=False (the module's strict_loading): keep this entry's current value
                continue
            md = saved[source]
            if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
                resizable = any(name in fqn for name in self.padded) and tuple(md.size[1:]) == tuple(obj.size()[1:])
                if not resizable:
                    raise ValueError(
                        f"The checkpoint holds {source} with shape {tuple(md.size)}, but this model expects"
                        f" {tuple(obj.size())}: it cannot be resharded into this model. Load it into a model of the same"
                        f" size (only the vocabulary padding may differ between tensor-parallel sizes)."
                    )
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            items = create_read_items(source, md, obj)
            if source != fqn:
                items = [dataclasses.replace(i, dest_index=dataclasses.replace(i.dest_index, fqn=fqn)) for i in items]
            requests += items
        return LoadPlan(requests)

    def _alias(self, fqn: str, saved: dict) -> str | None:
        for name, partner in self.aliases.items():
            if name in fqn and fqn.replace(name, partner) in saved:
                return fqn.replace(name, partner)
        if not self.strict:
            return None
        raise RuntimeError(
            f"The checkpoint has no entry {fqn}: it was written by another model or is incomplete (pass a complete"
            f" checkpoint of this model, or set the module's strict_loading = False to keep its own values)."
        )


def load(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    extra_sharded: dict[str, Any],
    strict: bool,
    padded: Iterable[str] = (),
    aliases: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Load shards in place into ``module``/``optimizers``/``extra_sharded``; return Lightning's metadata."""
    verify(path)  # on every rank, before DCP's collectives
    meta = safe_load(path / META_FILE)
    state: dict[str, Any] = {"model": model_state(module)}
    for i, opt in enumerate(optimizers):
        sharded = sharding_of(opt)
        state[f"optimizer_{i}"] = sharded.template() if sharded is not None else optimizer_state(module, opt)
    state.update(extra_sharded)
    dcp.load(state, checkpoint_id=path, planner=ReshardingLoadPlanner(padded, aliases or {}, strict))
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        sharded = sharding_of(opt)
        if sharded is not None:
            sharded.load_flat_state_dict(state[f"optimizer_{i}"])
        else:
            set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"], options=_OPTIONS)
    for key in extra_sharded:
        extra_sharded[key] = state[key]
    return meta


def save_rank_state(path: Path, global_rank: int, layout: tuple, states: dict[str, Any]) -> None:
    """State that differs on every rank and only makes sense in the same layout (compression error buffers).

    Its shapes are data-dependent, so it is not a DCP entry (DCP loads into tensors of known shape) but one
    ``torch.save`` file per rank inside the checkpoint directory.
    """
    if not states:
        return
    folder = path / RANK_STATE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"layout": layout, "states": states}, folder / f"rank{global_rank}.pt")


def load_rank_state(path: Path, global_rank: int, layout: tuple, device: torch.device) -> dict[str, Any] | None:
    """This rank's saved state, or None if there is none or it was saved under another layout."""
    file = path / RANK_STATE_DIR / f"rank{global_rank}.pt"
    saved, problem = None, None
    try:
        saved = safe_load(file, map_location=device) if file.is_file() else None
    except (OSError, ValueError, RuntimeError) as err:
        problem = str(err)
    if problems := [p for p in gather_objects(problem) if p]:  # every rank raises, not just the one whose file is bad
        raise DamagedCheckpointError(problems[0])
    if saved is None:
        return None
    return saved["states"] if tuple(saved["layout"]) == tuple(layout) else None
