"""Dynamic micro-batching in a real process group (gloo, CPU): trained parameters and losses equal single-process
training on the same global batches (tests/scenarios/dynamic.py), with replicas holding different numbers of
micro-batches and tokens, and every step running its own planned schedule. GPT and T5 (whose inputs and targets
are padded per micro-batch to their own planned lengths). Ranks that planned differently raise before any send. At
4 processes also the multi-task data module's ``packed_dynamic`` and ``auto`` micro-batching (tests/scenarios/
multitask.py ``planned_fits``: (2,2,1), (1,2,2), (2,1,2) for GPT and T5, (4,1,1) GPT, (1,1,4) T5), at (2,2,1) with
compressed backpropagation (full rank) and the sharded optimizer state on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_scenario

TOLERANCE = 1e-5  # fp32, as tests/test_distributed.py: summation order only (tests/tolerance.py)


@pytest.mark.parametrize("world", [2, 4])
def test_dynamic_microbatching_matches_single_process_training(world: int, tmp_path: Path) -> None:
    report = run_scenario(world, "dynamic", ["--world", str(world)], tmp_path / "report.json", timeout=900)
    results = report["results"]
    expected = {2: {(1, 2, 1, False), (1, 2, 1, True)},
                4: {(2, 2, 1, False), (2, 1, 2, False), (1, 2, 2, False), (2, 2, 1, True), (2, 1, 2, True),
                    (1, 2, 2, True)}}[world]
    assert {(r["dp"], r["pp"], r["tp"], r.get("t5", False)) for r in results} == expected  # (dp, pp, tp, T5)
    for r in results:
        assert r["loss_err"] <= TOLERANCE and r["param_err"] <= TOLERANCE, r
        assert r["shapes"] > 1 and max(max(c) for c in r["counts"]) > 1, r  # several micro-batch shapes per step
        if r["dp"] > 1:  # replicas differ in tokens and, in some step, in micro-batch count
            assert any(len(set(t)) > 1 for t in r["tokens"]) and any(len(set(c)) > 1 for c in r["counts"]), r
    if world == 4:
        assert any(r["schedule"] == "interleaved_1f1b" for r in results)
        # the multi-task data module's packed dynamic and auto micro-batching at the 4-process layouts but pp = 4
        planned = report["multitask"]
        assert set(planned) == {"gpt_221_packed_dynamic", "t5_221_auto", "gpt_122_packed_dynamic", "t5_122_auto",
                                "gpt_212_auto", "t5_212_packed_dynamic", "gpt_411_packed_dynamic",
                                "t5_114_packed_dynamic"}
        for name, r in planned.items():
            assert r["loss_err"] <= TOLERANCE and r["param_err"] <= TOLERANCE, (name, r)
            assert len(r["choices"]) == len(r["losses"]), (name, r)  # every step recorded what ran
            assert name.endswith("auto") or set(r["choices"]) == {"packed_dynamic"}, (name, r["choices"])
        for name in ("gpt_221_packed_dynamic", "t5_221_auto"):  # CB at full rank and the sharded optimizer state on
            strategy = planned[name]["strategy"]
            assert strategy["cb_sends"] > 0 and strategy["sharded"] is True, (name, strategy)
    else:  # bad input in the data path: every rank raised the planner's message, none hung in a collective
        assert report["empty_sample_raised_on_every_rank"] is True
        # ranks of one pipeline given different schedules: every rank raised the strategy's message before any send
        assert report["plan_mismatch_raised_on_every_rank"] is True and report["sends_before_mismatch_error"] == 0
