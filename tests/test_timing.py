"""The timed schedule simulator against closed forms: makespans of GPipe / 1F1B / interleaved with uniform costs,
latency on the critical path, and in-flight activation memory (GPipe holds m micro-batches, 1F1B at most pp)."""

from __future__ import annotations

import pytest

from lightning_3d.pipeline.schedules import Action, build_forward_only, build_schedule
from lightning_3d.pipeline.timing import simulate


def _orders(name: str, pp: int, m: int, v: int = 1):
    return [build_schedule(name, pp, v, m, r) for r in range(pp)]


def _cost(f: float, b: float):
    return lambda a: f if a.kind == "F" else b


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 1), (2, 2), (2, 5), (4, 4), (4, 8), (3, 7)])
def test_uniform_makespan_is_the_textbook_bubble(name: str, pp: int, m: int) -> None:
    f, b = 1.0, 2.0
    t = simulate(_orders(name, pp, m), pp, _cost(f, b))
    assert t.makespan == pytest.approx((m + pp - 1) * (f + b))
    assert t.bubble_fraction() == pytest.approx((pp - 1) / (m + pp - 1))
    assert all(busy == pytest.approx(m * (f + b)) for busy in t.rank_busy)


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (2, 6, 3)])
def test_interleaving_divides_the_bubble_by_the_virtual_stages(pp: int, m: int, v: int) -> None:
    # Each of the v chunks of a rank costs 1/v of the rank's layers: the bubble shrinks to (pp - 1)/v chunk pairs.
    f, b = 1.0 / v, 2.0 / v
    t = simulate(_orders("interleaved_1f1b", pp, m, v), pp * v, _cost(f, b))
    assert t.makespan == pytest.approx(m * 3.0 + (pp - 1) * 3.0 / v)


def test_latency_lands_on_the_critical_path_once_per_boundary_crossing() -> None:
    pp, m, lat = 2, 1, 0.5
    t = simulate(_orders("1f1b", pp, m), pp, _cost(1.0, 2.0), latency=lat)
    assert t.makespan == pytest.approx(pp * 3.0 + 2 * (pp - 1) * lat)  # one activation and one gradient hop


def test_in_flight_memory_gpipe_holds_every_microbatch_1f1b_at_most_pp() -> None:
    pp, m = 4, 8
    keep = lambda a: 10.0  # noqa: E731
    gpipe = simulate(_orders("gpipe", pp, m), pp, _cost(1, 2), stored=keep, transient=lambda a: 1.0)
    one_f_one_b = simulate(_orders("1f1b", pp, m), pp, _cost(1, 2), stored=keep, transient=lambda a: 1.0)
    assert gpipe.peak_memory == (m * 10.0 + 1.0,) * pp
    assert one_f_one_b.peak_memory == tuple((pp - r) * 10.0 + 1.0 for r in range(pp))


def test_forward_only_keeps_nothing_and_unequal_costs_follow_the_slowest_stage() -> None:
    pp, m = 2, 3
    orders = [build_forward_only(pp, 1, m, r) for r in range(pp)]
    t = simulate(orders, pp, lambda a: 1.0 if a.stage == 0 else 3.0, stored=lambda a: 5.0)
    assert t.peak_memory == (5.0, 5.0)
    assert t.makespan == pytest.approx(1.0 + 3 * 3.0)  # stage 1 is the bottleneck after the first hand-off


def test_an_invalid_order_raises_the_simulator_message() -> None:
    bad = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("B", 1, 0), Action("F", 1, 0)]]
    with pytest.raises(ValueError, match="runs before its forward"):
        simulate(bad, 2, _cost(1, 1))


def test_host_issues_the_next_action_while_the_device_runs_this_one() -> None:
    # One rank, F0 B0 F1 B1: forwards host-bound (device 1, host 3), backwards device-bound (device 3, host 1). The
    # host issues F1 (4..7) while the device runs B0 (3..6): 10, where max(device, host) per action gives 12.
    order = [build_schedule("1f1b", 1, 1, 2, 0)]
    dev = lambda a: 1.0 if a.kind == "F" else 3.0  # noqa: E731
    host = lambda a: 3.0 if a.kind == "F" else 1.0  # noqa: E731
    assert simulate(order, 1, dev, host=host).makespan == 10.0
    assert simulate(order, 1, lambda a: max(dev(a), host(a))).makespan == 12.0
    assert simulate(order, 1, dev, host=host).rank_busy == (8.0,)  # the device's sum
    # A host of no cost leaves the timeline as it was.
    assert simulate(order, 1, dev, host=lambda a: 0.0).end == simulate(order, 1, dev).end


