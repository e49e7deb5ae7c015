"""The planner's performance model: schedule closed forms against the timed simulator (pipeline/timing.py),
in-flight activation counts, memory composition, the exposed data-parallel all-reduce and compression's terms."""

from __future__ import annotations

import random
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_3d.costs import ClusterSpec, ProfiledCostModel, device_spec, layer_parameters
from lightning_3d.pipeline.schedules import build_schedule
from lightning_3d.pipeline.timing import simulate
from lightning_3d.planner.model import (
    Candidate,
    Workload,
    dp_allreduce,
    in_flight,
    lower_bound_memory,
    pipeline_time,
    predict,
    send_times,
    simulate_candidate,
    stage_costs,
)

PROFILE = Path(__file__).parent / "data" / "profiles" / "gpt_synthetic.json"


def _workload(cluster: ClusterSpec | None = None, batch: int = 8) -> Workload:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = ProfiledCostModel(PROFILE, derive_tp=True)
    return Workload(cm.shape, 1024, batch, cm, cluster or ClusterSpec(1, 4, device_spec("h100"), 300e9, 25e9),
                    memory_reserve=0.0)


def _sim(name, pp, v, m, f, b, ls=None, lb=None, stored=None):
    orders = [build_schedule(name, pp, v, m, r) for r in range(pp)]
    lat = (lambda a: ls[a.stage] if a.kind == "F" else lb[a.stage - 1]) if ls else 0.0
    return simulate(orders, pp * v, lambda a: f[a.stage] if a.kind == "F" else b[a.stage], latency=lat,
                    stored=stored)


@pytest.mark.parametrize("name,pp,v,m", [("gpipe", 1, 1, 3), ("gpipe", 3, 1, 5), ("1f1b", 2, 1, 2), ("1f1b", 4, 1, 8),
                                         ("1f1b", 3, 1, 7), ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 4, 2, 8),
                                         ("interleaved_1f1b", 2, 3, 6)])
def test_closed_form_equals_the_simulator_for_uniform_stages(name, pp, v, m) -> None:
    f, b = [0.7] * (pp * v), [1.9] * (pp * v)
    assert pipeline_time(name, pp, v, m, f, b, [0.0] * (pp * v - 1), [0.0] * (pp * v - 1)) == pytest.approx(
        _sim(name, pp, v, m, f, b).makespan, rel=1e-12)


def test_closed_forms_with_sends_gpipe_exact_1f1b_an_upper_bound() -> None:
    # GPipe is a flow shop (exact for any stage times and sends); 1F1B's closed form bounds the steady state by the
    # slowest stage and by each stage's round trip over the micro-batches it may hold: never below the simulator.
    rng = random.Random(0)
    for _ in range(40):
        pp, m = rng.randint(2, 5), rng.randint(1, 8)
        f = [rng.uniform(0.5, 2) for _ in range(pp)]
        b = [x * rng.uniform(1.5, 2.5) for x in f]
        ls, lb = [rng.uniform(0, 0.3) for _ in range(pp - 1)], [rng.uniform(0, 0.3) for _ in range(pp - 1)]
        assert pipeline_time("gpipe", pp, 1, m, f, b, ls, lb) == pytest.approx(_sim("gpipe", pp, 1, m, f, b, ls, lb).makespan, rel=1e-12)
        m = max(m, pp)
        assert pipeline_time("1f1b", pp, 1, m, f, b, ls, lb) >= _sim("1f1b", pp, 1, m, f, b, ls, lb).makespan * (1 - 1e-12)
        one = pipeline_time("1f1b", pp, 1, 1, f, b, ls, lb)  # one micro-batch: the round trip exactly
        assert one == pytest.approx(_sim("1f1b", pp, 1, 1, f, b, ls, lb).makespan, rel=1e-12)


@pytest.mark.parametrize("name,pp,v", [("gpipe", 3, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 3),
                                       ("zb_h1", 4, 1), ("zb_h1", 3, 1), ("zb_interleaved", 2, 2),
                                       ("zb_interleaved", 4, 3)])
@pytest.mark.parametrize("m_per_pp", [1, 2, 3])
def test_in_flight_counts_equal_the_simulated_peaks(name, pp, v, m_per_pp) -> None:
    m = pp * m_per_pp
    t = _sim(name, pp, v, m, [1.0] * (pp * v), [2.0] * (pp * v), stored=lambda a: 1.0)
    assert t.peak_memory == tuple(float(in_flight(name, pp, v, m, r)) for r in range(pp))


