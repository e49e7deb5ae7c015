"""Schedules are pure functions: check every (schedule, pp, v, M) against the FIFO-channel simulator."""

import pytest

from lightning_3d.pipeline.schedules import Action, build_forward_only, build_schedule, check_schedule

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)]


@pytest.mark.parametrize("name,virtual", CASES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_every_schedule_runs_to_completion(name: str, virtual: int, pp: int) -> None:
    if name == "interleaved_1f1b" and pp == 1:
        pytest.skip("interleaving needs two pipeline ranks")
    for m in range(1, 17):
        if name == "interleaved_1f1b" and m % pp:
            continue
        orders = [build_schedule(name, pp, virtual, m, r) for r in range(pp)]
        check_schedule(orders, pp * virtual)
        check_schedule([build_forward_only(pp, virtual, m, r) for r in range(pp)], pp * virtual)
        for r, order in enumerate(orders):
            stages = {r + c * pp for c in range(virtual)}
            expected = {(k, s, mb) for k in "FB" for s in stages for mb in range(m)}
            assert {(a.kind, a.stage, a.microbatch) for a in order} == expected
            assert len(order) == len(expected)


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 4), (2, 5), (3, 2)])
def test_1f1b_keeps_at_most_pp_minus_rank_in_flight_and_drains_pp_minus_rank(pp: int, m: int) -> None:
    for r in range(pp):
        order = build_schedule("1f1b", pp, 1, m, r)
        in_flight, peak = 0, 0
        for a in order:
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(pp - r, m)
        # The cool-down: backwards after the last forward are exactly the last pp - r (Optimus-CC's epilogue).
        assert sum(a.epilogue for a in order) == min(pp - r, m)
        assert all(a.kind == "B" for a in order if a.epilogue)


def test_gpipe_runs_all_forwards_first() -> None:
    order = build_schedule("gpipe", 3, 1, 4, 1)
    assert [a.kind for a in order] == ["F"] * 4 + ["B"] * 4
    assert [a.epilogue for a in order] == [False] * 4 + [True] * 4


def test_interleaved_order_matches_megatron() -> None:
    # pp=2, v=2, M=4 on rank 0: warm-up (pp-r-1)*2 + (v-1)*pp = 4 forwards, then 1F1B, then drain.
    order = build_schedule("interleaved_1f1b", 2, 2, 4, 0)
    assert [repr(a) for a in order] == [
        "F0,0", "F0,1", "F2,0", "F2,1", "F0,2", "B2,0", "F0,3", "B2,1", "F2,2", "B0,0", "F2,3",
        "B0,1*", "B2,2*", "B2,3*", "B0,2*", "B0,3*",
    ]


def test_bad_schedule_inputs() -> None:
    with pytest.raises(ValueError, match="Unknown schedule 'zb'"):
        build_schedule("zb", 2, 1, 4, 0)
    with pytest.raises(ValueError, match=r"number of micro-batches \(5\) to be a multiple of pipeline_parallel_size \(2\)"):
        build_schedule("interleaved_1f1b", 2, 2, 5, 0)


def test_simulator_rejects_a_deadlocking_order() -> None:
    good = [build_schedule("1f1b", 2, 1, 2, r) for r in range(2)]
    check_schedule(good, 2)
    # Rank 0 waits for the gradient of micro-batch 1 before sending its activation: a deadlock.
    bad = [tuple([Action("F", 0, 0), Action("B", 0, 1), Action("F", 0, 1), Action("B", 0, 0)]), good[1]]
    with pytest.raises(ValueError, match="runs before its forward|deadlocks"):
        check_schedule(bad, 2)
    # Rank 1 consumes activations in another order than rank 0 sends them: a FIFO channel cannot do that.
    swapped = [good[0], tuple([Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0)])]
    with pytest.raises(ValueError, match="expects"):
        check_schedule(swapped, 2)
