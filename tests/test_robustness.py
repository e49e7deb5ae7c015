"""Options that used to be accepted and ignored, SC's and CB's recorded link decisions, tied names and non-finite steps
(``tests/scenarios/robustness.py``, one group of two processes, which then runs ``tests/scenarios/late_nonfinite.py``
too: starting a group costs about as much as either scenario's checks; tests/scenarios/group.py)."""

from __future__ import annotations

import math

import pytest

from tests.scenarios.group import run_group


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("robustness")
    return run_group(2, [("robustness", ""), ("late_nonfinite", "")], folder, timeout=1100)


def test_options_link_decision_tied_names_and_nonfinite_steps(two_ranks: dict) -> None:
    report = two_ranks["robustness"]
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
    check_lazy_verdict(report, k)
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
    # CB decided by the pipeline link: saved on a slow link (CB on), resumed on a fast one, it stays on; the other way
    # round it stays off; each resumed run trains exactly as the straight one.
    slow, fast = report["cb_link_slow_then_fast"], report["cb_link_fast_then_slow"]
    assert slow["straight_cb"] and slow["cb"] and slow["link"] == 1.0 and slow["resumed"] == slow["straight"], slow
    assert not fast["straight_cb"] and not fast["cb"] and fast["link"] == 1e6 and fast["resumed"] == fast["straight"], fast
    assert fast["straight"][1:] != slow["straight"][1:]  # the two decisions do train differently
    forced = report["cb_link_forced"]  # True / False override the link, which is then never measured
    assert forced == {"True": {"cb": True, "probed": 0, "link": None}, "False": {"cb": False, "probed": 0, "link": None}}
    assert report["healthy_finite"] and len(report["healthy_losses"]) == 2


def check_lazy_verdict(report: dict, k: int) -> None:
    """Fused AdamW: the verdict skips the step on the device and reaches the host one step later."""
    for both in report["lazy_vs_sync"]:  # data parallel, shard_optimizer_state, tensor parallel
        lazy, sync = both["lazy"], both["sync"]
        # Bit for bit: parameters and optimizer state after the run, every loss; the skipped step left nothing behind.
        assert both["equal"] and both["lazy_unchanged"] and both["sync_unchanged"], both
        assert math.isnan(lazy["losses"][k]) and math.isnan(sync["losses"][k]), both
        assert lazy["losses"][:k] + lazy["losses"][k + 1:] == sync["losses"][:k] + sync["losses"][k + 1:], both
        for run in (lazy, sync):
            assert len(run["warnings"]) == 1 and f"optimizer step {k} hold NaN or inf" in run["warnings"][0], both
        # Host reads by the step code by the end of each step: the lazy path has read only the earlier steps'
        # verdicts (none of its own step's); the synchronous one reads its own step's too. Each verdict read once.
        steps = len(lazy["losses"])
        assert lazy["reads"] == list(range(steps)) and lazy["total"] == steps, both
        assert sync["reads"] == list(range(1, steps + 1)) and sync["total"] == steps, both
    assert [both["layout"] for both in report["lazy_vs_sync"]] == ["dp", "sharded", "tp"]
    raised = report["lazy_raise"]  # bad step 1: raised in step 2's closure, before its update
    assert raised["case"]["ok"] and raised["global_step"] == 2 and raised["unchanged"], raised
    last = report["lazy_last_step"]  # 3 steps, the last one bad: acted on at fit's end
    assert len(last["skip_warnings"]) == 1 and "optimizer step 2 hold NaN or inf" in last["skip_warnings"][0], last
    assert last["raise"]["ok"] and last["checkpoint"]["ok"] and last["streak"]["ok"], last
    assert last["checkpoints_written"] == [], last  # the checkpoint after the bad step was not written


def test_the_lazy_verdict_is_taken_only_where_the_optimizer_skips_exactly() -> None:
    """Fused AdamW (also as the unwrapped optimizer of Lightning's wrapper) takes the lazy verdict; a GradScaler
    (precision "16-mixed", which owns found_inf), a foreach optimizer or lazy_verdict=False keep the synchronous one."""
    import torch
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from lightning_3d.strategies.options import PipelineOptions
    from lightning_3d.strategies.pipeline_engine import PipelineEngine

    engine = PipelineEngine(PipelineOptions(), compression=None, stats=None)
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)
    assert engine.verdict_can_wait(fused, scaled=False)
    assert engine.verdict_can_wait(LightningOptimizer(fused), scaled=False)
    assert not engine.verdict_can_wait(fused, scaled=True)
    assert not engine.verdict_can_wait(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), scaled=False)
    engine.lazy_verdict = False
    assert not engine.verdict_can_wait(fused, scaled=False)


def test_a_nan_written_in_on_before_optimizer_step_is_caught(two_ranks: dict) -> None:
    """The guard judges the gradients the optimizer will use: after Lightning's on_before_optimizer_step hooks (and
    clipping), on one replica only, with SC (its state restored) and with the lazy verdict's fused AdamW."""
    report = two_ranks["late_nonfinite"]
    for name in ("sc", "lazy"):
        run = report[name]
        assert run["unchanged"] and run["params_finite"], run  # parameters and optimizer state as before the step
        assert len(run["warnings"]) == 1 and "optimizer step 2 hold NaN or inf" in run["warnings"][0], run
        assert len(run["losses"]) == 5 and run["finite_after"], run  # the hook's NaN is in a gradient, not the loss
    assert report["sc"]["sc_unchanged"], report["sc"]  # step count, error feedback, P and Q as before the step
    assert report["raise"]["ok"], report["raise"]
