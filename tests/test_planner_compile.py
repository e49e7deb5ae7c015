"""The model's ``compile`` as a search dimension (planner/api.py ``compile_cost_models``, ``search_compile``): each
value priced by its own grids of the profile, the chosen one written into the emitted config."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest

import lightning_3d.recipes  # noqa: F401  (registers the GPT and T5 recipes with the planner)
from lightning_3d.costs import ProfiledCostModel
from lightning_3d.planner import SearchOptions, plan
from lightning_3d.planner.confidence import label
from tests.test_planner_cluster import PROFILE, _config


def _with_compiled_blocks(tmp_path: Path, scale: float, kinds=("block",)) -> Path:
    """The synthetic profile plus compiled grids of ``kinds``: the eager grids' times times ``scale``."""
    doc = json.loads(PROFILE.read_text())
    for kind in kinds:
        extra = []
        for entry in doc["layers"][kind]:
            e = copy.deepcopy(entry)
            e["compiled"] = True
            e["forward"] = [[None if t is None else t * scale for t in row] for row in e["forward"]]
            e["backward"] = [[None if t is None else t * scale for t in row] for row in e["backward"]]
            extra.append(e)
        doc["layers"][kind] += extra
    path = tmp_path / f"compiled_{scale}.json"
    path.write_text(json.dumps(doc))
    return path


def test_the_search_chooses_compile_where_the_profile_prices_it(tmp_path) -> None:
    """With compiled grids in the profile the plan searches the model's compile both ways, each with its own grids:
    compiled blocks at half the eager time win (compile: true written, the prediction the compiled grids' own), at
    twice the time they lose (compile: false written over the config's true); (False,) / (True,) restrict the choice;
    without compiled grids the config's compile stays, with a warning when it compiles, and (True,) is refused."""
    cfg = _config(tmp_path)
    opts = dict(top_k=2, microbatch_sizes=(2,), schedules=("1f1b",), pipeline_parallel_sizes=(1,),
                tensor_parallel_sizes=(1,), compression=(False,), cuda_graphs=(False,), shard_optimizer_state=(False,))
    fast = _with_compiled_blocks(tmp_path, 0.5)
    p = plan(cfg, 2, profile=fast, global_batch_size=8, options=SearchOptions(**opts))
    assert [q.candidate.compile for q in p.predictions] == [True, False]  # same layout, compiled first
    assert p.configs[0]["model"]["init_args"]["compile"] is True and p.configs[1]["model"]["init_args"]["compile"] is False
    for flag in (True, False):  # the merged list holds each value's own search result
        alone = plan(cfg, 2, profile=fast, global_batch_size=8, options=SearchOptions(**opts, compile=(flag,)))
        mine = next(q for q in p.predictions if q.candidate.compile is flag)
        assert alone.predictions[0].candidate == mine.candidate and alone.predictions[0].step_time == mine.step_time
    assert p.predictions[0].step_time < p.predictions[1].step_time
    assert label(p.predictions[0].candidate).split()[-1] == "compile" and "compile" not in label(p.predictions[1].candidate)

    cfg["model"]["init_args"]["compile"] = True
    slow = _with_compiled_blocks(tmp_path, 2.0)
    p = plan(cfg, 2, profile=slow, global_batch_size=8, options=SearchOptions(**opts))
    assert p.predictions[0].candidate.compile is False and p.configs[0]["model"]["init_args"]["compile"] is False
    only = plan(cfg, 2, profile=slow, global_batch_size=8, options=SearchOptions(**opts, compile=(True,)))
    assert {q.candidate.compile for q in only.predictions} == {True}
    assert only.configs[0]["model"]["init_args"]["compile"] is True

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(cfg, 2, profile=PROFILE, global_batch_size=8, options=SearchOptions(**opts))
    assert any("has no compiled grids: the plan prices eager blocks" in str(x.message) for x in caught)
    assert {q.candidate.compile for q in p.predictions} == {False}
    assert p.configs[0]["model"]["init_args"]["compile"] is True  # the config's, untouched
    with pytest.raises(ValueError, match=r"compile=\(True,\)\) needs the profile's compiled grids"):
        plan(cfg, 2, profile=PROFILE, global_batch_size=8, options=SearchOptions(**opts, compile=(True,)))
    with pytest.raises(ValueError, match=r"SearchOptions\(compile=\(\)\)"):
        SearchOptions(compile=())
    with pytest.raises(ValueError, match="prices compile=False blocks only"):
        plan(cfg, 2, cost_model=ProfiledCostModel(PROFILE, derive_tp=True), global_batch_size=8,
             options=SearchOptions(**opts, compile=(True,)))
