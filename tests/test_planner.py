"""The planner's search and output: it finds the brute-force optimum on small spaces, never emits a config the
strategy rejects (random models and clusters), explains what is short when nothing fits, writes a YAML that the
CLI reads back, and that YAML trains on CPU through the real ``lightning-3d fit`` entry point."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import lightning_3d.recipes  # noqa: F401  (registers the GPT and T5 recipes with the planner)
from lightning_3d.costs import AnalyticCostModel, ClusterSpec, DeviceSpec, ModelShape, ProfiledCostModel, device_spec
from lightning_3d.planner import SearchOptions, Workload, context, load_config, plan, predict, search
from lightning_3d.planner.api import strategy_options
from lightning_3d.planner.model import Candidate
from lightning_3d.planner.search import skeletons
from lightning_3d.strategies.compressed_3d import Compressed3DStrategy

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "tests" / "data" / "profiles" / "gpt_synthetic.json"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _brute_force(w: Workload, gpus: int, opts: SearchOptions):
    best = None
    L = len(w.block_kinds())
    for dp, pp, tp, mbs, m, schedule, v, *options in skeletons(w, gpus, opts):
        S = pp * v
        for cut in itertools.combinations(range(1, L), S - 1):
            split = tuple(b - a for a, b in zip((0, *cut), (*cut, L)))
            for ckpt in itertools.product((False, True), repeat=S):
                p = predict(Candidate(dp, pp, tp, mbs, m, schedule, v, split, ckpt, *options), w)
                if p.fits and (best is None or p.step_time < best.step_time):
                    best = p
    return best


@pytest.mark.parametrize("memory_gib", [1.6])  # checkpointing binds at this size
def test_search_finds_the_brute_force_optimum_on_a_small_space(memory_gib) -> None:
    cm = ProfiledCostModel(PROFILE, derive_tp=True)
    cluster = ClusterSpec(1, 4, device_spec("h100"), 300e9, 25e9, memory_per_gpu=memory_gib * 2**30)
    w = Workload(cm.shape, 1024, 8, cm, cluster, memory_reserve=0.0)
    # Closed-form ranking on both sides (no simulator re-timing), so that the optima are comparable.
    opts = SearchOptions(microbatch_sizes=(1, 2), schedules=("1f1b", "interleaved_1f1b"), max_virtual_stages=2,
                         simulate_max_actions=0, top_k=1)
    best = _brute_force(w, 4, opts)
    found = search(w, 4, opts).top[0]  # exhaustive within each layout (the space is small)
    assert found.step_time == pytest.approx(best.step_time, rel=1e-12)
    assert found.fits
    # The heuristic path alone (balanced split, checkpointing where memory runs out, bottleneck relief) as well.
    greedy = search(w, 4, replace(opts, exhaustive_limit=0)).top[0]
    assert greedy.step_time == pytest.approx(best.step_time, rel=1e-12)


def _random_case(rng: random.Random):
    family = rng.choice(["gpt", "gpt", "t5"])
    heads = rng.choice([4, 8, 12, 16])
    hidden = heads * rng.choice([32, 64, 128])
    layers = rng.randint(1, 24)
    shape = ModelShape(family, layers, hidden, heads, 4 * hidden, rng.choice([1000, 32768, 50304]),
                       num_decoder_layers=rng.randint(1, 12) if family == "t5" else 0, head_dim=64 if family == "t5" else None,
                       gated_ffn=family == "t5" and rng.random() < 0.5)
    per_node = rng.choice([1, 2, 4, 8])
    nodes = rng.choice([1, 1, 2, 4])
    device = DeviceSpec("test", rng.choice([1e14, 1e15]), 2e12, rng.choice([4, 16, 80]) * 2**30)
    cluster = ClusterSpec(nodes, per_node, device, rng.choice([50e9, 300e9]), rng.choice([3e9, 25e9]))
    gpus = per_node * nodes
    batch = rng.choice([1, 4, 8, 16, 64])
    seq = rng.choice([128, 512, 2048])
    return shape, cluster, gpus, batch, seq


def test_no_invalid_config_is_ever_emitted() -> None:
    rng = random.Random(2024)
    emitted = 0
    for _ in range(20):
        shape, cluster, gpus, batch, seq = _random_case(rng)
        w = Workload(shape, seq, batch, AnalyticCostModel(shape, cluster.device), cluster,
                     target_len=seq // 4 if shape.family == "t5" else None)
        result = search(w, gpus, SearchOptions(top_k=3, time_budget_s=1.0, relief_skeletons=4))
        if not result.top:
            assert result.shortfall  # says why
            continue
        for p in result.top:
            c = p.candidate
            emitted += 1
            blocks = shape.num_layers + shape.num_decoder_layers
            assert c.dp * c.pp * c.cp * c.tp == gpus and c.tp <= cluster.gpus_per_node and shape.num_heads % c.tp == 0
            assert context.refusal(w, c.cp, c.cp_attention, c.tp, c.sequence_parallel) is None
            assert sum(c.layer_split) == blocks and len(c.layer_split) == c.num_stages and min(c.layer_split) >= 1
            assert len(c.stage_checkpointing) == c.num_stages
            assert batch % c.dp == 0 and c.microbatch_size * c.num_microbatches == batch // c.dp
            assert p.fits and p.peak_memory <= w.memory_budget
            Compressed3DStrategy(data_parallel_size=c.dp, pipeline_parallel_size=c.pp, tensor_parallel_size=c.tp,
                                 num_microbatches=c.num_microbatches, schedule=c.schedule,
                                 virtual_stages=c.virtual_stages if c.virtual_stages > 1 else None,
                                 pipeline_layer_split=list(c.layer_split), compression=c.compression,
                                 sequence_parallel=c.sequence_parallel, shard_optimizer_state=c.shard_optimizer_state,
                                 context_parallel_size=c.cp, context_parallel_attention=c.cp_attention)
    assert emitted > 15


def test_a_model_that_fits_nothing_says_what_is_short() -> None:
    tiny_gpu = ClusterSpec(1, 2, DeviceSpec("small", 1e14, 1e12, 4 * 2**30), 100e9, 10e9)
    cfg = load_config("gpt_1.3b")
    with pytest.raises(ValueError, match=r"memory per GPU is short: .* needs [0-9.]+ GiB per GPU but 2\.50 GiB are usable"):
        plan(cfg, 2, cluster=tiny_gpu)
    shape = ModelShape("gpt", 1, 96, 3, 384, 1000)
    w = Workload(shape, 128, 1, AnalyticCostModel(shape), ClusterSpec.single_node(2))
    result = search(w, 2, SearchOptions(context_parallel_sizes=(1,)))
    assert not result.top and "no (dp, pp, tp) layout of 2 GPUs" in result.shortfall[0]
    # One sequence, one layer, three heads: only context parallelism puts the second GPU to work.
    assert search(w, 2).top[0].candidate.cp == 2
    with pytest.raises(ValueError, match="gpus=0 must be a positive integer"):
        plan(cfg, 0)


def _tiny_cpu_config(root: Path) -> dict:
    cfg = load_config("gpt_tiny")
    trainer = cfg["trainer"]
    trainer.update(max_steps=1, limit_val_batches=0, val_check_interval=None, enable_checkpointing=False,
                   logger=False, default_root_dir=str(root), enable_progress_bar=False, accelerator="cpu")
    trainer.pop("callbacks")
    trainer.pop("check_val_every_n_epoch")
    return cfg


def test_cli_plan_writes_a_yaml_with_the_prediction_that_fit_runs(tmp_path) -> None:
    from lightning_3d.cli import main

    source = tmp_path / "model.yaml"
    source.write_text(yaml.safe_dump(_tiny_cpu_config(tmp_path)))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes: 1\ngpus_per_node: 4\ndevice: h100\n")
    out = tmp_path / "plan.yaml"
    main(["plan", "--config", str(source), "--gpus", "4", "--cluster", str(cluster), "--out", str(out), "--top-k", "2"])
    text = out.read_text()
    assert text.startswith("# Written by `lightning-3d plan`") and "# Prediction (analytic): step" in text
    emitted = yaml.safe_load(text)
    p = plan(str(source), 4, cluster=cluster, options=SearchOptions(top_k=2))
    assert emitted == p.configs[0] and (tmp_path / "plan.1.yaml").exists()
    init = strategy_options(emitted)
    Compressed3DStrategy(**init)
    assert emitted["trainer"]["devices"] == 4
    c = p.predictions[0].candidate
    assert emitted["data"]["init_args"]["batch_size"] * c.dp == 16  # the global batch is kept


def test_emitted_pipeline_config_trains_on_cpu_with_four_processes(tmp_path) -> None:
    # A pipelined plan (pp = 2, uneven split allowed) run unchanged by the real entry point, in a subprocess.
    p = plan(_tiny_cpu_config(tmp_path), 4, cluster=ClusterSpec.single_node(4),
             options=SearchOptions(pipeline_parallel_sizes=(2,), tensor_parallel_sizes=(1,), microbatch_sizes=(2,),
                                 schedules=("1f1b",), top_k=1))
    c = p.predictions[0].candidate
    assert (c.pp, c.dp, c.num_microbatches, c.schedule) == (2, 2, 4, "1f1b")
    path = tmp_path / "plan.yaml"
    path.write_text(p.yaml(0))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "lightning_3d.cli", "fit", "--config", str(path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "`max_steps=1` reached" in run.stdout + run.stderr


def test_time_budget_and_profile_device(tmp_path) -> None:
    shape = ModelShape("gpt", 8, 256, 4, 1024, 1000)
    w = Workload(shape, 128, 8, AnalyticCostModel(shape), ClusterSpec.single_node(4))
    result = search(w, 4, SearchOptions(time_budget_s=0.0))
    assert result.truncated and not result.top and "time budget (0.0 s) ran out after 0 layouts" in result.shortfall[0]
    cfg = _tiny_cpu_config(tmp_path)
    with pytest.raises(ValueError, match="was measured for ModelShape.*num_layers=8.*but the config describes"):
        plan(cfg, 2, profile=PROFILE)
    cfg["trainer"]["precision"] = "bf16-mixed"
    cfg["model"]["init_args"].update(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32768)
    cfg["data"]["init_args"]["seq_length"] = 8192  # the grid ends at 2048: not even cp = 2 brings it in
    with pytest.raises(ValueError, match="no finite cost for sequence length 8192 at micro-batch size 1"):
        plan(cfg, 2, profile=PROFILE)
    cfg["data"]["init_args"]["seq_length"] = 1024
    # Without a cluster file, a plan on a profile targets one node of the profiled GPU (here: an H100 with 80 GiB).
    p = plan(cfg, 2, profile=PROFILE, options=SearchOptions(top_k=1))
    assert p.cluster.device.name == "h100" and p.cluster.gpus_per_node == 2
    assert p.predictions[0].source.startswith("profile:")


def test_search_options_restrict_what_is_chosen() -> None:
    cm = ProfiledCostModel(PROFILE, derive_tp=True)
    cluster = ClusterSpec(1, 4, device_spec("h100"), 300e9, 25e9, memory_per_gpu=1.6 * 2**30)
    w = Workload(cm.shape, 1024, 8, cm, cluster, memory_reserve=0.0)
    free = search(w, 4, SearchOptions(top_k=20, microbatch_sizes=(1, 2)))
    assert any(0 < sum(p.candidate.stage_checkpointing) < p.candidate.num_stages for p in free.top)  # mixed exists
    uniform = search(w, 4, SearchOptions(top_k=20, microbatch_sizes=(1, 2), per_stage_checkpointing=False))
    assert uniform.top and all(len(set(p.candidate.stage_checkpointing)) == 1 for p in uniform.top)
    none = search(w, 4, SearchOptions(top_k=20, microbatch_sizes=(1, 2), allow_checkpointing=False, compression=(False,),
                                      schedules=("1f1b",), tensor_parallel_sizes=(1,)))
    assert none.top and all(not any(p.candidate.stage_checkpointing) and not p.candidate.compression
                            and p.candidate.schedule == "1f1b" and p.candidate.tp == 1 for p in none.top)
    assert all(p.step_time >= free.top[0].step_time for p in uniform.top + none.top)


def test_cli_plan_options(tmp_path, capsys) -> None:
    from lightning_3d.cli import main

    cfg = _tiny_cpu_config(tmp_path)
    cfg["trainer"]["precision"] = "bf16-mixed"
    cfg["model"]["init_args"].update(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32768)
    cfg["data"]["init_args"]["seq_length"] = 1024
    source = tmp_path / "model.yaml"
    source.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "plan.yaml"
    main(["plan", "--config", str(source), "--gpus", "2", "--profile", str(PROFILE), "--global-batch-size", "12",
          "--time-budget", "30", "--top-k", "1", "--out", str(out)])
    emitted = yaml.safe_load(out.read_text())
    init = strategy_options(emitted)
    assert emitted["data"]["init_args"]["batch_size"] * init["data_parallel_size"] == 12
    assert "# Prediction (profile:" in out.read_text()
    # Top-1: further files only for the runner-ups within the model's error (tests/test_planner_confidence.py).
    ups = [ln for ln in out.read_text().splitlines() if ln.startswith("#   PLAN.")]
    assert (tmp_path / "plan.1.yaml").exists() == bool(ups) and not (tmp_path / f"plan.{len(ups) + 1}.yaml").exists()
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(source), "--gpus", "0", "--out", str(out)])
    assert "gpus=0 must be a positive integer" in capsys.readouterr().err


def test_mixed_stage_checkpointing_is_emitted_as_the_strategy_option(tmp_path) -> None:
    from lightning_3d.planner.api import emit, strategy_supports_stage_checkpointing
    from lightning_3d.planner.model import Prediction

    cfg = _tiny_cpu_config(tmp_path)
    c = Candidate(2, 2, 1, 2, 4, "1f1b", 1, (1, 3), (True, False), False)
    p = Prediction(c, 1.0, 1.0, 0.0, 0.0, [0.5, 0.5], [0.5, 0.5], [1.0, 1.0], 1.0, 2.0, 1.0)
    if not strategy_supports_stage_checkpointing():
        with pytest.raises(ValueError, match="plan with per_stage_checkpointing=False"):
            emit(cfg, p, ClusterSpec.single_node(4), 4, 16)
        return
    out = emit(cfg, p, ClusterSpec.single_node(4), 4, 16)
    init = strategy_options(out)
    assert init["stage_activation_checkpointing"] == [True, False] and init["pipeline_layer_split"] == [1, 3]
    assert out["model"]["init_args"]["activation_checkpointing"] is False
