"""Dynamic micro-batching's host floor (docs/dynamic.md, "The host floor"): a stage's pass over a micro-batch costs
max(its layers' device seconds, their host seconds) plus the measured per-micro-batch overhead, the planner's rule
(lightning_3d/costs/host.py). On a synthetic profile whose host times dominate small micro-batches: the stage
costs follow the rule exactly, the partition is the brute-force optimum under them and holds fewer, larger
micro-batches than under the device times alone, the plan's simulated schedule uses the same costs, and the planner
prices a micro-batch the same way. Version-1 profiles and the analytic model keep the device's sums exactly."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lightning_3d.costs import AnalyticCostModel, ClusterSpec, DeviceSpec, ModelShape, ProfiledCostModel, device_spec, new_profile
from lightning_3d.dynamic import plan_step
from lightning_3d.dynamic.partition import best_partition, objective, range_shapes, round_up, sample_order
from lightning_3d.dynamic.stage_costs import evaluate, stage_layers
from lightning_3d.pipeline.timing import simulate
from lightning_3d.planner.model import Candidate, Workload, stage_costs
from tests.test_dynamic import brute_force

SHAPE = ModelShape("gpt", num_layers=4, hidden_size=48, num_heads=4, ffn_hidden_size=192, vocab_size=300)
SIZES, LENGTHS = [1, 2, 4, 8, 16], [16, 32, 64, 128, 256]
HOST_F, HOST_B, OVERHEAD = 1e-4, 1.5e-4, 4e-4  # per block in situ; per micro-batch


def _doc(version: int) -> dict:
    """A profile of SHAPE whose device seconds grow with the tokens (attention: with the length too): a micro-batch
    of one short sample takes less device time per block than the host's HOST_F / HOST_B to issue it, a large one
    far more. Version 2 adds the in-situ host times of a block and the per-micro-batch overhead."""
    doc = new_profile(SHAPE, DeviceSpec("synthetic", 1e15, 1e12, 80 * 2**30))
    b, s = np.meshgrid(np.array(SIZES, dtype=float), np.array(LENGTHS, dtype=float), indexing="ij")
    for kind, scale in (("embedding", 0.3), ("block", 1.0), ("head", 3.0)):
        fwd = scale * 1e-6 * b * s * (1 + s / 256)
        doc["layers"][kind] = [{
            "tp": 1, "recompute": False, "microbatch_size": SIZES, "seq_len": LENGTHS, "forward": fwd.tolist(),
            "backward": (2 * fwd).tolist(), "stored": (1000 * b * s).tolist(), "peak": (2000 * b * s).tolist()}]
    doc["version"] = version
    if version >= 2:
        doc["overheads"] = {"microbatch_seconds": OVERHEAD, "step_seconds": 0.0, "host_layers": {"block": {
            "forward": HOST_F, "backward": HOST_B, "recompute_forward": HOST_F, "recompute_backward": 2 * HOST_B}}}
    return doc


def _model(version: int) -> ProfiledCostModel:
    return ProfiledCostModel(_doc(version))


class _DeviceOnly:
    """A cost model that answers only the device's questions (no host times, no overheads): what dynamic's cost
    path priced before the host floor."""

    def __init__(self, inner) -> None:
        self.inner, self.source = inner, inner.source

    def layer_time(self, *a, **kw):
        return self.inner.layer_time(*a, **kw)

    def layer_memory(self, *a, **kw):
        return self.inner.layer_memory(*a, **kw)


def _time_matrix(cost_model, lengths: np.ndarray, pp: int) -> np.ndarray:
    """The (start, stop) per-device time matrix of the ordered samples' ranges (unlimited memory), built from
    ``evaluate`` as the planner builds it."""
    order = sample_order(round_up(lengths, 8), None)
    size, seq, _ = range_shapes(round_up(lengths[order], 8), None)
    s, e = np.nonzero(size)
    c = evaluate(cost_model, stage_layers(SHAPE, pp), size[s, e], seq[s, e], None, recompute=False, tp=1)
    time = np.full(size.shape, np.inf)
    time[s, e] = (c.forward + c.backward).max(axis=0)
    return time


def test_a_stage_costs_the_larger_of_its_device_and_host_sums_plus_the_overhead() -> None:
    cm = _model(2)
    sizes, lengths = np.array([1, 1, 16, 4]), np.array([16, 64, 256, 128])
    for pp in (1, 2):
        stages = stage_layers(SHAPE, pp)
        c = evaluate(cm, stages, sizes, lengths, None, recompute=False, tp=1)
        for st, layers in enumerate(stages):
            dev = [sum(np.asarray(cm.layer_time(k, sizes, lengths)[i]) for k in layers) for i in (0, 1)]
            host = [sum(np.asarray(cm.layer_host_time(k, sizes, lengths)[i]) for k in layers) for i in (0, 1)]
            blocks = layers.count("block")
            assert np.array_equal(host[0], np.full(4, blocks * HOST_F))
            assert np.array_equal(host[1], np.full(4, blocks * HOST_B))
            assert np.allclose(c.forward[st], np.maximum(dev[0], host[0]) + OVERHEAD / 2, rtol=1e-12, atol=0)
            assert np.allclose(c.backward[st], np.maximum(dev[1], host[1]) + OVERHEAD / 2, rtol=1e-12, atol=0)
            # both sides of the max are reached: one 16-token sample is host-bound, 16 x 256 tokens is not
            assert host[0][0] > dev[0][0] and host[0][2] < dev[0][2]


def test_version_1_profiles_and_the_analytic_model_keep_the_device_sums_exactly() -> None:
    sizes, lengths = np.array([1, 3, 16, 4]), np.array([16, 64, 256, 120])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analytic = AnalyticCostModel(SHAPE, None)
    v1 = _model(1)
    assert v1.microbatch_overhead_seconds == 0.0
    for cm in (v1, analytic):
        stages = stage_layers(SHAPE, 2)
        new = evaluate(cm, stages, sizes, lengths, None, recompute=False, tp=1)
        old = evaluate(_DeviceOnly(cm), stages, sizes, lengths, None, recompute=False, tp=1)
        for a, b in zip((new.forward, new.backward, new.stored, new.transient),
                        (old.forward, old.backward, old.stored, old.transient)):
            assert np.array_equal(a, b)
        # and the device's sums themselves, layer by layer
        for st, layers in enumerate(stages):
            total = sum(np.asarray(cm.layer_time(k, sizes, lengths)[0], dtype=float) for k in layers)
            assert np.allclose(new.forward[st], total, rtol=1e-12, atol=0)
    # whole plans: identical to the device-only path (micro-batches, schedules, predicted times)
    lengths = np.random.default_rng(3).integers(16, 257, 40)
    for layout in (dict(dp=1, pp=1), dict(dp=2, pp=2)):
        new = plan_step(lengths, cost_model=v1, shape=SHAPE, memory_budget=1e9, max_seq_len=256, **layout)
        old = plan_step(lengths, cost_model=_DeviceOnly(v1), shape=SHAPE, memory_budget=1e9, max_seq_len=256, **layout)
        assert new == old


@pytest.mark.parametrize("seed, pp", [(0, 1), (1, 1), (2, 2), (3, 2), (4, 4)])
def test_the_partition_under_the_host_floor_is_the_brute_force_optimum_with_fewer_larger_microbatches(
        seed: int, pp: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(9, 257, 12)  # 12 samples: 2^11 partitions for the brute force
    host, device = _model(2), _DeviceOnly(_model(1))
    counts = {}
    for name, cm in (("host", host), ("device", device)):
        time = _time_matrix(cm, lengths, pp)
        cuts, estimate = best_partition(time, pp, 1, 1)
        assert estimate == pytest.approx(brute_force(time, pp, 1, 1), rel=1e-12)
        plan = plan_step(lengths, cost_model=cm, shape=SHAPE, dp=1, pp=pp, memory_budget=1e12, max_seq_len=256)
        assert plan.estimate == pytest.approx(estimate, rel=1e-12)
        mbs = plan.replicas[0].microbatches
        counts[name] = len(mbs)
        # the schedule simulator prices the plan's micro-batches with the same costs
        c = evaluate(cm, stage_layers(SHAPE, pp), np.array([len(m.samples) for m in mbs]),
                     np.array([m.seq_len for m in mbs]), None, recompute=False, tp=1)
        timeline = simulate(plan.replicas[0].orders, pp,
                            lambda a: (c.forward if a.kind == "F" else c.backward)[a.stage, a.microbatch])
        assert timeline.makespan == pytest.approx(plan.makespan, rel=1e-12)
    # the host floor and the overhead make a micro-batch cost at least ~(host + overhead): fewer, larger ones win
    assert counts["host"] < counts["device"], counts
    # the device-only plan is not merely another optimum: under the host floor it is strictly worse
    t_host, t_dev = _time_matrix(host, lengths, pp), _time_matrix(device, lengths, pp)
    cuts_host, _ = best_partition(t_host, pp, 1, 1)
    cuts_dev, _ = best_partition(t_dev, pp, 1, 1)
    assert objective(t_host, cuts_dev, pp, 1, 1) > objective(t_host, cuts_host, pp, 1, 1)


def test_the_planner_and_dynamic_price_a_microbatch_alike() -> None:
    cm = _model(2)
    seq = 128
    w = Workload(SHAPE, seq, 16, cm, ClusterSpec(1, 2, device_spec("h100"), 300e9, 25e9), memory_reserve=0.0)
    for pp, split in ((1, (4,)), (2, (2, 2)), (2, (1, 3))):
        stages = stage_layers(SHAPE, pp, split)
        for mbs in (1, 4, 16):
            cand = Candidate(1, pp, 1, mbs, 2, "1f1b", 1, split, (False,) * pp, False)
            fwd, bwd, *_ = stage_costs(cand, w)
            c = evaluate(cm, stages, np.array([mbs]), np.array([seq]), None, recompute=False, tp=1)
            assert fwd == pytest.approx(c.forward[:, 0].tolist(), rel=1e-12)
            assert bwd == pytest.approx(c.backward[:, 0].tolist(), rel=1e-12)

