"""Schedules are pure functions: check every (schedule, pp, v, M) against the FIFO-channel simulator."""

import pytest

from lightning_3d.pipeline import schedules
from lightning_3d.pipeline.schedule_options import resolve_schedule_options
from lightning_3d.pipeline.schedules import Action, ScheduleSpec, build_forward_only, build_schedule, check_schedule, register_schedule

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zb_h1", 1),
         ("zb_interleaved", 2), ("zb_interleaved", 3)]
INTERLEAVED = ("interleaved_1f1b", "zb_interleaved")


@pytest.mark.parametrize("name,virtual", CASES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_every_schedule_runs_to_completion(name: str, virtual: int, pp: int) -> None:
    if name in INTERLEAVED and pp == 1:
        pytest.skip("interleaving needs two pipeline ranks")
    accepted = 0
    for m in range(1, 2 * pp * virtual + 1):
        if name in INTERLEAVED and m % pp:
            # Megatron's interleaved warm-up needs whole groups of pp micro-batches: a clear error, not a bad schedule.
            with pytest.raises(ValueError, match=rf"num_microbatches \({m}\) to be a multiple of pipeline_parallel_size \({pp}\)"):
                build_schedule(name, pp, virtual, m, 0)
            continue
        # The simulator checks every F and B of every (stage, micro-batch) runs exactly once, on its own rank,
        # in an order that neither deadlocks nor misorders a channel.
        check_schedule([build_schedule(name, pp, virtual, m, r) for r in range(pp)], pp * virtual, m, train=True)
        accepted += 1
    assert accepted == (2 * virtual if name in INTERLEAVED else 2 * pp * virtual)


@pytest.mark.parametrize("virtual", [1, 2, 3])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_forward_only_runs_every_microbatch_count(virtual: int, pp: int) -> None:
    # Evaluation splits a last, smaller batch into any count of micro-batches, so every m >= 1 must work.
    for m in range(1, 2 * pp * virtual + 1):
        orders = [build_forward_only(pp, virtual, m, r) for r in range(pp)]
        check_schedule(orders, pp * virtual, m, train=False)
        # Each rank still starts with its first group of up to pp micro-batches through its first chunk
        # (Megatron's forward order), and the last micro-batch ends on its last chunk.
        for r, order in enumerate(orders):
            first = min(pp, m)
            assert [(a.stage, a.microbatch) for a in order[:first]] == [(r, i) for i in range(first)]
            assert (order[-1].stage, order[-1].microbatch) == (r + (virtual - 1) * pp, m - 1)


def test_forward_only_with_a_partial_group_regression() -> None:
    # pp=2, v=2, M=3: the old slot mapping ran micro-batch 3 (which does not exist) on stage 0 and never ran
    # micro-batch 2 on stage 2. The last group holds the one remaining micro-batch.
    orders = [build_forward_only(2, 2, 3, r) for r in range(2)]
    assert [repr(a) for a in orders[0]] == ["F0,0", "F0,1", "F2,0", "F2,1", "F0,2", "F2,2"]
    assert [repr(a) for a in orders[1]] == ["F1,0", "F1,1", "F3,0", "F3,1", "F1,2", "F3,2"]
    check_schedule(orders, 4, 3, train=False)
    # What the old code built: the simulator rejects it with a message naming the bad action.
    old = [
        tuple(Action("F", r + c * 2, mb) for c, mb in [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]) for r in range(2)
    ]
    with pytest.raises(ValueError, match=r"rank 0: F0,3 is out of range: 4 stages and 3 micro-batches"):
        check_schedule(old, 4, 3, train=False)


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
    with pytest.raises(ValueError, match="Unknown schedule 'zb'; choose one of 'gpipe', '1f1b', 'interleaved_1f1b'"):
        build_schedule("zb", 2, 1, 4, 0)
    with pytest.raises(ValueError, match=r"num_microbatches \(5\) to be a multiple of pipeline_parallel_size \(2\)"):
        build_schedule("interleaved_1f1b", 2, 2, 5, 0)
    with pytest.raises(ValueError, match="virtual_stages=2 only applies to interleaved schedules, not '1f1b'"):
        build_schedule("1f1b", 2, 2, 4, 0)


def test_simulator_rejects_a_deadlocking_order() -> None:
    good = [build_schedule("1f1b", 2, 1, 2, r) for r in range(2)]
    check_schedule(good, 2, 2, train=True)
    # Rank 0 waits for the gradient of micro-batch 1 before sending its activation: a deadlock.
    bad = [tuple([Action("F", 0, 0), Action("B", 0, 1), Action("F", 0, 1), Action("B", 0, 0)]), good[1]]
    with pytest.raises(ValueError, match="runs before its forward|deadlocks"):
        check_schedule(bad, 2, 2, train=True)
    # Rank 1 consumes activations in another order than rank 0 sends them: a FIFO channel cannot do that.
    swapped = [good[0], tuple([Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0)])]
    with pytest.raises(ValueError, match="expects"):
        check_schedule(swapped, 2, 2, train=True)


