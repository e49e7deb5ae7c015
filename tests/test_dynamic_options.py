"""MultiTaskDataModule's planner options: ``cost_profile`` (a measured profile, read by the profiles' safe loader and
checked on construction) and ``adaptive_schedule`` (lightning_3d/dynamic/adaptive.py), with their errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lightning_3d.costs import AnalyticCostModel, device_spec, model_shape, new_profile
from lightning_3d.recipes import GPT
from lightning_3d.recipes.data.multitask import MultiTaskDataModule
from tests.test_multitask import FLAN, module

SIZES, LENGTHS = [1, 2, 4, 8, 16], [8, 16, 32, 64, 128, 256]


def write_profile(path: Path, shape, per_token: float = 1e-5) -> Path:
    """A profile of ``shape`` unlike the analytic model: every layer costs ``per_token`` seconds per padded token and
    nothing per call (the analytic model's launch floor makes the tiny model's small micro-batches cost as much as
    large ones; here they are cheap, so splitting shortens the pipeline's fill), memory as the analytic model says."""
    device = device_spec("h100")
    with warnings.catch_warnings():  # its "estimated, not measured" note: here it only supplies the memory grids
        warnings.simplefilter("ignore")
        analytic = AnalyticCostModel(shape, device)
    doc = new_profile(shape, device, precision="32-true", note="test: cost per token only")
    b, s = np.meshgrid(np.array(SIZES, float), np.array(LENGTHS, float), indexing="ij")
    for kind in sorted(set(shape.layer_kinds())):
        stored, peak = analytic.layer_memory(kind, b, s, recompute=False, tp=1)
        grids = {"forward": per_token * b * s, "backward": 2 * per_token * b * s, "stored": stored, "peak": peak}
        doc["layers"][kind] = [{"tp": 1, "recompute": False, "microbatch_size": SIZES, "seq_len": LENGTHS,
                                "target_len": None, **{q: np.asarray(a, float).tolist() for q, a in grids.items()}}]
    path.write_text(json.dumps(doc))
    return path


def planner(dm: MultiTaskDataModule, model, pp: int = 2):
    strategy = SimpleNamespace(dims=SimpleNamespace(dp=1, pp=pp, tp=1), schedule="1f1b", virtual_stages=1,
                               pipeline_layer_split=None)
    dm.trainer = SimpleNamespace(lightning_module=model, strategy=strategy, precision="32-true")
    return dm.collator(1, 0).dynamic


def test_a_measured_profile_loads_and_plans_differently_from_the_analytic_model(tmp_path: Path) -> None:
    analytic_dm = module(tmp_path, microbatching="dynamic", memory_budget_gb=1.0)
    model = GPT("tiny", vocab_size=analytic_dm.vocab_size, seq_length=256)
    shape = model_shape(model.config, bytes_per_element=4)
    path = write_profile(tmp_path / "profile.json", shape)
    measured_dm = module(tmp_path, microbatching="dynamic", memory_budget_gb=1.0, cost_profile=str(path))
    assert measured_dm.cost_model is not None and measured_dm.cost_model.source.startswith(f"profile:{path}")
    samples = [analytic_dm.train_dataset[i] for i in range(8)]
    analytic = planner(analytic_dm, model).plan(samples)
    measured = planner(measured_dm, model).plan(samples)
    assert measured.cost_source.startswith("profile:") and not analytic.cost_source.startswith("profile:")
    shapes = [[(len(mb.samples), mb.seq_len) for mb in plan.replicas[0].microbatches] for plan in (analytic, measured)]
    # no cost per call: the profile's plan cuts the batch into more micro-batches than the analytic one
    assert len(shapes[1]) > len(shapes[0]), shapes
    # and the option travels with the planner into the batches it collates (the steps' orders)
    assert planner(measured_dm, model)(samples).orders == measured.replicas[0].orders


def test_a_missing_or_damaged_profile_is_refused_on_construction_with_the_fix(tmp_path: Path) -> None:
    base = dict(data_files=str(FLAN), tokenizer="bytes", seq_length=256, target_length=64, microbatching="dynamic",
                cache_dir=str(tmp_path / "cache"))
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match=rf"cost_profile='{missing}': no such file. Write one with `lightning-3d"
                                         r" profile --config"):
        MultiTaskDataModule(**base, cost_profile=str(missing))
    damaged = tmp_path / "damaged.json"
    damaged.write_text('{"format": "lightning_3d.profile", "version": 2, "model": {')
    with pytest.raises(ValueError, match=rf"cost_profile='{damaged}' is not a usable profile: .*JSON expected.*"
                                         r"Re-run `lightning-3d profile`"):
        MultiTaskDataModule(**base, cost_profile=str(damaged))
    # JSON, but code smuggled in as a "profile" stays data: the loader checks the structure and refuses it
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "!!python/object:os.system", "layers": {"block": "rm -rf /"}}))
    with pytest.raises(ValueError, match="is not a usable profile: .* is not a lightning_3d profile"):
        MultiTaskDataModule(**base, cost_profile=str(other))
    with pytest.raises(ValueError, match=r"cost_profile=.* applies to planned micro-batching only .* not"
                                         r" microbatching='padding'"):
        MultiTaskDataModule(**{**base, "microbatching": "padding"}, cost_profile=str(missing))