def test_memory_is_weights_state_activations_in_flight_and_the_transient() -> None:
    w = _workload()
    c = Candidate(1, 2, 1, 2, 4, "1f1b", 1, (5, 3), (False, True), False)
    fwd, bwd, stored, peak, params = stage_costs(c, w)
    blocks = layer_parameters(w.shape, "block")
    assert params == [layer_parameters(w.shape, "embedding") + 5 * blocks, 3 * blocks + layer_parameters(w.shape, "head")]
    p = predict(c, w)
    assert p.stage_memory == [params[0] * 16 + 2 * stored[0] + peak[0], params[1] * 16 + 1 * stored[1] + peak[1]]
    # Checkpointing keeps the layer input only: 3 blocks' inputs plus what the head keeps.
    head_stored = w.cost_model.layer_memory("head", 2, 1024)[0]
    assert stored[1] == pytest.approx(3 * 2 * 1024 * 1024 * 2 + head_stored)
    assert simulate_candidate(c, w).stage_memory == pytest.approx(p.stage_memory)


def test_dp_allreduce_is_exposed_after_the_last_backward() -> None:
    w = _workload()
    one = Candidate(4, 1, 1, 2, 1, "1f1b", 1, (8,), (False,), False)
    p = predict(one, w)
    grads = sum(stage_costs(one, w)[4]) * 4
    buckets = max(1.0, grads / (25 * 2**20))
    assert p.exposed_dp_time == pytest.approx(2 * 3 / 4 * grads / 300e9 + buckets * w.cluster.latency, rel=1e-12)
    # With a pipeline, the last stage's all-reduce overlaps the drain of the earlier stages; the first stage's is exposed.
    piped = Candidate(2, 2, 1, 2, 2, "1f1b", 1, (4, 4), (False, False), False)
    q = predict(piped, w)
    ar = dp_allreduce(piped, w, stage_costs(piped, w)[4], [[0], [1]])
    assert q.exposed_dp_time == pytest.approx(max(ar[0], ar[1] - q.stage_backward[0] - send_times(piped, w)[1][0]), rel=1e-12)


def test_compression_shrinks_gradient_sends_and_slow_dp_links_only() -> None:
    slow = ClusterSpec(2, 2, device_spec("h100"), 300e9, 5e9)  # dp crosses nodes at 5 GB/s < sc_max_link_gbps
    w = _workload(slow)
    c = Candidate(2, 2, 1, 2, 4, "1f1b", 1, (4, 4), (False, False), False)
    on = replace(c, compression=True)
    # The pipeline (two ranks of one node) runs at NVLink's 300 GB/s, above cb_max_link_gbps: CB stays off there, as
    # the strategy decides (strategies/cb_link.py); SC runs on the dp link across nodes.
    assert send_times(on, w) == send_times(c, w)
    assert predict(on, w).exposed_dp_time < predict(c, w).exposed_dp_time  # SC on the slow dp link
    ib = _workload(ClusterSpec(2, 2, device_spec("h100"), 50e9, 5e9))  # a pipeline link below cb_max_link_gbps
    f_off, b_off = send_times(c, ib)
    f_on, b_on = send_times(on, ib)
    assert f_on == f_off and b_on[0] < b_off[0]  # CB: gradients only
    fast = _workload(ClusterSpec(1, 4, device_spec("h100"), 300e9, 25e9))
    ar_off = dp_allreduce(c, fast, [1e8, 1e8], [[0], [1]])
    ar_on = dp_allreduce(on, fast, [1e8, 1e8], [[0], [1]])
    assert ar_on == ar_off  # NVLink: SC stays off


