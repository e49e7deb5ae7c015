"""benchmarks/parallel/long_sequence.py on CPU with a tiny GPT: the search for the longest length, and both systems (ours:
checkpointing, linear-memory attention, chunked loss; plain PyTorch) computing the same loss. The GPU measurement
itself is a benchmark (the command is in docs/context_parallel.md), never a test."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.tolerance import chain_tolerance

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "parallel" / "long_sequence.py"
TINY = ["--device", "cpu", "--preset", "tiny", "--vocab-size", "512", "--steps", "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("long_sequence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_longest_fitting_doubles_then_bisects_to_the_boundary(bench) -> None:
    longest_fitting = bench.longest_fitting
    tried = []

    def fits(seq: int) -> bool:
        tried.append(seq)
        return seq <= 45_000

    assert longest_fitting(fits, 8192, 1 << 20, 4096) == 40960  # the largest multiple of 4096 that fits
    assert tried == [16384, 32768, 65536, 49152, 40960, 45056]
    tried.clear()
    assert longest_fitting(fits, 32768, 1 << 20, 4096, failed=65536) == 40960 and 65536 not in tried
    assert longest_fitting(lambda seq: True, 8192, 20000, 4096) == 20000  # capped by the limit


def test_ours_and_plain_train_the_same_loss(bench, tmp_path, monkeypatch) -> None:
    """One step from the same weights and tokens: the systems differ in recomputation (same values), kernels (the same
    CPU flash kernel for fp32 both ways) and the loss's summation order (chunks of 32 tokens against one sum), so the
    losses (means of positive token terms) differ by at most 2·seq·u of the loss (tests/tolerance.py)."""
    out = tmp_path / "long.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *TINY, "--lengths", "64", "128", "--loss-chunk", "32", "--in-process",
                                      "--find-longest", "--max-length", "128", "--out", str(out)])
    bench.main()
    report = json.loads(out.read_text())
    assert report["longest"] == {"ours": 128, "plain": 128}  # nothing fails below --max-length on CPU
    runs = {(r["system"], r["seq"]): r for r in report["runs"]}
    assert sorted(runs) == [("ours", 64), ("ours", 128), ("plain", 64), ("plain", 128)]
    for seq in (64, 128):
        ours, plain = runs["ours", seq], runs["plain", seq]
        assert ours["fits"] and plain["fits"] and ours["tokens_per_s"] > 0 and ours["tflops"] > 0
        assert abs(ours["loss"] - plain["loss"]) <= chain_tolerance(1, seq) * plain["loss"]



def test_a_right_guess_takes_two_tries_and_a_wrong_one_falls_back_to_the_search(bench) -> None:
    tried = []

    def fits(seq: int) -> bool:
        tried.append(seq)
        return seq <= 45_000

    assert bench.longest_fitting(fits, 8192, 1 << 20, 4096, guess=40960) == 40960 and tried == [40960, 45056]
    tried.clear()  # too low: walks up while it fits
    assert bench.longest_fitting(fits, 8192, 1 << 20, 4096, guess=36864) == 40960 and tried == [36864, 40960, 45056]
    tried.clear()  # too high: walks down, then bisects between what fitted and the lowest that failed
    assert bench.longest_fitting(fits, 8192, 1 << 20, 4096, guess=61440, walk=2) == 40960
    assert tried[:2] == [61440, 57344] and max(s for s in tried if s <= 45_000) == 40960
    tried.clear()  # a timeout (None) ends the search with the longest found so far
    assert bench.longest_fitting(lambda s: None if s > 20000 else True, 8192, 1 << 20, 4096, guess=16384) == 16384


def test_the_guess_extrapolates_the_measured_peaks(bench) -> None:
    runs = [{"seq": 1000, "fits": True, "peak_memory_gb": 11.0}, {"seq": 2000, "fits": True, "peak_memory_gb": 12.0},
            {"seq": 4000, "fits": False}]
    # 1 GiB per 1000 tokens above 12 GiB at 2000: 20 GiB of which 1.5 are reserved leave 6.5 GiB, 6500 more tokens.
    assert bench.extrapolate(runs, 20.0, 512) == 8192 // 512 * 512
    assert bench.extrapolate(runs[:1], 20.0, 512) is None and bench.extrapolate(runs, None, 512) is None


def test_the_summary_has_the_goals(bench) -> None:
    run = dict(fits=True, tokens_per_s=1.0, mfu=0.5, step_s=1.0, peak_memory_gb=10.0, estimate_gb=11.0, steps=2)
    report = {"runs": [{**run, "system": "ours", "seq": 8192, "tflops": 400.0},
                       {**run, "system": "ours", "seq": 65536, "tflops": 320.0},
                       {"system": "plain", "seq": 32768, "fits": False}],
              "longest": {"plain": 24576, "ours": 229376}, "skipped": ["ours 237568"]}
    text = bench.summary(report)
    assert "ours TFLOP/s at 64k / at 8k: 0.80 (goal >= 0.75)" in text
    assert ("longest that fits: plain 24576, ours >= 229376 (search cut by the time budget); ours / plain 9.33"
            " (goal >= 2)") in text
    assert "+10%" in text and "out of memory" in text and "not run (time budget): ours 237568" in text
    report.update(skipped=[], cut_by_time=["ours"])
    assert "ours >= 229376 (search cut: a longer probe cannot finish within --timeout)" in bench.summary(report)


def test_time_cap_keeps_probes_within_the_measurement_timeout(bench) -> None:
    """The 128k-token step of GPT-1.3B took 16.35 s and the 64k one 4.66 s on an H200: a probe of one step within a
    97 s timeout (30 s to start) can be at most ~262k tokens long, not the 630k that memory alone allowed."""
    script = bench
    runs = [{"seq": 65536, "step_s": 4.66, "fits": True}, {"seq": 131072, "step_s": 16.35, "fits": True}]
    cap = script.time_cap(runs, 97.0, 1, 8192)
    b = (16.35 - 4.66) / (131072**2 - 65536**2)
    a = 16.35 - b * 131072**2
    assert cap == int(((67.0 - a) / b) ** 0.5 // 8192 * 8192)
    assert 131072 < cap < 630784
    assert script.time_cap(runs[:1], 97.0, 1, 8192) is None  # one measurement: no extrapolation
    assert script.time_cap(runs, 20.0, 1, 8192) is None  # not even the start fits
