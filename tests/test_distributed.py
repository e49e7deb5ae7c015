"""Distributed behaviour on CPU (gloo): each test starts one process group that runs many checks.

Tolerances: fp32 losses and final parameters within 1e-5 relative of the single-process reference
(see tests/scenarios/common.py for why the reference's Adam uses eps=1e-6).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import ROOT, run_scenario

TOLERANCE = 1e-5


def _check(results: list[dict]) -> None:
    bad = [r for r in results if not (r["loss_err"] <= TOLERANCE and r["param_err"] <= TOLERANCE)]
    assert not bad, f"layouts off the reference: {bad}"


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_layout_and_schedule_matches_single_process_training(world: int, tmp_path: Path) -> None:
    report = run_scenario(world, "layouts", ["--world", str(world)], tmp_path / "report.json", timeout=900)
    results = report["results"]
    _check(results)
    layouts = {(r["dp"], r["pp"], r["tp"]) for r in results}
    expected = {(dp, pp, world // (dp * pp)) for dp in range(1, world + 1) for pp in range(1, world + 1) if world % (dp * pp) == 0}
    assert layouts == ({(2, 2, 2)} if world == 8 else expected)
    for layout in layouts:
        if layout[1] > 1:  # every schedule ran for every pipelined layout
            assert {r["schedule"] for r in results if (r["dp"], r["pp"], r["tp"]) == layout} == {"gpipe", "1f1b", "interleaved_1f1b"}
    if world in (2, 4):  # sequence parallel, accumulation and variable micro-batch shapes/counts were covered
        assert any(r.get("sp") for r in results) and any(r.get("variable") for r in results)


def test_bad_inputs_raise_on_every_rank_before_any_collective(tmp_path: Path) -> None:
    report = run_scenario(2, "errors", ["--world", "2"], tmp_path / "report.json", timeout=600)
    failed = [c for c in report["cases"] if not c["ok"]]
    assert not failed, failed
    assert len(report["cases"]) == 9
    assert len(report["healthy_losses"]) == 2


def test_plain_module_validation_test_and_exact_resume(tmp_path: Path) -> None:
    report = run_scenario(4, "features", ["--world", "4"], tmp_path / "report.json", timeout=900)
    assert report["plain"]["param_err"] <= TOLERANCE
    evaluation = report["evaluation"]
    assert evaluation["rank_spread"] == 0.0  # every rank reports the same loss
    for key in ("val", "test"):
        assert abs(evaluation[key] - evaluation["expected"]) <= TOLERANCE * evaluation["expected"]
    for run in report["resume"]:
        assert run["checkpoint_is_dir"]
        assert run["resumed"] == run["straight"], run  # bitwise: same data, optimizer, schedule and RNG state
        assert run["max_param_diff"] == 0.0


def test_torchrun_across_two_nodes(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    report = tmp_path / "report.json"
    nodes = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
               "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "tests.scenarios.torchrun_job", "--report", str(report)]
        nodes.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-4000:] for o in outputs)
    import json

    result = json.loads(report.read_text())
    assert result["nodes"] == 2
    _check(result["results"])


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failure_on_one_rank_ends_the_job_on_all_ranks(fail_rank: int) -> None:
    """Lightning's launcher starts the second process; whichever rank fails, nobody is left hanging."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "tests/scenarios/crash_job.py", "--fail-rank", str(fail_rank)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert f"simulated failure on rank {fail_rank}" in proc.stdout + proc.stderr
    assert time.monotonic() - start < 150