def test_a_profile_of_another_model_is_refused_when_the_planner_is_built(tmp_path: Path) -> None:
    dm0 = module(tmp_path, microbatching="dynamic", memory_budget_gb=1.0)
    model = GPT("tiny", vocab_size=dm0.vocab_size, seq_length=256)
    shape = model_shape(model.config, bytes_per_element=4)
    from dataclasses import replace

    path = write_profile(tmp_path / "wide.json", replace(shape, hidden_size=2 * shape.hidden_size))
    dm = module(tmp_path, microbatching="dynamic", memory_budget_gb=1.0, cost_profile=str(path))
    with pytest.raises(ValueError, match=r"was measured for .* but the trained model is .* Profile this model"):
        planner(dm, model)


def test_the_adaptive_schedule_option_reaches_the_plans_and_bad_values_are_refused(tmp_path: Path) -> None:
    dm = module(tmp_path, microbatching="dynamic", memory_budget_gb=1.0, adaptive_schedule="only")
    model = GPT("tiny", vocab_size=dm.vocab_size, seq_length=256)
    plan = planner(dm, model).plan([dm.train_dataset[i] for i in range(8)])
    assert plan.replicas[0].schedule == "adaptive"
    base = dict(data_files=str(FLAN), tokenizer="bytes", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"adaptive_schedule='cyclic' is not a choice \('auto': .*'off': .*'only'"):
        MultiTaskDataModule(**base, microbatching="dynamic", adaptive_schedule="cyclic")
    with pytest.raises(ValueError, match="adaptive_schedule='only' applies to planned micro-batching only"):
        MultiTaskDataModule(**base, microbatching="padding", adaptive_schedule="only")
    # split-backward schedules keep their own orders: 'only' is refused where the planner is built
    dm = module(tmp_path, microbatching="dynamic", memory_budget_gb=1.0, adaptive_schedule="only")
    strategy = SimpleNamespace(dims=SimpleNamespace(dp=1, pp=2, tp=1), schedule="zb_h1", virtual_stages=1,
                               pipeline_layer_split=None)
    dm.trainer = SimpleNamespace(lightning_module=model, strategy=strategy, precision="32-true")
    with pytest.raises(ValueError, match="schedule='zb_h1': the adaptive schedule runs whole backwards"):
        dm.collator(1, 0)


def test_a_compiled_model_is_priced_by_the_profiles_compiled_grids_or_warned_about_them(tmp_path: Path) -> None:
    """A model that compiles its blocks runs the compiled kernels: the planner prices its micro-batches with the
    profile's compiled block grids (here half the eager cost per token), an eager model with the eager ones; a
    profile without compiled grids prices the compiled model with its eager grids and says so, with the fix."""
    dm0 = module(tmp_path, microbatching="dynamic", memory_budget_gb=1.0)
    eager_model = GPT("tiny", vocab_size=dm0.vocab_size, seq_length=256)
    compiled_model = GPT("tiny", vocab_size=dm0.vocab_size, seq_length=256, compile=True)
    shape = model_shape(eager_model.config, bytes_per_element=4)
    plain = write_profile(tmp_path / "eager.json", shape)
    doc = json.loads(plain.read_text())
    fast = {**doc["layers"]["block"][0], "compiled": True}
    fast["forward"] = (np.asarray(fast["forward"]) / 2).tolist()
    fast["backward"] = (np.asarray(fast["backward"]) / 2).tolist()
    doc["layers"]["block"].append(fast)
    both = tmp_path / "both.json"
    both.write_text(json.dumps(doc))
    dm = module(tmp_path, microbatching="dynamic", memory_budget_gb=1.0, cost_profile=str(both))

    def block_seconds(model) -> float:
        cost_model = planner(dm, model).options["cost_model"]
        return float(sum(cost_model.layer_time("block", 4, 128)))

    assert block_seconds(compiled_model) == pytest.approx(block_seconds(eager_model) / 2, rel=1e-12)
    assert planner(dm, compiled_model).options["cost_model"].compiled
    assert not planner(dm, eager_model).options["cost_model"].compiled
    eager_only = module(tmp_path, microbatching="dynamic", memory_budget_gb=1.0, cost_profile=str(plain))
    with pytest.warns(UserWarning, match=rf"cost_profile='{plain}' has no compiled grids, and the model compiles its"
                                         r" blocks: .* `lightning-3d profile --config <your training config> --compile`"):
        chosen = planner(eager_only, compiled_model).options["cost_model"]
    assert chosen is eager_only.cost_model
