"""The planner and ``Compressed3DStrategy(cuda_graphs=True)`` (docs/planner.md, "CUDA graphs"): the search offers it
where the strategy accepts it (pp = tp = 1), a graphed micro-batch costs its layers' device seconds plus the
per-micro-batch overhead, a graphed rank holds the gradient buffers its stored activations do not cover, and the
plan sets the option.
On the checked-in synthetic profile with version-2 host and overhead fields added (as tests/test_planner_overheads.py
does)."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import lightning_3d.recipes  # noqa: F401  (registers the GPT and T5 recipes with the planner)
from lightning_3d.costs import ClusterSpec, ProfiledCostModel, device_spec, layer_parameters
from lightning_3d.costs.memory import MemoryLayout, layout_memory
from lightning_3d.planner import SearchOptions, Workload, load_config, plan, predict, search
from lightning_3d.planner.api import emit, strategy_options
from lightning_3d.planner.model import Candidate
from lightning_3d.planner.search import skeletons
from lightning_3d.strategies.compressed_3d import Compressed3DStrategy

PROFILE = Path(__file__).parent / "data" / "profiles" / "gpt_synthetic.json"
LAYERS = 8  # the synthetic model's blocks
SEQ = 1024


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _doc(host: float, microbatch: float, step: float) -> dict:
    """The synthetic profile with every grid's host time ``host`` per pass and the two measured overheads."""
    doc = json.loads(PROFILE.read_text())
    doc["version"] = 2
    for entries in doc["layers"].values():
        for e in entries:
            e["host_forward"] = [[host] * len(e["seq_len"]) for _ in e["microbatch_size"]]
            e["host_backward"] = [[host] * len(e["seq_len"]) for _ in e["microbatch_size"]]
    doc["overheads"] = {"microbatch_seconds": microbatch, "step_seconds": step}
    return doc


def _workload(doc: dict, batch: int = 8, gpus: int = 1) -> Workload:
    cm = ProfiledCostModel(doc, derive_tp=True)
    cluster = ClusterSpec(1, gpus, device_spec("h100"), 300e9, 25e9)
    return Workload(cm.shape, SEQ, batch, cm, cluster, memory_reserve=0.0)


def _device_seconds(w: Workload, mbs: int, ckpt: bool) -> float:
    """One micro-batch's forward and backward through every layer, from the profile's device grids alone."""
    total = 0.0
    for kind in w.shape.layer_kinds():
        f, b = w.cost_model.layer_time(kind, mbs, SEQ, recompute=ckpt and kind == "block")
        total += float(f) + float(b)
    return total


def _params(w: Workload) -> float:
    return sum(layer_parameters(w.shape, k, 1) for k in w.shape.layer_kinds())


def test_the_search_offers_cuda_graphs_only_where_the_strategy_accepts_it() -> None:
    w = _workload(_doc(1e-4, 1e-3, 0.0), batch=8, gpus=4)
    every = list(skeletons(w, 4, SearchOptions()))
    graphed = [s for s in every if s[8]]
    assert graphed and all(pp == 1 and tp == 1 for _, pp, tp, *_ in graphed)
    # Both values at every pp = tp = 1 layout (eager first), none elsewhere.
    # (s[9], s[10]: sequence parallelism and the sharded optimizer; neither is offered with graphs.)
    flat = [s for s in every if s[1] == 1 and s[2] == 1 and s[11] == 1 and not s[10]]  # s[11]: cp, never with graphs
    assert sorted(s[:8] for s in flat if s[8]) == sorted(s[:8] for s in flat if not s[8])
    assert not any(s[9] or s[10] for s in graphed)
    assert len([s for s in every if not any(s[8:11])]) == len({s[:8] + s[11:] for s in every})  # one plain variant each
    for dp, pp, tp, _mbs, m, schedule, _v, comp, *_ in graphed:  # each one the strategy's own check accepts
        Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                             num_microbatches=m, schedule=schedule, compression=comp, cuda_graphs=True)
    assert not any(s[8] for s in skeletons(w, 4, SearchOptions(cuda_graphs=(False,))))