def test_host_runahead_times_device_and_host_apart_in_the_simulator() -> None:
    # Workload(host_runahead=True): the simulator gets each stage's device seconds as durations and its host seconds
    # (the per-micro-batch overhead's halves included) as issue times; the default takes max(device, host) + overhead.
    from lightning_3d.planner.model import stage_device_host

    w = _workload()
    ahead = replace(w, host_runahead=True, _cache={})
    c = Candidate(1, 2, 1, 2, 4, "1f1b", 1, (5, 3), (False, True), False)
    df, db, hf, hb = stage_device_host(c, ahead)
    fwd, bwd = stage_costs(c, w)[:2]
    ovh = w.cost_model.microbatch_overhead_seconds
    assert fwd == pytest.approx([max(d, h - ovh / 2) + ovh / 2 for d, h in zip(df, hf)], rel=1e-12)
    assert bwd == pytest.approx([max(d, h - ovh / 2) + ovh / 2 for d, h in zip(db, hb)], rel=1e-12)
    fsend, bsend = send_times(c, w)
    orders = [build_schedule("1f1b", 2, 1, 4, r) for r in range(2)]
    t = simulate(orders, 2, lambda a: df[a.stage] if a.kind == "F" else db[a.stage],
                 latency=lambda a: fsend[a.stage] if a.kind == "F" else bsend[a.stage - 1],
                 host=lambda a: hf[a.stage] if a.kind == "F" else hb[a.stage])
    p, q = simulate_candidate(c, ahead), simulate_candidate(c, w)
    assert p.pipeline_time == pytest.approx(t.makespan, rel=1e-12)
    assert p.pipeline_time <= q.pipeline_time <= pipeline_time("1f1b", 2, 1, 4, fwd, bwd, fsend, bsend) * (1 + 1e-12)


def test_one_stage_holds_a_tied_head_once() -> None:
    """The recipes tie the head to the embedding (model_shape reads it): a rank holding both, at pp = 1, holds the
    weight once, with its gradient and AdamW state (16 bytes per parameter); at pp = 2 each end stage holds a copy
    (the strategy's tied-gradient synchronisation), as the fit check counts it (costs/memory.py, ``tied_head``)."""
    from lightning_3d.costs import AnalyticCostModel, model_shape
    from lightning_3d.recipes.gpt.config import preset

    tied = model_shape(preset("tiny", vocab_size=4096, seq_length=64))
    untied = model_shape(preset("tiny", vocab_size=4096, seq_length=64, tie_embeddings=False))
    assert tied.tied_embeddings and not untied.tied_embeddings and tied == untied  # the layers are the same
    cluster = ClusterSpec(1, 2, device_spec("h100"), 300e9, 25e9)
    work = {t: Workload(s, 64, 8, AnalyticCostModel(s, cluster.device), cluster, memory_reserve=0.0)
            for t, s in ((True, tied), (False, untied))}
    layers = tied.num_layers
    one = Candidate(1, 1, 1, 2, 4, "1f1b", 1, (layers,), (False,), False)
    two = Candidate(1, 2, 1, 2, 4, "1f1b", 1, (layers // 2, layers - layers // 2), (False, False), False)
    embedding = layer_parameters(tied, "embedding", 1)
    assert predict(one, work[False]).peak_memory - predict(one, work[True]).peak_memory == 16 * embedding
    assert predict(two, work[False]).peak_memory == predict(two, work[True]).peak_memory
    # The search's lower bound drops it alike (else it could skip a one-stage layout that predict() fits).
    assert lower_bound_memory(work[False], 1, 1) - lower_bound_memory(work[True], 1, 1) == 16 * embedding
    assert lower_bound_memory(work[False], 1, 2) == lower_bound_memory(work[True], 1, 2)
    # The strategy's fit check counts the same difference (costs/memory.py, ``tied_head``).
    from lightning_3d.costs.memory import MemoryLayout, layout_memory

    for pp, candidate in ((1, one), (2, two)):
        layout = MemoryLayout(candidate.layer_split, candidate.stage_checkpointing, 2, 4, pp=pp)
        fit = {t: max(r.total for r in layout_memory(work[t].cost_model, work[t].shape, 64, replace(layout, tied_head=t)))
               for t in (True, False)}
        planned = {t: predict(candidate, work[t]).peak_memory for t in (True, False)}
        assert fit[False] - fit[True] == planned[False] - planned[True] == (16 * embedding if pp == 1 else 0)
    # The planner reads a config's own tie_embeddings (the presets' default otherwise).
    from lightning_3d.costs import recipe_costs

    gpt, t5 = recipe_costs("lightning_3d.recipes.GPT"), recipe_costs("lightning_3d.recipes.T5")
    assert gpt.workload({"preset_name": "350m"}, {}, 2)[0].tied_embeddings
    assert not gpt.workload({"preset_name": "350m", "tie_embeddings": False}, {}, 2)[0].tied_embeddings
    assert t5.workload({"preset_name": "770m"}, {}, 2)[0].tied_embeddings  # T5 v1.0
    assert not t5.workload({"preset_name": "large"}, {}, 2)[0].tied_embeddings  # v1.1: an untied head
    assert t5.workload({"preset_name": "large", "tie_embeddings": True}, {}, 2)[0].tied_embeddings
