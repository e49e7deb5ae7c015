"""``lightning-3d plan --verify``: the top candidates run a few steps each in fresh processes, the fastest measured is
written with the measured times beside the predicted ones (planner/verify.py; docs/planner.md, "Verifying a plan").

One test runs the real command on CPU (a tiny GPT on one device, two candidates of three steps each, each in a fresh
process: about a minute on a shared two-core machine); the others check the choice and the run's config without processes."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import yaml

import lightning_3d.recipes  # noqa: F401  (registers the GPT and T5 recipes with the planner)
from lightning_3d.costs import ClusterSpec
from lightning_3d.planner import SearchOptions, plan
from lightning_3d.planner import verify as verify_module
from lightning_3d.planner.verify import check_verify_options, verification_config, verify
from tests.test_planner import ROOT, _tiny_cpu_config


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _plan(tmp_path: Path, top_k: int = 3):
    return plan(_tiny_cpu_config(tmp_path), 2, cluster=ClusterSpec.single_node(2),
                options=SearchOptions(top_k=top_k, model_error=0.0))


def test_verify_keeps_the_fastest_measured_and_orders_the_rest(tmp_path, monkeypatch) -> None:
    p = _plan(tmp_path, top_k=4)
    assert len(p.configs) >= 4
    times = {0: [0.30, 0.32], 1: None, 2: [0.20, 0.22]}  # PLAN.1's run fails, PLAN.2 is the fastest measured
    calls = []

    def fake_run(cfg, workdir, steps, warmup, timeout_s):
        k = next(i for i, c in enumerate(p.configs) if c == cfg)
        calls.append((k, workdir.name, steps, warmup))
        return {"error": "exit code 1: OOM"} if times[k] is None else {"steps_s": times[k]}

    monkeypatch.setattr(verify_module, "run_candidate", fake_run)
    v = verify(p, top=3, steps=2, warmup=1, repeats=2, log=lambda _m: None)
    # Round-robin: one repeat of every candidate, then the next; a failed candidate is not run again.
    assert calls == [(0, "c0_r0", 2, 1), (1, "c1_r0", 2, 1), (2, "c2_r0", 2, 1), (0, "c0_r1", 2, 1), (2, "c2_r1", 2, 1)]
    assert v.configs == [p.configs[2], p.configs[0], p.configs[1], *p.configs[3:]]
    assert v.predictions[0] is p.predictions[2]
    assert v.measured[0]["median_s"] == 0.21 and v.measured[0]["steps_s"] == [0.2, 0.22, 0.2, 0.22]
    assert v.measured[0]["predicted_s"] == round(p.predictions[2].step_time, 6)
    assert v.measured[1]["median_s"] == 0.31 and v.measured[2] == {"error": "exit code 1: OOM"} and 3 not in v.measured
    text = v.yaml(0)
    assert "# Verified: 3 candidates run for a few steps each; this is the fastest measured (median step):" in text
    assert "#   * PLAN.0: " in text and "measured 210.0 ms (median of 4 steps)" in text and "run failed (exit code 1: OOM)" in text
    measured = json.loads(next(ln for ln in text.splitlines() if ln.startswith("# measured: "))[len("# measured: "):])
    assert measured["median_s"] == 0.21 and yaml.safe_load(text) == p.configs[2]
    assert "# Verified: " in v.yaml(1) and "# Verified: " not in v.yaml(3)
    # The runner-ups stay those of the fastest predicted, now PLAN.1 (the measured order moved it).
    assert "of the fastest predicted, PLAN.1: " in v.confidence_lines()[0]
    monkeypatch.setattr(verify_module, "run_candidate", lambda *a: {"error": "exit code 1: boom"})
    with pytest.raises(RuntimeError, match=r"no candidate ran: PLAN.0: exit code 1: boom; PLAN.1: exit code 1: boom"):
        verify(p, top=2, log=lambda _m: None)


def test_verify_options_and_the_run_config(tmp_path) -> None:
    for args, name in (((0, 5, 2, 1), "verify_top=0"), ((3, 0, 2, 1), "verify_steps=0"), ((3, 5, -1, 1), "verify_warmup=-1"),
                       ((3, 5, 2, 0), "verify_repeats=0"), ((True, 5, 2, 1), "verify_top=True")):
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            check_verify_options(*args)
    cfg = _plan(tmp_path).configs[0]
    run = verification_config(cfg, tmp_path / "t.json", tmp_path, steps=4, warmup=2)
    t = run["trainer"]
    assert t["max_steps"] == 6 and t["limit_val_batches"] == 0 and t["logger"] is False and "max_epochs" not in t
    assert t["callbacks"] == [{"class_path": "lightning_3d.planner.verify.StepTimer",
                               "init_args": {"out": str(tmp_path / "t.json"), "warmup": 2}}]
    # Only the run's length and outputs change: the model, data and strategy are the candidate's.
    assert {k: v for k, v in run.items() if k != "trainer"} == {k: v for k, v in cfg.items() if k != "trainer"}
    assert t["strategy"] == cfg["trainer"]["strategy"] and t["devices"] == cfg["trainer"]["devices"]


def test_cli_plan_verify_runs_the_candidates_on_cpu(tmp_path, monkeypatch, capsys) -> None:
    from lightning_3d.cli import main

    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "model.yaml"
    source.write_text(yaml.safe_dump(_tiny_cpu_config(tmp_path)))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes: 1\ngpus_per_node: 1\ndevice: h100\n")
    out = tmp_path / "plan.yaml"
    main(["plan", "--config", str(source), "--gpus", "1", "--cluster", str(cluster), "--out", str(out), "--top-k", "2",
          "--model-error", "0", "--verify", "--verify-top", "2", "--verify-steps", "2", "--verify-warmup", "1"])
    text = out.read_text()
    measured = json.loads(next(ln for ln in text.splitlines() if ln.startswith("# measured: "))[len("# measured: "):])
    assert len(measured["steps_s"]) == 2 and measured["median_s"] > 0 and measured["predicted_s"] > 0
    predicted = json.loads(next(ln for ln in text.splitlines() if ln.startswith("# prediction: "))[len("# prediction: "):])
    assert predicted["step_time_s"] == measured["predicted_s"]
    starred = next(ln for ln in text.splitlines() if ln.startswith("#   * PLAN.0: "))  # the measured candidate, named
    assert f"micro-batch={predicted['microbatch_size']}x{predicted['num_microbatches']}" in starred
    assert f"measured {measured['median_s'] * 1e3:.1f} ms (median of 2 steps)" in starred
    other = (tmp_path / "plan.1.yaml").read_text()
    second = json.loads(next(ln for ln in other.splitlines() if ln.startswith("# measured: "))[len("# measured: "):])
    assert second["median_s"] >= measured["median_s"]  # the emitted plan is the faster measured of the two
    assert "; measured " in capsys.readouterr().out
    emitted = yaml.safe_load(text)
    assert "callbacks" not in emitted["trainer"] or emitted["trainer"].get("callbacks") is None
    # The emitted plan parses through the CLI as `lightning-3d fit --config` reads it.
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(out), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["devices"] == 1 and printed["data"]["init_args"]["batch_size"] == emitted["data"]["init_args"]["batch_size"]
