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
