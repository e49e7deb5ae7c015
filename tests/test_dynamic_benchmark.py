"""Dynamic micro-batching's pipeline benchmark (benchmarks/dynamic/dynamic_multi_gpu.sh -> benchmarks/dynamic/multitask_microbatching.py
--engine lightning) never loses a finished row: per-variant steps and budgets parse (bad ones fail with the fix
named), the rows so far are on disk before and after every variant (the running one as cut by the time limit),
the table shows skipped, stopped, cut and never-started variants, and the shape-header clock counts what it wraps.
The launches themselves run in `SMOKE=1 bash benchmarks/dynamic/dynamic_multi_gpu.sh` (two processes, a few minutes)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest


def opts(**kw) -> argparse.Namespace:
    base = {"steps": 5, "warmup": 1, "steps_for": [], "variant_budget_s": []}
    return argparse.Namespace(**{**base, **kw})


def test_steps_and_budgets_per_variant():
    from benchmarks.dynamic.multitask_microbatching import budget_of, steps_of

    args = opts(steps_for=["padding=2/1", "packing@2=3/0"], variant_budget_s=["40", "padding=25"])
    assert steps_of(args, "padding@4") == (3, 1)  # 2 timed after 1 warm-up
    assert steps_of(args, "packing@2:flex") == (5, 1)  # a full text matches only itself
    assert steps_of(args, "packing@2") == (3, 0)
    assert steps_of(args, "dynamic") == (5, 1)  # --steps / --warmup
    assert budget_of(args, "padding@4") == 25.0
    assert budget_of(args, "dynamic") == 40.0  # the bare number is every other variant's
    assert budget_of(opts(), "dynamic") is None
    with pytest.raises(SystemExit, match=r"padding@4='2': give TIMED/WARMUP"):
        steps_of(opts(steps_for=["padding=2"]), "padding@4")
    with pytest.raises(SystemExit, match=r"TIMED >= 1"):
        steps_of(opts(steps_for=["padding=0/1"]), "padding@4")
    with pytest.raises(SystemExit, match=r"'pading=2/1'.*must be a variant"):
        steps_of(opts(steps_for=["pading=2/1"]), "padding@4")
    with pytest.raises(SystemExit, match=r"dynamic='soon'.*give seconds"):
        budget_of(opts(variant_budget_s=["dynamic=soon"]), "dynamic")


def test_decisions_without_a_process_group_are_this_ranks_own():
    from benchmarks.dynamic.multitask_microbatching import max_over_ranks, rank0_decides

    assert rank0_decides(True) is True and rank0_decides(False) is False
    assert max_over_ranks([1.5, 2.0]) == [1.5, 2.0]


def test_rows_are_on_disk_before_and_after_each_variant(tmp_path, monkeypatch):
    from benchmarks.dynamic.multitask_microbatching import CUT, write_rows

    monkeypatch.delenv("RANK", raising=False)
    args = argparse.Namespace(out=tmp_path / "r.json", model="gpt", variants=["dynamic", "padding@4"])
    done = [{"variant": "dynamic", "error": None, "useful_tokens_per_s": 10}]
    write_rows(args, done, {"variant": "padding@4", "error": None}, final=False)
    doc = json.loads(args.out.read_text())
    assert doc["partial"] is True
    assert [r["variant"] for r in doc["results"]] == ["dynamic", "padding@4"]
    assert doc["results"][1]["status"] == CUT and doc["results"][1]["error"] == f"{CUT} (killed while running)"
    write_rows(args, done, None, final=True, summary={"pp": 2})
    doc = json.loads(args.out.read_text())
    assert doc["partial"] is False and doc["summary"] == {"pp": 2} and len(doc["results"]) == 1
    assert not (tmp_path / "r.tmp").exists()
    monkeypatch.setenv("RANK", "1")  # only rank 0 writes
    write_rows(args, [], None, final=True)
    assert len(json.loads(args.out.read_text())["results"]) == 1


def test_table_shows_every_outcome_and_the_ratios(tmp_path):
    from benchmarks.dynamic.multitask_microbatching import CUT, SKIPPED, lightning_table

    rows = [
        {"variant": "dynamic", "pp": 2, "dp": 2, "error": None, "useful_tokens_per_s": 30000, "step_s_mean": 1.0,
         "timed_steps": 4, "stopped_by_budget": False},
        {"variant": "packing@2", "pp": 2, "dp": 2, "error": None, "useful_tokens_per_s": 20000, "step_s_mean": 1.5,
         "timed_steps": 2, "stopped_by_budget": True},
        {"variant": "token_budget@16384", "pp": 2, "dp": 2, "error": f"{SKIPPED} (5 s left)"},
    ]
    doc = {"args": {"model": "gpt", "pp": "2", "variants": str(["dynamic", "packing@2", "token_budget@16384",
                                                               "padding@4"])}, "results": rows}
    (tmp_path / "a.json").write_text(json.dumps(doc))
    # A file of the interleaved schedule with auto and two packing settings: each planned variant against the best.
    speeds = {"auto": 36000, "packed_dynamic": 33000, "packing@4": 30000, "packing@2": 24000}
    doc_b = {"args": {"model": "t5", "pp": "4", "schedule": "interleaved_1f1b", "variants": str(list(speeds))},
             "results": [{"variant": k, "pp": 4, "dp": 1, "schedule": "interleaved_1f1b", "error": None,
                          "useful_tokens_per_s": v} for k, v in speeds.items()]}
    (tmp_path / "b.json").write_text(json.dumps(doc_b))
    out = lightning_table([tmp_path / "a.json", tmp_path / "missing.json", tmp_path / "b.json"]).splitlines()
    assert out[2].startswith("| gpt | 2 | 2 | 1f1b | dynamic | 30,000 | 1.000 |") and out[2].endswith("| ok |")
    assert out[3].endswith("| ok, stopped by budget after 2 timed |")
    assert out[4].endswith(f"| {SKIPPED} (5 s left) |") and "| 20,000 |" not in out[4]
    assert out[5].startswith("| gpt | 2 | 2 | 1f1b | padding@4 |") and out[5].endswith(f"| {CUT} (not started) |")
    assert out[6] == "| missing.json: no rows (FileNotFoundError) |"
    assert out[7].startswith("| t5 | 4 | 1 | interleaved_1f1b | auto | 36,000 |")
    assert out[11:] == [  # no token budget or padding row finished
        "gpt pp=2 1f1b: dynamic / best packing (packing@2) = 1.50",
        "t5 pp=4 interleaved_1f1b: auto / best packing (packing@4) = 1.20",
        "t5 pp=4 interleaved_1f1b: packed_dynamic / best packing (packing@4) = 1.10"]
    # The direct engine's rows, per SDPA setting, through the same comparison.
    from benchmarks.dynamic.multitask_planned import speedups

    direct = [{**r, "sdpa": "flash"} for r in doc_b["results"]] + [{"variant": "auto", "sdpa": "math", "error": None,
                                                                   "useful_tokens_per_s": 1}]
    assert speedups(direct) == [out[12].partition(": ")[2] + " (sdpa flash)", out[13].partition(": ")[2] + " (sdpa flash)"]


def test_header_clock_counts_the_receives_it_wraps(monkeypatch):
    from benchmarks.dynamic.multitask_microbatching import HeaderClock
    from lightning_3d.pipeline.p2p import PipelineChannels

    calls = []
    monkeypatch.setattr(PipelineChannels, "recv_header", lambda self, pp_rank: calls.append(pp_rank) or [((2, 3), None)])
    monkeypatch.setattr(HeaderClock, "count", 0)
    monkeypatch.setattr(HeaderClock, "seconds", 0.0)
    HeaderClock.install()
    HeaderClock.install()  # once: a second install does not wrap the wrapper
    assert PipelineChannels.recv_header(None, 1) == [((2, 3), None)]
    assert PipelineChannels.recv_header(None, 0) == [((2, 3), None)]
    assert calls == [1, 0] and HeaderClock.count == 2 and HeaderClock.seconds >= 0.0


def test_predicted_pipeline_time_is_the_simulated_1f1b():
    """One micro-batch crosses the stages one after another (forward down, backward up): the sum of every stage's
    cost; two equal ones on two stages overlap where 1F1B lets them, and an explicit schedule gives the same."""
    import numpy as np

    from benchmarks.dynamic.multitask_microbatching import predicted_pipeline_s
    from lightning_3d.costs import model_shape
    from lightning_3d.dynamic import default_cost_model
    from lightning_3d.dynamic.stage_costs import evaluate, stage_layers
    from lightning_3d.pipeline.schedules import build_schedule
    from lightning_3d.recipes import GPT

    shape = model_shape(GPT("tiny", vocab_size=1000, seq_length=128).config, bytes_per_element=2)
    cost = default_cost_model(shape)
    c = evaluate(cost, stage_layers(shape, 2), np.array([4]), np.array([64]), None, recompute=False, tp=1)
    (f0, f1), (b0, b1) = c.forward[:, 0], c.backward[:, 0]
    one = predicted_pipeline_s(cost, shape, 2, [([(4, 64, None)], None)])
    assert one == [pytest.approx(f0 + f1 + b1 + b0, rel=1e-12)]
    orders = tuple(build_schedule("1f1b", 2, 1, 2, r) for r in range(2))
    two = predicted_pipeline_s(cost, shape, 2, [([(4, 64, None)] * 2, None), ([(4, 64, None)] * 2, orders)])
    # 1F1B on two stages: rank 0 runs F F B B, rank 1 F B F B. Rank 1's second forward starts when its first backward
    # is done and rank 0's second forward has arrived; rank 0's first backward waits for rank 1's first backward.
    start = max(f0 + f1 + b1, 2 * f0)
    assert two == [pytest.approx(start + b0 + max(b0, f1 + b1), rel=1e-12)] * 2


@pytest.mark.parametrize("schedule,virtual_stages", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_predicted_pipeline_time_of_a_plan_is_the_planners_own(schedule, virtual_stages):
    """The prediction of a dynamic plan's micro-batches, run in the plan's orders, is the makespan the planner
    simulated for it (same stages, costs and simulation), with 1F1B and with interleaved virtual stages; without
    orders the strategy's schedule runs them in the given order, which for interleaving differs from 1F1B's."""
    import numpy as np

    from benchmarks.dynamic.multitask_microbatching import predicted_pipeline_s
    from lightning_3d.costs import model_shape
    from lightning_3d.dynamic import default_cost_model, plan_step
    from lightning_3d.recipes import GPT

    shape = model_shape(GPT("tiny", vocab_size=1000, seq_length=128).config, bytes_per_element=2)
    cost = default_cost_model(shape)
    lengths = np.random.default_rng(0).integers(1, 129, size=48)
    plan = plan_step(lengths, shape=shape, dp=1, pp=2, virtual_stages=virtual_stages, schedule=schedule,
                     memory_budget=2**24, max_seq_len=128)  # tight: several micro-batches
    replica = plan.replicas[0]
    mbs = [(len(mb.samples), mb.seq_len, None) for mb in replica.microbatches]
    assert len(mbs) >= 4  # a real pipeline of several micro-batches
    (own,) = predicted_pipeline_s(cost, shape, 2, [(mbs, replica.orders)], schedule, virtual_stages)
    assert own == pytest.approx(replica.makespan, rel=1e-12)
    (plain_1f1b,) = predicted_pipeline_s(cost, shape, 2, [(mbs, None)])
    (plain,) = predicted_pipeline_s(cost, shape, 2, [(mbs, None)], schedule, virtual_stages)
    assert (plain == plain_1f1b) is (virtual_stages == 1)


def test_compile_builds_compiling_models_for_the_lightning_engine_only(monkeypatch, capsys):
    """--compile: the recipes' models are built with compile=True (they compile their blocks when the Trainer calls
    configure_model, which only the lightning engine does), and the direct engine refuses it with the reason."""
    import sys

    from benchmarks.dynamic import multitask_microbatching as bench

    data = argparse.Namespace(vocab_size=256, pad_token_id=0, eos_token_id=1)
    for model in ("gpt", "t5"):
        for flag in (False, True):
            built = bench.build_model(argparse.Namespace(model=model, preset="tiny", seq_length=64, compile=flag), data)
            assert built.hparams.compile is flag
    monkeypatch.setattr(sys, "argv", ["multitask_microbatching.py", "--engine", "direct", "--compile"])
    with pytest.raises(SystemExit, match="--compile runs with --engine lightning only"):
        bench.main()
    # --plans-only builds no model to train: it plans as a compiled run would, whichever engine is named.
    planned = []
    monkeypatch.setattr(bench, "plans", lambda args: planned.append(args.compile))
    monkeypatch.setattr(sys, "argv", ["multitask_microbatching.py", "--engine", "direct", "--compile", "--plans-only"])
    bench.main()
    assert planned == [True]


def test_the_lightning_engines_strategy_takes_compression_and_zero_1_on_request() -> None:
    from benchmarks.dynamic.multitask_microbatching import strategy_for
    from lightning_3d import CompressionConfig

    base = dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2)
    plain = strategy_for(argparse.Namespace(**base, compression=False, shard_optimizer_state=False))
    both = strategy_for(argparse.Namespace(**base, compression=True, shard_optimizer_state=True))
    assert plain.compression == CompressionConfig(enabled=False) and not plain.runtime.shard_optimizer_state
    # CB forced on the pipeline's sends (its "auto" measures the link and skips fast ones), the rest at its defaults
    assert both.compression == CompressionConfig(compressed_backprop=True) and both.runtime.shard_optimizer_state
    assert (both.schedule, both.virtual_stages) == ("interleaved_1f1b", 2)


@pytest.mark.parametrize("compile_", [False, True])
def test_the_benchmarks_planner_makes_a_compiled_models_packed_rows_full(compile_: bool) -> None:
    """The direct engine's and --plans-only's planner (``planned_batcher``) plans packed rows as the data module does:
    full rows for a model that compiles its blocks, each micro-batch's own length otherwise."""
    from benchmarks.dynamic.multitask_planned import planned_batcher
    from lightning_3d.recipes.data.multitask_batching import StepCollator
    from tests.scenarios.dynamic_costs import TINY, ToyCostModel

    args = argparse.Namespace(model="gpt", seq_length=128, target_length=0, auto_candidates=None, compile=compile_)
    collator = StepCollator("gpt", "padding", 1, 0, seq_length=128, target_length=0, pad_id=0, micro_batch_size=2,
                            token_budget=None)
    batcher = planned_batcher(args, "packed_dynamic", collator, TINY, 1e12, ToyCostModel(), "dense")
    assert batcher.packed_row_length == ("full" if compile_ else "fill")
    samples = [{"tokens": list(range(1, n + 2)), "prompt": 1} for n in (10, 20, 5, 15)]  # one row of 54 tokens
    lengths = {mb["input_ids"].shape[1] for mb in collator(samples)}
    assert lengths == ({128} if compile_ else {56})  # full, or the row rounded up to a multiple of 8