def test_host_runs_at_most_one_action_ahead() -> None:
    # GPipe on one rank, F0 F1 B0 B1. F0 keeps the device busy (10) while its host is done at 1: the host issues F1
    # (1..2) but not B0 before the device starts F1 (10), so B0's slow issue (host 5) ends at 15, B1 at 16. A host
    # running arbitrarily far ahead would end at 13; waiting for the device at every action, at 17.
    order = [build_schedule("gpipe", 1, 1, 2, 0)]
    dev = {("F", 0): 10.0, ("F", 1): 1.0, ("B", 0): 1.0, ("B", 1): 1.0}
    host = {("F", 0): 1.0, ("F", 1): 1.0, ("B", 0): 5.0, ("B", 1): 1.0}
    t = simulate(order, 1, lambda a: dev[a.kind, a.microbatch], host=lambda a: host[a.kind, a.microbatch])
    assert t.end == {("F", 0, 0): 10.0, ("F", 0, 1): 11.0, ("B", 0, 0): 15.0, ("B", 0, 1): 16.0}
    assert simulate(order, 1, lambda a: max(dev[a.kind, a.microbatch], host[a.kind, a.microbatch])).makespan == 17.0


@pytest.mark.parametrize("name,pp,v,m", [("gpipe", 3, 1, 5), ("1f1b", 4, 1, 8), ("interleaved_1f1b", 2, 2, 4)])
def test_host_ahead_never_slower_than_max_per_action_nor_faster_than_either_alone(name, pp, v, m) -> None:
    # Between two bounds: each action taking max(device, host) (the host waiting for the device at every action),
    # and the device alone or the host alone (a rank cannot finish before it has issued everything).
    import random

    rng = random.Random(pp * 100 + m)
    stages = pp * v
    dev = {(k, s): rng.uniform(0.5, 3.0) for k in "FB" for s in range(stages)}
    host = {(k, s): rng.uniform(0.5, 3.0) for k in "FB" for s in range(stages)}
    orders = [build_schedule(name, pp, v, m, r) for r in range(pp)]
    ahead = simulate(orders, stages, lambda a: dev[a.kind, a.stage], host=lambda a: host[a.kind, a.stage], latency=0.2)
    both = simulate(orders, stages, lambda a: max(dev[a.kind, a.stage], host[a.kind, a.stage]), latency=0.2)
    alone = simulate(orders, stages, lambda a: dev[a.kind, a.stage], latency=0.2)
    assert alone.makespan <= ahead.makespan <= both.makespan
    for r, order in enumerate(orders):
        assert ahead.rank_end[r] >= sum(host[a.kind, a.stage] for a in order) - 1e-12


def _zero_bubble_cost(orders, f: float, b: float, w: float):
    """B costs b where split (its W costs w), else b + w: the whole backward."""
    from lightning_3d.pipeline.schedules import deferred_weights

    split = set().union(*(deferred_weights(o) for o in orders))
    return lambda a: f if a.kind == "F" else w if a.kind == "W" else b if (a.stage, a.microbatch) in split else b + w


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 4), (3, 6), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_1f1b_first_rank_memory(pp: int, m: int) -> None:
    # Qi et al.: ZB-H1's idle time per rank is (pp - 1)(T_F + T_B - T_W), 1F1B's (pp - 1)(T_F + T_B + T_W).
    zb = _orders("zb_h1", pp, m)
    keep = lambda a: 10.0  # noqa: E731
    t_zb = simulate(zb, pp, _zero_bubble_cost(zb, 1.0, 1.0, 1.0), stored=keep)
    t_1f1b = simulate(_orders("1f1b", pp, m), pp, _cost(1.0, 2.0), stored=keep)
    idle = lambda t: pp * t.makespan - sum(t.rank_busy)  # noqa: E731
    assert sum(t_zb.rank_busy) == sum(t_1f1b.rank_busy) == pp * m * 3.0
    assert idle(t_1f1b) == pytest.approx(pp * (pp - 1) * 3.0)
    assert idle(t_zb) == pytest.approx(pp * (pp - 1) * 1.0)
    assert idle(t_zb) <= idle(t_1f1b) / 3 + 1e-9
    # Memory: every rank holds at most what 1F1B's first rank holds (pp micro-batches; W keeps its forward's inputs).
    assert t_zb.peak_memory == (min(pp, m) * 10.0,) * pp
    assert max(t_1f1b.peak_memory) == min(pp, m) * 10.0


