"""The profiler measures again the grid points whose time falls though their work grows (planner.layers
``remeasure_outliers``): a failed timing is replaced, a persisting one kept and marked, the profile records both."""

from __future__ import annotations

import pytest
import torch

import lightning_3d.planner.layers as layers_mod
from lightning_3d.planner.layers import OUTLIER_FLOOR_S, OUTLIER_SHARE, REMEASURE_ROUNDS, profile_layers, remeasure_outliers
from lightning_3d.planner.timing import QUANTITIES, grid_get, grid_set, nested

SIZES, LENS = [1, 2, 4], [8, 16]


def _true(b: int, s: int) -> dict:
    # A layer whose seconds grow with its tokens: forward 10 us, backward 20 us per token.
    return {"forward": 1e-5 * b * s, "backward": 2e-5 * b * s, "host_forward": 1e-4, "host_backward": 1e-4,
            "stored": 10 * b * s, "peak": 20 * b * s}


def _grid_with(measure):
    axes = [SIZES, LENS]
    grid = {q: nested(axes) for q in QUANTITIES}
    calls = []

    def measure_at(idx):
        calls.append(idx)
        one = measure(SIZES[idx[0]], LENS[idx[1]], calls.count(idx))
        for q in QUANTITIES:
            grid_set(grid[q], idx, one[q])

    for i in range(len(SIZES)):
        for j in range(len(LENS)):
            measure_at((i, j))
    return grid, axes, measure_at, calls


def test_a_failed_low_timing_is_measured_again_and_replaced() -> None:
    # (4, 16) times at a third of its cost on its first measurement only (what the GPU showed), the rest are right.
    def measure(b, s, nth):
        one = _true(b, s)
        if (b, s) == (4, 16) and nth == 1:
            one = {**one, "forward": one["forward"] / 3}
        return one

    grid, axes, measure_at, calls = _grid_with(measure)
    record = remeasure_outliers(grid, axes, measure_at)
    # Its smaller neighbours along both axes, (2, 16) and (4, 8), are measured again with it, once each.
    assert sorted(calls[6:]) == [(1, 1), (2, 0), (2, 1)]
    assert grid_get(grid["forward"], (2, 1)) == pytest.approx(_true(4, 16)["forward"])
    assert [r["point"] for r in record] == [[1, 1], [2, 0], [2, 1]]
    bad = record[-1]
    assert bad["before"]["forward"] == pytest.approx(_true(4, 16)["forward"] / 3)
    assert bad["after"]["forward"] == pytest.approx(_true(4, 16)["forward"]) and not bad["persists"]


def test_a_failed_high_timing_is_found_through_its_larger_neighbour() -> None:
    # (2, 8) times at three times its cost once: (4, 8) and (2, 16) then look faster than it.
    def measure(b, s, nth):
        one = _true(b, s)
        return {**one, "backward": 3 * one["backward"]} if (b, s) == (2, 8) and nth == 1 else one

    grid, axes, measure_at, _ = _grid_with(measure)
    record = remeasure_outliers(grid, axes, measure_at)
    assert grid_get(grid["backward"], (1, 0)) == pytest.approx(_true(2, 8)["backward"])
    assert {tuple(r["point"]) for r in record} == {(1, 0), (2, 0), (1, 1)}
    assert not any(r["persists"] for r in record)


def test_an_ordering_that_persists_is_kept_and_marked_after_the_rounds() -> None:
    def measure(b, s, nth):
        one = _true(b, s)
        return {**one, "forward": one["forward"] / 3} if (b, s) == (4, 16) else one

    grid, axes, measure_at, calls = _grid_with(measure)
    record = remeasure_outliers(grid, axes, measure_at)
    assert calls.count((2, 1)) == 1 + REMEASURE_ROUNDS
    assert grid_get(grid["forward"], (2, 1)) == pytest.approx(_true(4, 16)["forward"] / 3)
    assert all(r["persists"] for r in record)


