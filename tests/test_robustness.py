"""Options that used to be accepted and ignored, SC's recorded link decision, tied names and non-finite steps
(``tests/scenarios/robustness.py``, one group of two processes)."""

from __future__ import annotations

import math
from pathlib import Path

from tests.launch import run_scenario


def test_options_link_decision_tied_names_and_nonfinite_steps(tmp_path: Path) -> None:
    report = run_scenario(2, "robustness", ["--world", "2"], tmp_path / "report.json", timeout=600)
    failed = [c for c in report["cases"] if not c["ok"]]
    assert not failed, failed
    assert len(report["cases"]) == 6
    (sc_rank,) = report["sc_rank_warnings"]  # rank 0 (dp rank 0, pipeline rank 0) says it once
    assert "48x48 (compresses at sc_rank <= 11)" in sc_rank and "sc_min_compression_ratio=2" in sc_rank, sc_rank
    k = 2  # the poisoned step
    for run in report["nonfinite"]:
        clean, poisoned = run["clean"], run["poisoned"]
        assert poisoned[:k] == clean[:k], run  # bitwise: the guard changes nothing on finite steps
        assert math.isnan(poisoned[k]) and all(math.isfinite(x) for x in poisoned[k + 1:]), run
        assert run["unchanged"], run  # parameters and optimizer state after the skipped step == before it
        assert run["finite_state"] and (run["has_state"] or run["kind"] == "exact"), run
        assert len(run["warnings"]) == 1 and f"optimizer step {k} hold NaN or inf" in run["warnings"][0], run
    sc = next(r for r in report["nonfinite"] if r["kind"] == "sc")
    # 5 steps, one skipped: SC counted 4 (the warm-up step among them); both of the stage's buckets (fused weights,
    # the rest) were left uncompressed on the skipped step.
    assert sc["sc_iter"] == 4 and sc["sc_skipped_buckets"] == 2
    slow = report["link_slow_then_fast"]  # saved with a slow link (SC on), resumed with a fast one: SC stays on
    assert slow["sc"] and slow["link"] == 1.0 and slow["sc_iter"] == 4 and slow["resumed"] == slow["straight"]
    fast = report["link_fast_then_slow"]  # and the other way round: SC stays off
    assert not fast["sc"] and fast["link"] == 1e6 and fast["resumed"] == fast["straight"]
    assert fast["straight"][2:] != slow["straight"][2:]  # the two decisions do train differently
    assert report["strict_loading"]["strict"]["ok"] and report["strict_loading"]["loose_step"] == 2
    assert report["healthy_finite"] and len(report["healthy_losses"]) == 2
