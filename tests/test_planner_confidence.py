"""How sure the planner is: the runner-ups within the model's error of the best, the term that decides between each
and the best, and how the plan writes and prints them (planner/confidence.py; docs/planner.md, "How sure the plan
is"). Analytic costs: no profile, no processes."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml

import lightning_3d.recipes  # noqa: F401  (registers the GPT and T5 recipes with the planner)
from lightning_3d.costs import AnalyticCostModel, ClusterSpec, ModelShape
from lightning_3d.planner import SearchOptions, Workload, plan, predict, search
from lightning_3d.planner.confidence import (
    VALIDATED_ERROR_ONE_GPU,
    VALIDATED_ERROR_SEVERAL_GPUS,
    check_model_error,
    differences,
    runner_ups,
    step_terms,
    validated_error,
    within_error,
)
from lightning_3d.planner.model import Candidate
from tests.test_planner import _tiny_cpu_config


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _workload(batch: int = 8) -> Workload:
    shape = ModelShape("gpt", 8, 1024, 16, 4096, 32000)
    return Workload(shape, 1024, batch, AnalyticCostModel(shape), ClusterSpec.single_node(2))


def test_the_band_is_where_two_predictions_off_by_the_error_overlap() -> None:
    # t (1 + e) of the best reaches t' (1 - e) of the other exactly at t' = t (1 + e) / (1 - e).
    assert within_error(1.0, 1.1 / 0.9 - 1e-12, 0.1) and not within_error(1.0, 1.1 / 0.9 + 1e-9, 0.1)
    assert within_error(1.0, 1.0, 0.0) and not within_error(1.0, 1.0 + 1e-12, 0.0)
    assert validated_error(1) == VALIDATED_ERROR_ONE_GPU and validated_error(8) == VALIDATED_ERROR_SEVERAL_GPUS
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match=r"model_error=.* must be a fraction in \[0, 1\)"):
            check_model_error(bad)
    with pytest.raises(ValueError, match=r"model_error=2 must be a fraction"):
        search(_workload(), 2, SearchOptions(model_error=2))


def test_a_pipeline_runner_up_is_decided_by_its_bubble() -> None:
    w = _workload()
    dp = predict(Candidate(2, 1, 1, 1, 4, "1f1b", 1, (8,), (False,), False), w)
    pipe = predict(Candidate(1, 2, 1, 1, 8, "1f1b", 1, (4, 4), (False, False), False), w)
    best, other = sorted([dp, pipe], key=lambda p: p.step_time)
    assert best is dp  # NVLink: the all-reduce of a 1 GB model is short next to a 1F1B bubble of one micro-batch
    for p in (dp, pipe):  # the terms add up to the step
        assert sum(step_terms(p).values()) == pytest.approx(p.step_time, rel=1e-12)
    gap = other.step_time / best.step_time
    assert runner_ups([best, other], (gap - 1) / (gap + 1) - 1e-9) == []  # just outside the band
    (r,) = runner_ups([best, other], (gap - 1) / (gap + 1) + 1e-9)
    assert r.rank == 1 and r.term == "bubble"
    assert r.term_seconds == (step_terms(pipe)["bubble"], step_terms(dp)["bubble"]) and r.term_seconds[1] == 0.0
    assert r.differs == "dp=1 pp=2 micro-batch=1x8 schedule=1f1b split=4/4 vs dp=2 pp=1 micro-batch=1x4"
    text = r.sentence(best)
    assert text.startswith(r.differs) and "the pipeline bubble and sends decides" in text
    assert "measure one step of each (lightning-3d plan --verify)" in text


def test_a_runner_up_the_model_cannot_separate_says_so() -> None:
    w = _workload()
    a = predict(Candidate(2, 1, 1, 1, 4, "1f1b", 1, (8,), (False,), False), w)
    b = predict(Candidate(2, 1, 1, 1, 4, "1f1b", 1, (8,), (False,), True), w)  # SC off on NVLink: the same time
    assert a.step_time == b.step_time
    (r,) = runner_ups([a, b], 0.0)
    assert r.term == "none" and differences(a.candidate, b.candidate) == "compression=True vs compression=False"
    assert "the model sees no difference" in r.sentence(a)


def test_the_search_returns_every_retimed_candidate_within_the_error() -> None:
    w = _workload(16)
    wide = search(w, 2, SearchOptions(top_k=1, model_error=0.5))
    best = wide.top[0].step_time
    assert wide.model_error == 0.5 and len(wide.top) > 1
    assert all(within_error(best, p.step_time, 0.5) for p in wide.top[1:])
    narrow = search(w, 2, SearchOptions(top_k=1, model_error=0.0))
    assert all(p.step_time == best for p in narrow.top[1:]) and len(narrow.top) < len(wide.top)
    assert search(w, 2, SearchOptions(top_k=1)).model_error == VALIDATED_ERROR_SEVERAL_GPUS


def test_the_plan_writes_and_prints_its_runner_ups(tmp_path, capsys) -> None:
    from lightning_3d.cli import main

    source = tmp_path / "model.yaml"
    source.write_text(yaml.safe_dump(_tiny_cpu_config(tmp_path)))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes: 1\ngpus_per_node: 4\ndevice: h100\n")
    out = tmp_path / "plan.yaml"
    main(["plan", "--config", str(source), "--gpus", "4", "--cluster", str(cluster), "--out", str(out), "--top-k", "1",
          "--model-error", "0.3"])
    text = out.read_text()
    p = plan(str(source), 4, cluster=cluster, options=SearchOptions(top_k=1, model_error=0.3))
    assert yaml.safe_load(text) == p.configs[0]
    ups = p.runner_ups
    assert ups and len(p.predictions) == len(ups) + 1  # top-1 plus every runner-up, each with its own file
    assert all((tmp_path / f"plan.{k}.yaml").exists() for k in range(1, len(p.predictions)))
    assert f"# Runner-ups within the model's error (+-30.0 % per prediction): {len(ups)}" in text
    listed = json.loads(next(ln for ln in text.splitlines() if ln.startswith("# runner_ups: "))[len("# runner_ups: "):])
    assert [r["rank"] for r in listed] == [r.rank for r in ups]
    assert all(r["step_time_s"] <= p.predictions[0].step_time * 1.3 / 0.7 for r in listed)
    printed = capsys.readouterr().out
    assert f"Runner-ups within the model's error (+-30.0 % per prediction): {len(ups)}" in printed
    assert f"  PLAN.1: {ups[0].sentence(p.predictions[0])}" in printed
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(source), "--gpus", "4", "--out", str(out), "--model-error", "1.5"])
    assert "model_error=1.5 must be a fraction in [0, 1)" in capsys.readouterr().err