DRIVER = """
import json, sys, weakref
sys.path.insert(0, sys.argv[1])
from benchmarks.dynamic import multitask_microbatching as bench

built, alive_at_build = [], []
build = bench.build_model

def recording(args, data, packed_attention="auto"):
    if len(built) >= 2:  # a variant's own model (the first two builds read the config)
        alive_at_build.append(sum(ref() is not None for ref in built[2:]))
    model = build(args, data, packed_attention)
    built.append(weakref.ref(model))
    return model

if __name__ == "__main__":  # the data loader's workers start by importing this file
    bench.build_model = recording
    sys.argv = ["multitask_microbatching.py", *sys.argv[2:]]
    bench.main()
    print(json.dumps({"builds": len(built), "alive_at_build": alive_at_build}))
"""


def test_lightning_engine_frees_each_variant_before_the_next(tmp_path):
    """The lightning engine runs its variants one after another in one process: a variant's model (and through
    module.trainer its trainer and optimizer state) must be gone when the next variant builds its model, or the
    previous run's weights and AdamW state stay on the card under the next one's micro-batches."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    common = ["--model", "gpt", "--preset", "tiny", "--seq-length", "128", "--target-length", "64", "--global-batch", "8",
              "--num-samples", "200", "--vocab-size", "512", "--cache-dir", str(tmp_path / "cache")]
    root = str(Path(__file__).resolve().parent.parent)
    subprocess.run([sys.executable, driver, root, *common, "--prepare-only"], check=True, cwd=root, capture_output=True,
                   timeout=300)
    out = subprocess.run([sys.executable, driver, root, *common, "--engine", "lightning", "--steps", "3", "--warmup",
                          "1", "--variants", "packing@2", "token_budget@512", "dynamic", "--num-workers", "0", "--accelerator", "cpu",
                          "--precision", "32-true", "--out", str(tmp_path / "rows.json")],
                         check=True, cwd=root, capture_output=True, text=True, timeout=300)
    rows = json.loads((tmp_path / "rows.json").read_text())["results"]
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    for r in rows:  # two timed steps: their mean lies halfway between the fastest and the slowest (each rounded)
        assert r["timed_steps"] == 2 and r["step_s_min"] <= r["step_s_mean"] <= r["step_s_max"]
        assert abs(r["step_s_mean"] - (r["step_s_min"] + r["step_s_max"]) / 2) <= 1.5e-4
    # two builds read the config, then one per variant: at each variant's build, no earlier variant's model is alive
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"builds": 5, "alive_at_build": [0, 0, 0]}