def test_simulator_rejects_missing_repeated_and_misplaced_actions() -> None:
    good = [build_schedule("1f1b", 2, 1, 3, r) for r in range(2)]
    check_schedule(good, 2, 3, train=True)
    dropped = [good[0], tuple(a for a in good[1] if repr(a) != "B1,2*")]
    with pytest.raises(ValueError, match=r"schedule never runs B1,2"):
        check_schedule(dropped, 2, 3, train=True)
    # A whole micro-batch missing everywhere: nothing deadlocks, only the content check sees it.
    with pytest.raises(ValueError, match=r"schedule never runs F0,2, F1,2, B0,2, B1,2"):
        check_schedule([build_schedule("1f1b", 2, 1, 2, r) for r in range(2)], 2, 3, train=True)
    repeated = [good[0] + (Action("F", 0, 1),), good[1]]
    with pytest.raises(ValueError, match=r"schedule runs F0,1 more than once"):
        check_schedule(repeated, 2, 3, train=True)
    with pytest.raises(ValueError, match=r"rank 1: F2,0 is out of range: 2 stages and 3 micro-batches"):
        check_schedule([good[0], good[1] + (Action("F", 2, 0),)], 2, 3, train=True)
    with pytest.raises(ValueError, match=r"rank 0: F1,0 runs stage 1, which lives on rank 1"):
        check_schedule([good[0] + (Action("F", 1, 0),), good[1]], 2, 3, train=True)
    with pytest.raises(ValueError, match=r"rank 0: B0,0 is not an action of a forward-only schedule"):
        check_schedule([(Action("F", 0, 0), Action("B", 0, 0)), (Action("F", 1, 0),)], 2, 1, train=False)
    with pytest.raises(ValueError, match=r"schedule never runs B0,0, B1,0"):
        check_schedule([build_forward_only(2, 1, 1, r) for r in range(2)], 2, 1, train=True)


def _all_forwards_then_backwards_reversed(rank: int, pp: int, virtual_stages: int, m: int) -> list[Action]:
    # Test-only schedule: the forward-only order, then every backward in exactly the reverse order. Every rank
    # reverses the same sequence, so each gradient channel delivers in the order it is consumed, for every m.
    forwards = list(build_forward_only(pp, virtual_stages, m, rank))
    return forwards + [Action("B", a.stage, a.microbatch) for a in reversed(forwards)]


@pytest.fixture
def registry():
    saved = dict(schedules.SCHEDULES)
    yield schedules.SCHEDULES
    schedules.SCHEDULES.clear()
    schedules.SCHEDULES.update(saved)
    build_schedule.cache_clear()