def test_a_host_bound_step_picks_cuda_graphs_and_predicts_the_device_time() -> None:
    host, microbatch, step = 0.05, 2e-3, 1e-3  # host far above every layer's device time
    w = _workload(_doc(host, microbatch, step))
    best = search(w, 1, SearchOptions(top_k=3)).top[0]
    c = best.candidate
    assert c.cuda_graphs and (c.dp, c.pp, c.tp) == (1, 1, 1)
    ckpt = c.stage_checkpointing[0]
    # Each micro-batch: its layers' device seconds and the measured per-micro-batch overhead; then the optimizer
    # and the per-step overhead.
    device = c.num_microbatches * (_device_seconds(w, c.microbatch_size, ckpt) + microbatch)
    assert best.pipeline_time == pytest.approx(device, rel=1e-12)
    assert best.step_time == pytest.approx(device + best.optimizer_time + step, rel=1e-12)
    eager = predict(replace(c, cuda_graphs=False), w)  # the same layout eager: every layer at its host time
    host_sum = (LAYERS + 2) * 2 * host
    assert eager.pipeline_time == pytest.approx(c.num_microbatches * (host_sum + microbatch), rel=1e-12)
    assert best.step_time < eager.step_time


def test_a_device_bound_step_predicts_the_same_with_and_without_graphs() -> None:
    w = _workload(_doc(1e-9, 2e-3, 1e-3))  # host far below every layer's device time
    for mbs, m, ckpt in ((1, 8, False), (4, 2, True), (8, 1, False)):
        c = Candidate(1, 1, 1, mbs, m, "1f1b", 1, (LAYERS,), (ckpt,), False)
        eager, graphed = predict(c, w), predict(replace(c, cuda_graphs=True), w)
        assert graphed.step_time == eager.step_time  # max(device, host) is the device's on both sides
    # A tie: the graphed layout costs memory for nothing, so the search keeps the eager one.
    assert not any(p.candidate.cuda_graphs for p in search(w, 1, SearchOptions(top_k=10)).top)


def test_a_graphed_rank_holds_the_gradients_its_activations_do_not_cover() -> None:
    # The backward graph's gradient buffers take the pool blocks the micro-batch's stored activations free
    # (costs/memory.py, graph_gradient_bytes): the rank holds max(0, gradient bytes - one micro-batch's stored
    # activations) more than eager. The synthetic model's 4-byte gradients (0.67 GB) exceed the activations of one
    # sequence checkpointed (0.09 GB) and plain (0.34 GB), and are covered by those of two sequences and more.
    w = _workload(_doc(1e-4, 1e-3, 0.0), batch=16)
    seen = set()
    for mbs, m, ckpt in ((1, 16, True), (1, 16, False), (2, 8, False), (8, 2, False)):
        c = Candidate(1, 1, 1, mbs, m, "1f1b", 1, (LAYERS,), (ckpt,), False)
        eager, graphed = predict(c, w), predict(replace(c, cuda_graphs=True), w)
        layout = MemoryLayout((LAYERS,), (ckpt,), mbs, m, precision="bf16-mixed")
        stored = layout_memory(w.cost_model, w.shape, SEQ, layout)[0].activations  # one micro-batch in flight at pp = 1
        extra = max(0.0, 4 * _params(w) - stored)  # fp32 gradients: 4 bytes per parameter
        assert graphed.peak_memory - eager.peak_memory == pytest.approx(extra, rel=1e-12, abs=0)
        seen.add(extra > 0)
        # The strategy's fit check (costs/memory.py) adds the same buffers, in the gradients' dtype.
        for precision, size in (("bf16-mixed", 4), ("bf16-true", 2)):
            lay = replace(layout, precision=precision)
            base = layout_memory(w.cost_model, w.shape, SEQ, lay)[0]
            on = layout_memory(w.cost_model, w.shape, SEQ, replace(lay, cuda_graphs=True))[0]
            assert on.grads == size * _params(w) and base.graph_buffers == 0
            assert on.graph_buffers == max(0.0, size * _params(w) - base.activations)
            assert on.total - base.total == on.graph_buffers
            if on.graph_buffers:
                assert on.components()["CUDA graphs' gradient buffers"] == on.graph_buffers
            assert "CUDA graphs' gradient buffers" not in base.components()
    assert seen == {True, False}  # both regimes ran


def _gpu_config() -> dict:
    """The synthetic profile's model (8 layers, hidden 1024) as a training config for GPUs."""
    cfg = load_config("gpt_tiny")
    cfg["trainer"].update(precision="bf16-mixed", accelerator="gpu")
    cfg["model"]["init_args"].update(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32768)
    cfg["data"]["init_args"]["seq_length"] = SEQ
    return cfg


