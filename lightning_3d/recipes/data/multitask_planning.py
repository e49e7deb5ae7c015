"""The planner options of ``MultiTaskDataModule`` (``cost_profile``, ``adaptive_schedule``), checked when the module
is constructed so that a bad path or value fails before any process group or data exists, with the fix named.

A profile is read by the cost models' own loader (``lightning_3d.costs.ProfiledCostModel``: JSON only, its structure
checked field by field), so a file a user hands in is data and never runs code.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

from lightning_3d.costs import ProfiledCostModel
from lightning_3d.costs.model import ModelShape
from lightning_3d.dynamic.adaptive import check_adaptive_choice
from lightning_3d.recipes.data.multitask_batching import PLANNED


def load_cost_profile(path: object, microbatching: str) -> ProfiledCostModel | None:
    """The measured cost model of ``cost_profile`` (None: the analytic one); ValueError naming the path and the
    fix for a missing, unreadable or malformed file, or an option the micro-batching does not use."""
    if path is None:
        return None
    if microbatching not in PLANNED:
        raise ValueError(f"cost_profile={path!r} applies to planned micro-batching only ({', '.join(PLANNED)}), not"
                         f" microbatching={microbatching!r}: set one of those or drop cost_profile.")
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"cost_profile={path!r} must be the path of a profile JSON written by `lightning-3d profile`.")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"cost_profile={str(path)!r}: no such file. Write one with `lightning-3d profile --config"
                         " <your training config>` on the training GPU, or drop cost_profile to plan with the analytic"
                         " cost model.")
    try:
        return ProfiledCostModel(file)
    except (ValueError, TypeError, KeyError, OSError) as err:
        raise ValueError(f"cost_profile={str(path)!r} is not a usable profile: {err} Re-run `lightning-3d profile` to"
                         " write it again, or drop cost_profile to plan with the analytic cost model.") from None


def priced_as_trained(cost_model: ProfiledCostModel | None, path: object, compiled: bool) -> ProfiledCostModel | None:
    """The cost model that prices the trained model's micro-batches: for a model that compiles its blocks (the
    recipes' ``compile``), the profile's compiled grids (``lightning-3d profile --compile``), which time the fused
    kernels it runs; where the profile has none, its eager grids with a warning that names the fix (a compiled block
    runs faster than they say, so the plans lean towards smaller micro-batches than it would choose)."""
    if cost_model is None or not compiled or cost_model.compiled:
        return cost_model
    try:
        return ProfiledCostModel(Path(str(path)).expanduser(), compiled=True)
    except ValueError:
        warnings.warn(f"cost_profile={str(path)!r} has no compiled grids, and the model compiles its blocks: the"
                      " planner prices them with the eager grids. Profile with `lightning-3d profile --config <your"
                      " training config> --compile` for plans priced as the model runs.", stacklevel=2)
        return cost_model


def check_adaptive_option(value: object, microbatching: str) -> str:
    """``adaptive_schedule`` if it is one of the choices (and, when not the default, the micro-batching plans)."""
    check_adaptive_choice(value)
    if value != "auto" and microbatching not in PLANNED:
        raise ValueError(f"adaptive_schedule={value!r} applies to planned micro-batching only ({', '.join(PLANNED)}),"
                         f" not microbatching={microbatching!r}: the fixed ones run the strategy's named schedule.")
    return str(value)


def check_profile_shape(cost_model: ProfiledCostModel, shape: ModelShape, path: str) -> None:
    """A profile measures one model's layers: refuse one of another model (the vocabulary may differ by the
    tensor-parallel padding, which the head's cost barely notices)."""
    measured = replace(cost_model.shape, vocab_size=shape.vocab_size)
    if measured != shape:
        raise ValueError(f"cost_profile={path!r} was measured for {cost_model.shape}, but the trained model is {shape}."
                         " Profile this model (`lightning-3d profile --config <its training config>`, with the"
                         " precision it trains in), or drop cost_profile.")