def test_a_registered_schedule_is_built_checked_and_accepted_by_name(registry) -> None:
    register_schedule(ScheduleSpec("test_reverse_gpipe", _all_forwards_then_backwards_reversed, title="reverse GPipe"))
    register_schedule(ScheduleSpec("test_reverse_looped", _all_forwards_then_backwards_reversed, interleaved=True))
    assert list(registry)[-2:] == ["test_reverse_gpipe", "test_reverse_looped"]
    for pp in range(1, 5):
        for m in range(1, 2 * pp + 1):
            order = [build_schedule("test_reverse_gpipe", pp, 1, m, r) for r in range(pp)]
            check_schedule(order, pp, m, train=True)
            assert [repr(a) for a in order[0]][m:] == [f"B0,{i}*" for i in reversed(range(m))]
    for pp in range(2, 5):
        for v in (2, 3):
            for m in range(1, 2 * pp * v + 1):  # no multiple-of-pp rule registered, so every count
                check_schedule([build_schedule("test_reverse_looped", pp, v, m, r) for r in range(pp)], pp * v, m, train=True)
    # The strategy's validation takes the registered names and constraints: an interleaved schedule defaults to
    # two virtual stages, and without microbatch_multiple_of_pp it accepts 3 micro-batches on 2 ranks.
    assert resolve_schedule_options("test_reverse_gpipe", 4, None, 1) == 1
    assert resolve_schedule_options("test_reverse_looped", 2, None, 3) == 2
    with pytest.raises(ValueError, match="needs pipeline_parallel_size >= 2 and virtual_stages >= 2"):
        resolve_schedule_options("test_reverse_looped", 1, None, 3)
    with pytest.raises(ValueError, match="virtual_stages=2 only applies to interleaved schedules, not 'test_reverse_gpipe'"):
        resolve_schedule_options("test_reverse_gpipe", 2, 2, 4)
    names = "'gpipe', '1f1b', 'interleaved_1f1b', 'zb_h1', 'zb_interleaved', 'test_reverse_gpipe', 'test_reverse_looped'"
    with pytest.raises(ValueError, match=f"Unknown schedule 'zb'; choose one of {names}"):
        resolve_schedule_options("zb", 2, None, 4)


def test_the_registry_holds_the_builtin_constraints() -> None:
    assert list(schedules.SCHEDULES) == ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_interleaved"]
    assert [n for n, spec in schedules.SCHEDULES.items() if spec.splits_backward] == ["zb_h1", "zb_interleaved"]
    assert resolve_schedule_options("interleaved_1f1b", 4, None, 8) == 2
    assert resolve_schedule_options("gpipe", 4, None, 1) == 1
    with pytest.raises(ValueError, match=r"1F1B schedule with num_microbatches=3 < 4 at pipeline_parallel_size=4"):
        resolve_schedule_options("1f1b", 4, None, 3)
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) to be a multiple of pipeline_parallel_size \(4\)"):
        resolve_schedule_options("interleaved_1f1b", 4, 3, 6)


def test_runtime_checks_an_explicit_per_step_order_before_running_it():
    """``MicroBatches(orders=...)`` / ``train_step(orders=...)`` replace the named schedule for one step; the
    runtime marks the epilogue itself and rejects a list per rank that is missing, incomplete or deadlocks."""
    import torch

    from lightning_3d.pipeline.runtime import PipelineRuntime

    runtime = PipelineRuntime({}, num_stages=2, pp_rank=0, pp_size=2, schedule="1f1b", channels=None,
                              device=torch.device("cpu"), loss_fn=None, loss_terms_fn=None)
    F, B = (lambda s, m: Action("F", s, m)), (lambda s, m: Action("B", s, m))
    good = [[F(0, 1), F(0, 0), B(0, 1), B(0, 0)], [F(1, 1), F(1, 0), B(1, 1), B(1, 0)]]
    orders = runtime._orders(2, train=True, given=good)
    assert [a.epilogue for a in orders[0]] == [False, False, True, True]
    with pytest.raises(ValueError, match="one action list per pipeline rank: got 1"):
        runtime._orders(2, train=True, given=good[:1])
    with pytest.raises(ValueError, match="never runs"):
        runtime._orders(2, train=True, given=[good[0][:3], good[1][:3]])
    swapped = [[F(0, 0), F(0, 1), B(0, 1), B(0, 0)], [F(1, 1), F(1, 0), B(1, 1), B(1, 0)]]  # F(1,1) waits for mb 0
    with pytest.raises(ValueError, match="expects"):
        runtime._orders(2, train=True, given=swapped)


def test_the_example_schedule_is_one_file_plus_a_registry_line(registry) -> None:
    """tests/schedule_example.py, registered with one line, is accepted by name and passes the simulator for every
    pipeline size and micro-batch count (docs/extending.md points here)."""
    from lightning_3d import Compressed3DStrategy
    from tests.schedule_example import REVERSE_GPIPE

    with pytest.raises(ValueError, match="Unknown schedule 'reverse_gpipe'"):
        Compressed3DStrategy(pipeline_parallel_size=2, schedule="reverse_gpipe")
    register_schedule(REVERSE_GPIPE)
    for pp in range(1, 6):
        for m in range(1, 3 * pp + 1):
            orders = [build_schedule("reverse_gpipe", pp, 1, m, r) for r in range(pp)]
            check_schedule(orders, pp, m, train=True)
            assert [repr(a) for a in orders[-1]] == [f"F{pp - 1},{i}" for i in range(m)] + [
                f"B{pp - 1},{i}*" for i in reversed(range(m))]
    strategy = Compressed3DStrategy(pipeline_parallel_size=2, schedule="reverse_gpipe")
    assert (strategy.schedule, strategy.num_microbatches, strategy.virtual_stages) == ("reverse_gpipe", 2, 1)