def test_noise_within_the_share_is_left_alone() -> None:
    # Just above the share of its smaller neighbour: noise the cost model's monotone fit pools, not a failed timing.
    def measure(b, s, nth):
        one = _true(b, s)
        if (b, s) == (4, 16):
            one = {**one, "forward": 1.01 * OUTLIER_SHARE * _true(4, 8)["forward"]}
        return one

    grid, axes, measure_at, calls = _grid_with(measure)
    assert remeasure_outliers(grid, axes, measure_at) == [] and len(calls) == 6


def test_a_small_layers_wander_below_the_floor_is_left_alone() -> None:
    # A launch-bound layer (tens of microseconds) that reads faster at a larger shape, by less than the floor.
    def measure(b, s, nth):
        one = {q: v / 10 for q, v in _true(b, s).items()}
        if (b, s) == (4, 16):
            one = {**one, "forward": 0.4 * one["forward"]}
        return one

    grid, axes, measure_at, calls = _grid_with(measure)
    small, big = grid_get(grid["forward"], (1, 1)), grid_get(grid["forward"], (2, 1))
    assert big < OUTLIER_SHARE * small and small - big < OUTLIER_FLOOR_S
    assert remeasure_outliers(grid, axes, measure_at) == [] and len(calls) == 6


def _profile_tiny_gpt(monkeypatch, remeasured_point) -> dict:
    """The real profiler's loop (``profile_layers``) on the tiny GPT's grid with ``time_point`` replaced: every point
    times as ``_true`` says, but the block at (2, 32) first times its backward at a quarter (flagged), then, measured
    again, ``remeasured_point`` (a timing, or None: out of memory)."""
    seen: dict = {}

    def fake_time_point(module, make_inputs, run, *, chained, **kw):
        x = make_inputs()[0]
        key = (chained, x.shape[0], x.shape[1])  # the embedding (not chained) sees the same shapes first
        seen[key] = seen.get(key, 0) + 1
        fixed = (1e-5, 1e-5) if chained else None
        if key == (True, 2, 32) and seen[key] == 1:
            return {**_true(2, 32), "backward": _true(2, 32)["backward"] / 4}, fixed
        if key == (True, 2, 32):
            return (remeasured_point, fixed if remeasured_point is not None else None)
        return _true(*key[1:]), fixed

    monkeypatch.setattr(layers_mod, "time_point", fake_time_point)
    monkeypatch.setattr(layers_mod, "_time_optimizer", lambda *a, **k: None)
    import lightning_3d.recipes  # noqa: F401  (registers the recipes)

    cfg = {"model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {"preset_name": "tiny", "seq_length": 32}},
           "data": {"init_args": {"seq_length": 32}}, "trainer": {"precision": "32-true"}}
    return profile_layers(cfg, torch.device("cpu"), microbatch_sizes=[1, 2], seq_lens=[16, 32], recompute=(False,),
                          warmup=0, repeats=1, log=lambda *a: None)


def test_the_profile_records_the_points_measured_again(monkeypatch) -> None:
    doc = _profile_tiny_gpt(monkeypatch, _true(2, 32))
    block = doc["layers"]["block"][0]
    assert block["backward"][1][1] == pytest.approx(_true(2, 32)["backward"])
    assert [r["point"] for r in block["remeasured"]] == [[0, 1], [1, 0], [1, 1]]
    assert "remeasured" not in doc["layers"]["head"][0]
    # The record does not disturb reading the profile: the cost model prices the point as measured the second time.
    from lightning_3d.costs import ProfiledCostModel

    cm = ProfiledCostModel(doc, sustained_clock=False)
    assert cm.layer_time("block", 2, 32)[1] == pytest.approx(_true(2, 32)["backward"])


def test_a_remeasurement_out_of_memory_keeps_the_first_timing(monkeypatch) -> None:
    # Measured again, (2, 32) runs out of memory (another point's memory left behind): the grid keeps a time there
    # rather than a hole that would price every larger micro-batch as infinite.
    block = _profile_tiny_gpt(monkeypatch, None)["layers"]["block"][0]
    assert block["backward"][1][1] == pytest.approx(_true(2, 32)["backward"] / 4)
    assert block["forward"][1][1] == pytest.approx(_true(2, 32)["forward"])
    assert [r["persists"] for r in block["remeasured"] if r["point"] == [1, 1]] == [True]