def test_the_plan_sets_cuda_graphs_and_the_cli_parses_it(tmp_path, monkeypatch, capsys) -> None:
    from lightning_3d.cli import main

    profile = tmp_path / "host_bound.json"
    profile.write_text(json.dumps(_doc(0.05, 2e-3, 1e-3)))
    cfg = _gpu_config()
    p = plan(cfg, 1, profile=profile, options=SearchOptions(top_k=1))
    assert p.predictions[0].candidate.cuda_graphs
    init = strategy_options(p.best)
    assert init["cuda_graphs"] is True and (init["pipeline_parallel_size"], init["tensor_parallel_size"]) == (1, 1)
    Compressed3DStrategy(**init)
    assert '"cuda_graphs": true' in p.yaml(0)  # in the prediction's comment too
    path = tmp_path / "plan.yaml"
    path.write_text(p.yaml(0))
    monkeypatch.setattr("sys.argv", ["lightning-3d"])
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(path), "--print_config"])
    assert exc.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert strategy_options(printed)["cuda_graphs"] is True

    # Configs that cannot take graphs: the search does not offer them (the config's choices are kept).
    fused = _gpu_config()
    fused["trainer"]["strategy"].setdefault("init_args", {})["gradient_accumulation_fusion"] = True
    cpu = _gpu_config()
    cpu["trainer"]["accelerator"] = "cpu"
    cpu_doc = _doc(0.05, 2e-3, 1e-3)
    cpu_doc["device"]["name"] = "cpu"  # a profile measured on a CPU (`lightning-3d profile --device cpu`)
    cpu_profile = tmp_path / "cpu_profile.json"
    cpu_profile.write_text(json.dumps(cpu_doc))
    for other, source in ((fused, profile), (cpu, profile), (_gpu_config(), cpu_profile)):
        q = plan(other, 1, profile=source, options=SearchOptions(top_k=3))
        assert not any(x.candidate.cuda_graphs for x in q.predictions)
        assert all("cuda_graphs" not in strategy_options(x) for x in q.configs)
        assert q.predictions[0].step_time > p.predictions[0].step_time

    # A config asking for graphs, planned onto a pipeline: the plan decides, and drops the option.
    graphs = _gpu_config()
    graphs["trainer"]["strategy"].setdefault("init_args", {})["cuda_graphs"] = True
    c = Candidate(1, 2, 1, 2, 4, "1f1b", 1, (4, 4), (False, False), False)
    out = emit(graphs, predict(c, _workload(_doc(0.05, 2e-3, 1e-3), gpus=2)), ClusterSpec.single_node(2), 2, 8)
    assert "cuda_graphs" not in strategy_options(out)


def test_the_validation_suite_measures_and_predicts_graphed_configurations(monkeypatch, tmp_path) -> None:
    import importlib.util
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    path = root / "benchmarks" / "planner" / "planner_validate.py"
    spec = importlib.util.spec_from_file_location("planner_validate_graphs", path)
    v = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = v
    spec.loader.exec_module(v)
    graphed = {name: [c for c in m.configs if c.graphs] for name, m in v.ONE.items()}
    assert [c.label() for c in graphed["gpt_350m"]] == ["1,1,1 2x8 compile graphs"]
    assert [c.label() for c in graphed["t5_770m"]] == ["1,1,1 8x2 compile graphs", "1,1,1 4x4 graphs"]
    for m in v.ONE.values():  # --recompute finds a row's configuration by its label
        assert len({c.label() for c in m.configs}) == len(m.configs)
    cm = ProfiledCostModel(_doc(1e-4, 1e-3, 0.0), derive_tp=True)
    model = v.Model("gpt", "synthetic", 32768, SEQ, None, 8, [])
    assert v.candidate(model, v.Config(2, 4, graphs=True), cm).cuda_graphs
    assert not v.candidate(model, v.Config(2, 4), cm).cuda_graphs
    # The run gets the strategy's option (benchmarks/parallel/train_throughput.py --cuda-graphs), and the script takes it.
    commands = []

    def popen(cmd, **kwargs):
        commands.append(cmd)
        raise OSError("not run")

    monkeypatch.setattr(subprocess, "Popen", popen)
    for graphs in (True, False):
        with pytest.raises(OSError, match="not run"):
            v.measure(model, v.Config(2, 4, graphs=graphs), steps=1, warmup=1, timeout=10, log_dir=tmp_path, cpu=True)
    assert "--cuda-graphs" in commands[0] and "--cuda-graphs" not in commands[1]
    path = root / "benchmarks" / "parallel" / "train_throughput.py"
    spec = importlib.util.spec_from_file_location("train_throughput_graphs", path)
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    assert tt.parse_args(["--cuda-graphs"]).cuda_graphs and not tt.parse_args([]).cuda_graphs