def test_zb_h1_orders_per_rank() -> None:
    """ZB-H1 (zero_bubble.py): 1F1B's forwards and backwards in 1F1B's order, each backward of a rank r > 0 split,
    its W deferred by r micro-batches in the steady state, one W after each drain B, the rest at the end; rank 0
    keeps whole backwards."""
    got = {r: " ".join(map(repr, build_schedule("zb_h1", 4, 1, 8, r))) for r in range(4)}
    assert got[0] == ("F0,0 F0,1 F0,2 F0,3 B0,0 F0,4 B0,1 F0,5 B0,2 F0,6 B0,3 F0,7 B0,4* B0,5* B0,6* B0,7*")
    assert got[1] == ("F1,0 F1,1 F1,2 B1,0 F1,3 B1,1 W1,0 F1,4 B1,2 W1,1 F1,5 B1,3 W1,2 F1,6 B1,4 W1,3 F1,7 B1,5*"
                      " W1,4 B1,6* W1,5 B1,7* W1,6 W1,7")
    assert got[2] == ("F2,0 F2,1 B2,0 F2,2 B2,1 F2,3 B2,2 W2,0 F2,4 B2,3 W2,1 F2,5 B2,4 W2,2 F2,6 B2,5 W2,3 F2,7 B2,6*"
                      " W2,4 B2,7* W2,5 W2,6 W2,7")
    assert got[3] == ("F3,0 B3,0 F3,1 B3,1 F3,2 B3,2 F3,3 B3,3 W3,0 F3,4 B3,4 W3,1 F3,5 B3,5 W3,2 F3,6 B3,6 W3,3 F3,7"
                      " B3,7* W3,4 W3,5 W3,6 W3,7")
    for pp in (2, 3, 4):
        for m in range(1, 2 * pp + 1):
            for r in range(pp):
                order = build_schedule("zb_h1", pp, 1, m, r)
                one_f_one_b = build_schedule("1f1b", pp, 1, m, r)
                assert [a for a in order if a.kind != "W"] == list(one_f_one_b)  # same F/B order and epilogue
                assert schedules.deferred_weights(order) == (frozenset() if r == 0 else {(r, i) for i in range(m)})
                # at most pp micro-batches hold activations (forwards not yet through their W, or B if whole)
                held = peak = 0
                split = schedules.deferred_weights(order)
                for a in order:
                    held += 1 if a.kind == "F" else -1 if a.kind == "W" or (a.stage, a.microbatch) not in split else 0
                    peak = max(peak, held)
                assert peak == min(pp, m)  # 1F1B's first rank: ZB-H1's memory rule


def _held_peak(order) -> int:
    """The most (stage, micro-batch) activations a rank holds at once: from F until B, or until W where split."""
    held = peak = 0
    split = schedules.deferred_weights(order)
    for a in order:
        held += 1 if a.kind == "F" else -1 if a.kind == "W" or (a.stage, a.microbatch) not in split else 0
        peak = max(peak, held)
    return peak