@pytest.mark.parametrize("pp,v,m", [(4, 2, 8), (4, 2, 16), (4, 3, 8), (2, 2, 4), (8, 2, 16)])
def test_zb_interleaved_bubble_is_a_third_of_interleaved_1f1b_within_its_memory(pp: int, v: int, m: int) -> None:
    # Per-chunk costs F = B = W = 1 (a whole backward 2); every rank computes m·v·3. Rank r's first input arrives
    # after r forwards, so the last rank starts at (pp - 1)·F. Interleaved 1F1B: after the last rank's final backward
    # the gradient of the last micro-batch still crosses pp - 1 ranks, each running a whole backward, so the makespan
    # is (pp - 1)F + m·v(F + B + W) + (pp - 1)(B + W) (57 at pp = 4, v = 2, m = 8) and each rank idles
    # (pp - 1)(F + B + W) = 9. Zero bubble: each rank of that drain runs only B and fills the wait with one of its r
    # pending W's, so the last rank is never idle after it starts and ends last: the makespan is
    # (pp - 1)F + m·v(F + B + W) (51) and each rank idles (pp - 1)F = (pp - 1)(F + B - W) = 3, a third. The counts
    # are small integers, exact in floating point.
    zb, plain = _orders("zb_interleaved", pp, m, v), _orders("interleaved_1f1b", pp, m, v)
    keep = lambda a: 10.0  # noqa: E731
    t_zb = simulate(zb, pp * v, _zero_bubble_cost(zb, 1.0, 1.0, 1.0), stored=keep)
    t_plain = simulate(plain, pp * v, _cost(1.0, 2.0), stored=keep)
    idle = lambda t: pp * t.makespan - sum(t.rank_busy)  # noqa: E731
    assert sum(t_zb.rank_busy) == sum(t_plain.rank_busy) == pp * m * v * 3.0
    assert t_plain.makespan == (pp - 1) * 1.0 + m * v * 3.0 + (pp - 1) * 2.0
    assert t_zb.makespan == (pp - 1) * 1.0 + m * v * 3.0
    assert idle(t_plain) == pp * (pp - 1) * 3.0 and idle(t_zb) == pp * (pp - 1) * 1.0
    assert idle(t_zb) * 3 == idle(t_plain)
    if (pp, v, m) == (4, 2, 8):  # the case of the issue's goal: bubble fractions 12/204 against 36/228
        assert t_zb.bubble_fraction() == pytest.approx(12 / 204) and t_plain.bubble_fraction() == pytest.approx(36 / 228)
    # Memory: rank r holds interleaved 1F1B's warm-up + 1 plus r split backwards awaiting their W, never more than
    # interleaved 1F1B's first rank (its peak); a split backward keeps its activations until its W.
    warmup = [2 * (pp - 1 - r) + (v - 1) * pp for r in range(pp)]
    assert t_zb.peak_memory == tuple(min(m * v, warmup[r] + 1 + r) * 10.0 for r in range(pp))
    assert t_plain.peak_memory == tuple(min(m * v, warmup[r] + 1) * 10.0 for r in range(pp))
    assert max(t_zb.peak_memory) == t_plain.peak_memory[0] == max(t_plain.peak_memory)


def test_a_weight_action_waits_for_its_b_and_keeps_memory_until_it_runs() -> None:
    order = [[Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1), Action("W", 0, 0),
              Action("W", 0, 1)]]
    t = simulate(order, 1, lambda a: {"F": 1.0, "B": 2.0, "W": 3.0}[a.kind], stored=lambda a: 5.0)
    assert t.end[("W", 0, 0)] == 9.0 and t.makespan == 12.0
    assert t.peak_memory == (10.0,)  # both forwards held through the B's