def test_zb_interleaved_orders_per_rank() -> None:
    """Interleaved zero bubble (zero_bubble.py): interleaved 1F1B's forwards and backwards in its order, every backward
    of a stage > 0 split (stage 0's input gradient goes nowhere), rank r keeping r W's pending in the steady state,
    one W after each drain B, the rest at the end."""
    got = [" ".join(map(repr, build_schedule("zb_interleaved", 2, 2, 4, r))) for r in range(2)]
    assert got[0] == ("F0,0 F0,1 F2,0 F2,1 F0,2 B2,0 W2,0 F0,3 B2,1 W2,1 F2,2 B0,0 F2,3 B0,1* B2,2* W2,2 B2,3* W2,3"
                      " B0,2* B0,3*")
    assert got[1] == ("F1,0 F1,1 F3,0 B3,0 F3,1 B3,1 W3,0 F1,2 B1,0 W3,1 F1,3 B1,1 W1,0 F3,2 B3,2 W1,1 F3,3 B3,3* W3,2"
                      " B1,2* W3,3 B1,3* W1,2 W1,3")
    for pp in (2, 3, 4):
        for v in (2, 3):
            for m in range(pp, 3 * pp + 1, pp):
                orders = [build_schedule("zb_interleaved", pp, v, m, r) for r in range(pp)]
                plain = [build_schedule("interleaved_1f1b", pp, v, m, r) for r in range(pp)]
                check_schedule(orders, pp * v, m, train=True)
                for r in range(pp):
                    assert [a for a in orders[r] if a.kind != "W"] == list(plain[r])  # same F/B order and epilogue
                    stages = range(r, pp * v, pp)
                    assert schedules.deferred_weights(orders[r]) == {(s, i) for s in stages if s > 0 for i in range(m)}
                    # memory: interleaved 1F1B's warm-up + 1 plus the r pending W's (docstring of zero_bubble.py) ...
                    warmup = schedules.interleaved_warmup(r, pp, v, m)
                    assert _held_peak(orders[r]) == min(m * v, warmup + 1 + r)
                # ... never above interleaved 1F1B's peak, its first rank's
                assert max(map(_held_peak, orders)) == max(map(_held_peak, plain)) == _held_peak(plain[0])


def test_zb_interleaved_rejects_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"interleaved zero-bubble schedule needs pipeline_parallel_size >= 2 and"
                                         r" virtual_stages >= 2 \(got 4 and 1\); use schedule='zb_h1' otherwise"):
        resolve_schedule_options("zb_interleaved", 4, 1, 8)
    with pytest.raises(ValueError, match=r"\(got 1 and 2\); use schedule='zb_h1' otherwise"):
        resolve_schedule_options("zb_interleaved", 1, None, 8)
    with pytest.raises(ValueError, match=r"\(got 4 and 1\); use schedule='zb_h1'"):  # at every build, too
        build_schedule("zb_interleaved", 4, 1, 8, 0)
    with pytest.raises(ValueError, match=r"interleaved zero-bubble schedule needs num_microbatches \(6\) to be a multiple"
                                         r" of pipeline_parallel_size \(4\); give a multiple of 4"):
        resolve_schedule_options("zb_interleaved", 4, 2, 6)
    assert resolve_schedule_options("zb_interleaved", 4, None, 8) == 2  # two chunks per rank by default
    # the strategy checks at construction, before any process group exists
    from lightning_3d import Compressed3DStrategy, ParallelismConfig, PipelineConfig

    with pytest.raises(ValueError, match=r"\(got 4 and 1\); use schedule='zb_h1' otherwise"):
        Compressed3DStrategy(parallelism=ParallelismConfig(pipeline_parallel_size=4),
                             pipeline=PipelineConfig(schedule="zb_interleaved", virtual_stages=1, num_microbatches=8))
    strategy = Compressed3DStrategy(parallelism=ParallelismConfig(pipeline_parallel_size=4),
                                    pipeline=PipelineConfig(schedule="zb_interleaved", num_microbatches=8))
    assert (strategy.schedule, strategy.virtual_stages, strategy.num_microbatches) == ("zb_interleaved", 2, 8)
    # interleaved 1F1B keeps its own fix in the message
    with pytest.raises(ValueError, match=r"\(got 4 and 1\); use schedule='1f1b' otherwise"):
        resolve_schedule_options("interleaved_1f1b", 4, 1, 8)


def test_simulator_checks_weight_actions() -> None:
    f, b, w = Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0)
    check_schedule([(f, b, w)], 1, 1, train=True)
    check_schedule([(f, b)], 1, 1, train=True)  # W is optional: B is then the whole backward
    with pytest.raises(ValueError, match=r"rank 0: W0,0 runs before its input-gradient backward B"):
        check_schedule([(f, w, b)], 1, 1, train=True)
    with pytest.raises(ValueError, match=r"schedule runs W0,0 more than once"):
        check_schedule([(f, b, w, w)], 1, 1, train=True)
    with pytest.raises(ValueError, match=r"W0,0 is not an action of a forward-only schedule"):
        check_schedule([(f, w)], 1, 1, train=False)
    # W sends nothing: the previous stage's B still receives exactly one gradient per micro-batch.
    orders = [(Action("F", 0, 0), Action("B", 0, 0)), (Action("F", 1, 0), Action("B", 1, 0), Action("W", 1, 0))]
    check_schedule(orders, 2, 1, train=True)
