"""Validation of the planner's cost model: profile a model with `lightning-3d profile`'s code, predict the step time
and peak memory of training configurations, measure them with benchmarks/parallel/train_throughput.py (a fresh process per
configuration, synthetic data, bf16-mixed) and compare. Two suites, each sized for one job of <= 9 minutes:

    python benchmarks/planner/planner_validate.py --suite one    # 1 GPU: GPT-350M, GPT-1.3B, T5-770M (17 configurations)
    python benchmarks/planner/planner_validate.py --suite four   # 4 GPUs: GPT-350M, every (dp, pp, tp) of 4 (14 configurations)
    L3D_COMPILE_BACKEND=aot_eager python benchmarks/planner/planner_validate.py --suite one --device cpu   # CPU smoke test
    python benchmarks/planner/planner_validate.py --suite four --device cpu   # CPU smoke test (tiny GPT, 4 processes)
    python benchmarks/planner/planner_validate.py --suite one --runs 3 --models gpt_1.3b   # medians of 3 fresh runs
    python benchmarks/planner/planner_validate.py --recompute REPORT.json --profiles gpt_350m=PROFILE.json ...  # offline

Every configuration of a model trains the same global batch, so step times compare directly. Per configuration: the
predicted and measured step time (median of the timed steps, with their p10-p90) and peak memory
(``torch.cuda.max_memory_allocated``, max over ranks) and their errors. Per model: the time MAPE, Spearman's rank
correlation of predicted and measured times, the worst memory error, and the planner's choice (the configuration it
predicts fastest) against the best measured one (goal: >= 97 % of its throughput). ``--budget-s``: the suite's wall
time; a configuration that would start past it is skipped (reported), and each one's timeout is what is left.
``--remeasure-above E``: after every configuration had its turn, those whose time error exceeds E are measured once
more in fresh processes while the budget lasts (both measurements are reported; the MAPE uses the first,
``time_mape_both`` their mean), to tell a model's miss from a disturbed measurement. ``--runs N``: the repeat
protocol instead: every configuration is measured N times in fresh processes, interleaved (round r measures each
configuration once, in the suite's order), and its step is the median of the N runs' medians, printed with the
runs and their spread beside the error; ``--configs LABEL ...`` keeps a subset (labels as printed). JSON to
``$OUT/planner_validate_<suite>.json`` (or --out) and a compact summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

import lightning_3d.recipes  # noqa: E402,F401  (registers the GPT and T5 recipes with the planner)
from lightning_3d.costs import ClusterSpec, ModelShape, ProfiledCostModel, recipe_costs  # noqa: E402
from lightning_3d.planner import Candidate, Workload, add_compiled, measure_tp_layers, predict, profile_model, simulate_candidate  # noqa: E402


@dataclass(frozen=True)
class Config:
    """One training configuration: layout (dp, pp, tp), micro-batch size and count, checkpointing, compile, schedule,
    virtual stages, the layers per stage (None: even), and CUDA graphs (the strategy's cuda_graphs; pp = tp = 1)."""

    mbs: int
    m: int
    ckpt: bool = False
    compile: bool = False
    layout: tuple[int, int, int] = (1, 1, 1)
    schedule: str = "1f1b"
    v: int = 1
    split: tuple[int, ...] | None = None
    graphs: bool = False

    def label(self) -> str:
        dp, pp, tp = self.layout
        text = f"{dp},{pp},{tp} {self.mbs}x{self.m}"
        if self.layout[1] > 1:
            text += f" {self.schedule}" + (f" v{self.v}" if self.v > 1 else "")
        if self.split:
            text += " split=" + "/".join(map(str, self.split))
        return (text + (" ckpt" if self.ckpt else "") + (" compile" if self.compile else "")
                + (" graphs" if self.graphs else ""))


@dataclass
class Model:
    """A benchmarked model: recipe, preset, vocabulary, lengths, global batch, its configurations, and the profile's
    micro-batch sizes (eager, and compiled where a configuration compiles)."""

    recipe: str
    preset: str
    vocab: int
    seq: int
    target: int | None
    batch: int
    configs: list[Config]
    sizes: list[int] = field(default_factory=list)

    def profile_sizes(self) -> tuple[list[int], list[int]]:
        eager = sorted({c.mbs for c in self.configs if not c.compile} | set(self.sizes))
        return eager, sorted({c.mbs for c in self.configs if c.compile})


C = Config
ONE = {
    # In the order they are measured (round-robin over the models): a budget cut drops the last.
    "gpt_350m": Model("gpt", "350m", 50257, 1024, None, 16, [
        C(2, 8), C(4, 4, ckpt=True), C(8, 2), C(1, 16), C(4, 4), C(16, 1, ckpt=True), C(16, 1), C(8, 2, compile=True),
        C(2, 8, compile=True, graphs=True)]),
    "gpt_1.3b": Model("gpt", "1.3b", 50257, 1024, None, 8, [C(2, 4), C(4, 2), C(8, 1, ckpt=True)]),
    # Graphed configurations (docs/planner.md, "CUDA graphs"): the planner predicts their device time.
    "t5_770m": Model("t5", "770m", 32128, 512, 128, 16, [C(4, 4), C(8, 2), C(16, 1, ckpt=True),
                                                         C(8, 2, compile=True, graphs=True), C(4, 4, graphs=True)]),
}
ONE_CPU = {  # smoke test of the script on the CPU: times of the CPU, no memory figures
    "gpt_tiny": Model("gpt", "tiny", 4096, 64, None, 4, [C(1, 4), C(2, 2), C(4, 1, ckpt=True), C(2, 2, compile=True)]),
    "t5_tiny": Model("t5", "tiny", 512, 32, 16, 4, [C(2, 2), C(4, 1, ckpt=True)]),
}
# Four GPUs, GPT-350M (24 layers), global batch 32 sequences of 1024: every (dp, pp, tp) layout of 4 GPUs, the three
# schedules, micro-batch sizes, checkpointing and uneven splits (the head is worth about two blocks: fewer layers on
# the last stage).
FOUR = {  # in the order they are measured: every layout first, then schedules, checkpointing and splits
    "gpt_350m": Model("gpt", "350m", 50257, 1024, None, 32, [
        C(4, 2, layout=(4, 1, 1)), C(4, 4, layout=(2, 2, 1)), C(4, 8, layout=(1, 4, 1)), C(4, 4, layout=(2, 1, 2)),
        C(4, 8, layout=(1, 2, 2)), C(8, 4, layout=(1, 1, 4)),
        C(4, 4, layout=(2, 2, 1), schedule="gpipe"), C(4, 4, layout=(2, 2, 1), schedule="interleaved_1f1b", v=2),
        C(4, 8, layout=(1, 4, 1), split=(7, 6, 6, 5)), C(4, 8, layout=(1, 4, 1), schedule="interleaved_1f1b", v=2),
        C(4, 8, ckpt=True, layout=(1, 4, 1), schedule="gpipe"), C(8, 1, ckpt=True, layout=(4, 1, 1)),
        C(4, 8, layout=(1, 2, 2), split=(13, 11)), C(2, 16, layout=(1, 4, 1))], sizes=[2, 4, 8]),
}
FOUR_CPU = {
    "gpt_tiny": Model("gpt", "tiny", 4096, 64, None, 8, [
        C(2, 2, layout=(2, 1, 1)), C(1, 4, layout=(1, 2, 1)), C(1, 4, layout=(1, 2, 1), split=(3, 1)),
        C(2, 2, layout=(1, 1, 2))], sizes=[1, 2]),
}


def replace_configs(m: Model, labels: list[str]) -> Model:
    """``m`` with only the configurations labelled in ``labels`` (the profile keeps the model's micro-batch sizes)."""
    return replace(m, configs=[c for c in m.configs if c.label() in labels],
                   sizes=sorted(set(m.sizes) | {c.mbs for c in m.configs if not c.compile}))


def config_dict(m: Model, cpu: bool) -> dict:
    precision = "32-true" if cpu else "bf16-mixed"
    if m.recipe == "gpt":
        return {"trainer": {"precision": precision},
                "model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {"preset_name": m.preset, "vocab_size": m.vocab}},
                "data": {"init_args": {"seq_length": m.seq}}}
    return {"trainer": {"precision": precision},
            "model": {"class_path": "lightning_3d.recipes.T5", "init_args": {"preset_name": m.preset, "vocab_size": m.vocab}},
            "data": {"init_args": {"input_length": m.seq, "target_length": m.target, "objective": "pairs"}}}


def measure(m: Model, c: Config, *, steps: int, warmup: int, timeout: float, log_dir: Path, cpu: bool) -> dict:
    """Train ``c`` in fresh processes (benchmarks/parallel/train_throughput.py): median step seconds, spread, peak bytes."""
    dp, pp, tp = c.layout
    out = log_dir / ("run_" + c.label().replace(" ", "_").replace(",", "-").replace("/", "-") + f"_{time.monotonic_ns()}.json")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "parallel" / "train_throughput.py"), "--model", m.recipe, "--preset", m.preset,
           "--vocab-size", str(m.vocab), "--seq-length", str(m.seq), "--micro-batch-size", str(c.mbs),
           "--num-microbatches", str(c.m), "--layouts", f"{dp},{pp},{tp}", "--schedule", c.schedule, "--steps", str(steps),
           "--warmup", str(warmup), "--precision", "32-true" if cpu else "bf16-mixed", "--devices", str(dp * pp * tp),
           "--compression", "off", "--timeout", str(max(1, int(timeout) - 10)), "--out", str(out)]
    cmd += ["--accelerator", "cpu"] if cpu else []
    cmd += ["--target-length", str(m.target)] if m.target else []
    cmd += ["--virtual-stages", str(c.v)] if c.v > 1 else []
    cmd += ["--pipeline-layer-split", ",".join(map(str, c.split))] if c.split else []
    cmd += ["--activation-checkpointing"] if c.ckpt else []
    cmd += ["--compile", "default"] if c.compile else []
    cmd += ["--cuda-graphs"] if c.graphs else []
    # The driver's own --timeout stops its workers first; past ours, SIGTERM lets it clean up (its workers run in
    # sessions of their own, which a SIGKILL of the driver would leave on the GPUs), SIGKILL only if it does not.
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not out.exists():
        return {"error": text[-1500:]}
    row = json.loads(out.read_text())["results"][0]
    if row.get("error"):
        return {"error": row["error"][-1500:]}
    ms = row["step_ms"]
    return {"step_s": ms["median"] / 1e3, "step_p10_s": ms["p10"] / 1e3, "step_p90_s": ms["p90"] / 1e3,
            "peak_bytes": row["peak_mem_gb"] * 1e9 if row.get("peak_mem_gb") else None,
            # CUDA graphs' pool, of which peak_bytes includes what the allocator does not count (train_throughput)
            "graph_pool_bytes": row["graph_pool_gb"] * 1e9 if row.get("graph_pool_gb") else None,
            "run_s": round(time.monotonic() - t0, 1)}


def candidate(m: Model, c: Config, cm: ProfiledCostModel) -> Candidate:
    layers = len([k for k in cm.shape.layer_kinds() if k not in ("embedding", "head")])
    dp, pp, tp = c.layout
    stages = pp * c.v
    split = c.split or tuple(layers // stages + (1 if i < layers % stages else 0) for i in range(stages))
    return Candidate(dp, pp, tp, c.mbs, c.m, c.schedule, c.v, tuple(split), (c.ckpt,) * stages, False, c.graphs)


def seconds_needed(launch_s: list[float], default_launch_s: float, steps: int, step_s: float) -> float:
    """A run's expected seconds: its launch (the median of the runs so far outside their steps, else the default)
    plus its steps at three times ``step_s`` (the first steps' warm-up and a prediction up to 3x off)."""
    return (statistics.median(launch_s) if launch_s else default_launch_s) + 3 * steps * step_s


def without_tp_grids(doc: dict) -> dict:
    """``doc`` without the tensor-parallel grids measured across GPUs: what the planner derived before them."""
    return dict(doc, layers={k: [e for e in v if not e.get("collectives")] for k, v in doc["layers"].items()})


def shape_of(m: Model, cm: ProfiledCostModel) -> ModelShape:
    """The profile's shape with the config's ``tied_embeddings`` (what the planner's API takes from the config;
    profiles written before that field have it False)."""
    cfg = config_dict(m, cpu=False)
    try:
        config_shape = recipe_costs(cfg["model"]["class_path"]).workload(cfg["model"]["init_args"],
                                                                         cfg["data"]["init_args"], 2)[0]
    except ValueError:  # not a recipe preset (the tests' synthetic profile): the profile's own shape
        return cm.shape
    return replace(cm.shape, tied_embeddings=config_shape.tied_embeddings)


def has_tp_grids(doc: dict) -> bool:
    return any(e.get("collectives") for v in doc["layers"].values() for e in v)


def predict_both(m: Model, c: Config, doc: dict, cluster: ClusterSpec, cm: ProfiledCostModel):
    """The prediction with the profile as it is, and (when it holds measured tp grids and ``c`` uses tp) the one
    with those grids left out (derived from tp = 1 as before), for the before/after of the same run."""
    w = Workload(shape_of(m, cm), m.seq, m.batch, cm, cluster, target_len=m.target)
    cand = candidate(m, c, cm)
    p = simulate_candidate(cand, w) if cand.pp > 1 else predict(cand, w)
    if cand.tp == 1 or not has_tp_grids(doc):
        return p, None
    cm0 = ProfiledCostModel(without_tp_grids(doc), derive_tp=True, compiled=c.compile)
    w0 = Workload(shape_of(m, cm0), m.seq, m.batch, cm0, cluster, target_len=m.target)
    return p, simulate_candidate(cand, w0) if cand.pp > 1 else predict(cand, w0)


def burst_prediction(m: Model, c: Config, doc: dict, cluster: ClusterSpec):
    """The prediction with the grids' burst times (``ProfiledCostModel(sustained_clock=False)``), or None where the
    profile has no sustained-clock section: the rows record it beside the default's, the term's before/after."""
    if not doc.get("sustained"):
        return None
    cm = ProfiledCostModel(doc, derive_tp=True, compiled=c.compile, sustained_clock=False)
    w = Workload(shape_of(m, cm), m.seq, m.batch, cm, cluster, target_len=m.target)
    cand = candidate(m, c, cm)
    return simulate_candidate(cand, w) if cand.pp > 1 else predict(cand, w)


def runahead_prediction(m: Model, c: Config, cm: ProfiledCostModel, cluster: ClusterSpec):
    """The prediction with ``Workload(host_runahead=True)``: the simulator times each pipeline rank's device and host
    apart, the host one action ahead (docs/planner.md); the rows record it beside the default's for pp > 1."""
    w = Workload(shape_of(m, cm), m.seq, m.batch, cm, cluster, target_len=m.target, host_runahead=True)
    return simulate_candidate(candidate(m, c, cm), w)


def tp_grid_lines(m: Model, doc: dict, cluster: ClusterSpec) -> list[str]:
    """Per measured tp degree and micro-batch size: one block's forward + backward ms as measured across the GPUs
    (device span, host time) against the derivation from tp = 1 (its compute ratio plus the modelled all-reduces)."""
    if not has_tp_grids(doc):
        return []
    cm0 = ProfiledCostModel(without_tp_grids(doc), derive_tp=True)
    w0 = Workload(shape_of(m, cm0), m.seq, m.batch, cm0, cluster, target_len=m.target)
    out = []
    for kind, entries in doc["layers"].items():
        for e in entries:
            if not e.get("collectives"):
                continue
            cells = []
            for i, b in enumerate(e["microbatch_size"]):
                f, bw = e["forward"][i][-1], e["backward"][i][-1]
                if f is None:
                    cells.append(f"mb{b} -")
                    continue
                hf, hb = e["host_forward"][i][-1], e["host_backward"][i][-1]
                df, db = cm0.layer_time(kind, b, m.seq, recompute=e["recompute"], tp=e["tp"])
                comm = 2 * w0.tp_comm(kind, b, e["tp"]) * (2 if e["recompute"] else 1)
                cells.append(f"mb{b} {1e3 * (f + bw):.2f} (host {1e3 * (hf + hb):.2f}) vs derived"
                             f" {1e3 * (float(df) + float(db) + comm):.2f}")
            out.append(f"  tp {e['tp']} {kind}{' ckpt' if e['recompute'] else ''} fwd+bwd ms: " + "; ".join(cells))
    return out


def spearman(x: list[float], y: list[float]) -> float | None:
    from scipy.stats import spearmanr

    if len(x) < 3:
        return None
    rho = spearmanr(x, y).statistic
    return None if rho != rho else float(rho)


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "step_s" in r]
    out: dict = {"measured": len(ok), "configs": len(rows)}
    if not ok:
        return out
    errs = [abs(r["time_error"]) for r in ok]
    out["time_mape"] = sum(errs) / len(errs)
    both = [abs(r["predicted_step_s"] / ((r["step_s"] + r["repeat_step_s"]) / 2) - 1) if "repeat_step_s" in r
            else abs(r["time_error"]) for r in ok]
    out["time_mape_both"] = sum(both) / len(both)
    if any(len(r.get("run_step_s", ())) > 1 for r in ok):  # the repeat protocol: the first runs alone, and the spread
        out["time_mape_first_run"] = sum(abs(r["predicted_step_s"] / r["first_step_s"] - 1) for r in ok) / len(ok)
        out["runs"] = [len(r["run_step_s"]) for r in ok]
        out["max_run_spread"] = max(r.get("run_spread", 0.0) for r in ok)
    out["spearman"] = spearman([r["predicted_step_s"] for r in ok], [r["step_s"] for r in ok])
    mem = [abs(r["memory_error"]) for r in ok if r.get("memory_error") is not None]
    out["memory_max_abs_error"] = max(mem) if mem else None
    if any("derived_time_error" in r for r in ok):
        # Before the measured tp grids: the same rows with the tp configurations' derived predictions.
        derived = [r.get("derived_step_s", r["predicted_step_s"]) for r in ok]
        out["derived_time_mape"] = sum(abs(d / r["step_s"] - 1) for d, r in zip(derived, ok)) / len(ok)
        out["derived_spearman"] = spearman(derived, [r["step_s"] for r in ok])
    if any("burst_step_s" in r for r in ok):
        # Without the sustained-clock term: the same rows priced at the grids' burst clock.
        burst = [r.get("burst_step_s", r["predicted_step_s"]) for r in ok]
        out["burst_time_mape"] = sum(abs(b / r["step_s"] - 1) for b, r in zip(burst, ok)) / len(ok)
        out["burst_spearman"] = spearman(burst, [r["step_s"] for r in ok])
    if any("runahead_step_s" in r for r in ok):
        # The host run-ahead variant: the same rows with the pipelined configurations' run-ahead predictions.
        ahead = [r.get("runahead_step_s", r["predicted_step_s"]) for r in ok]
        out["runahead_time_mape"] = sum(abs(a / r["step_s"] - 1) for a, r in zip(ahead, ok)) / len(ok)
        out["runahead_spearman"] = spearman(ahead, [r["step_s"] for r in ok])
    chosen = min(ok, key=lambda r: r["predicted_step_s"])
    best = min(ok, key=lambda r: r["step_s"])
    out["planner_choice"], out["best_measured"] = chosen["config"], best["config"]
    out["choice_vs_best_measured"] = best["step_s"] / chosen["step_s"]
    return out


def run_suite(models: dict[str, Model], gpus: int, ns, log_dir: Path) -> dict:
    started = time.monotonic()
    cpu = ns.device == "cpu"
    left = lambda: ns.budget_s - (time.monotonic() - started)  # noqa: E731
    report: dict = {"suite": ns.suite, "gpus": gpus, "device": ns.device or "cuda", "models": {}}
    work = []  # (name, model, config)
    docs, clusters = {}, {}
    launch_s: list[float] = []  # per measured configuration: its run's seconds outside the steps
    for name, m in models.items():
        eager, _ = m.profile_sizes()
        t0 = time.monotonic()
        marks: list[str] = []  # where the profile's time goes (each step's end, seconds since its start)
        doc = profile_model(config_dict(m, cpu), device=ns.device, microbatch_sizes=eager, seq_lens=[m.seq],
                            target_lens=[m.target] if m.target else None, repeats=ns.repeats, warmup=2,
                            collectives=gpus > 1 and not cpu,
                            log=lambda msg: marks.append(f"{time.monotonic() - t0:.0f}s {str(msg).split(' (')[0][:40]}"))
        if cpu and gpus > 1:
            # On GPUs the profiler measures the tensor-parallel layers with the collectives; the CPU smoke test does
            # it here over gloo, so that the path (and the planner's reading of its grids) runs.
            extra = measure_tp_layers(config_dict(m, cpu), gpus, device="cpu", microbatch_sizes=eager,
                                      seq_lens=[m.seq], warmup=2, repeats=ns.repeats)
            for kind, entries in extra.get("tp_layers", {}).items():
                doc["layers"].setdefault(kind, []).extend(entries)
        profile_s = time.monotonic() - t0
        _release(cpu)
        docs[name] = doc
        _save_profile(ns, name, doc)
        intra = (doc.get("collectives") or {}).get("intra_node_bandwidth") or 300e9
        clusters[name] = ClusterSpec(1, gpus, ProfiledCostModel(doc).device, intra, intra)
        report["models"][name] = {"profile_seconds": round(profile_s, 1), "rows": [], "overheads": doc.get("overheads"),
                                  "call_overhead": doc.get("call_overhead"), "optimizer": doc.get("optimizer")}
        print(f"{name}: profiled in {profile_s:.1f} s; overheads {_overheads(doc)}", flush=True)
        print(f"  profile timeline: {'; '.join(marks)}", flush=True)
        if doc.get("tp_layers_error"):
            print(f"  tp layers NOT measured (tp derived from tp = 1): {doc['tp_layers_error'][-300:]}", flush=True)
        for line in tp_grid_lines(m, doc, clusters[name]):
            print(line, flush=True)
        work += [(name, m, c) for c in m.configs]
    # Round-robin over the models, so that a budget cut leaves every model measured; compiled configurations with
    # their grids profiled only then and only if the budget allows both.
    # A compiled configuration goes in round --compile-round (its grids' compile is the longest single item: late in
    # the suite it was what the budget cut).
    position = {id(c): i for m in models.values() for i, c in enumerate(m.configs)}
    order = sorted(work, key=lambda t: (ns.compile_round if t[2].compile else position[id(t[2])], t[2].compile))
    for name, m, c in order:
        row: dict = {"config": c.label()}
        # Compiled grids of the blocks (GPT's "block", T5's encoder and decoder blocks) profiled once per model.
        if c.compile and not any(e.get("compiled") for kind, entries in docs[name]["layers"].items()
                                 if kind not in ("embedding", "head") for e in entries):
            if left() < ns.compile_reserve_s:
                row.update(predicted_step_s=None, error=f"skipped: {left():.0f} s left, a compiled configuration"
                           f" needs --compile-reserve-s {ns.compile_reserve_s:.0f}")
                report["models"][name]["rows"].append(row)
                print(f"  {name:9s} {row['config']:34s} {row['error']}", flush=True)
                continue
            t0 = time.monotonic()
            add_compiled(docs[name], config_dict(m, cpu), device=ns.device, microbatch_sizes=m.profile_sizes()[1],
                         seq_lens=[m.seq], target_lens=[m.target] if m.target else None, repeats=ns.repeats,
                         warmup=2, log=lambda *a: None)
            _release(cpu)
            report["models"][name]["compile_profile_seconds"] = round(time.monotonic() - t0, 1)
            _save_profile(ns, name, docs[name])
            print(f"{name}: compiled grids profiled in {time.monotonic() - t0:.1f} s", flush=True)
        try:
            cm = ProfiledCostModel(docs[name], derive_tp=True, compiled=c.compile)
        except ValueError as err:  # the compile failed in the profiler: its configurations say so
            row.update(predicted_step_s=None, error=f"{err} {docs[name].get('compile_errors')}")
            report["models"][name]["rows"].append(row)
            print(f"  {name:9s} {row['config']:34s} {row['error'][:120]}", flush=True)
            continue
        p, derived = predict_both(m, c, docs[name], clusters[name], cm)
        row.update({"predicted_step_s": p.step_time, "predicted_peak_bytes": p.peak_memory,
                    "predicted_pipeline_s": p.pipeline_time, "predicted_optimizer_s": p.optimizer_time,
                    "predicted_overhead_s": p.overhead_time, "predicted_dp_s": p.exposed_dp_time})
        if derived is not None:  # the same configuration priced as before the tp grids were measured
            row.update(derived_step_s=derived.step_time, derived_peak_bytes=derived.peak_memory)
        burst = burst_prediction(m, c, docs[name], clusters[name])
        if burst is not None:  # the same configuration priced at the grids' burst clock
            row["burst_step_s"] = burst.step_time
        if candidate(m, c, cm).pp > 1:  # the model variant under test: each rank's host issuing one action ahead
            row["runahead_step_s"] = runahead_prediction(m, c, cm, clusters[name]).step_time
        budget = left()
        # What a run takes: the launch (processes, NCCL, the model; the runs so far tell it) and the steps at up to
        # three times the prediction; a configuration that cannot finish in what is left is skipped for a later,
        # cheaper one rather than timed out.
        need = seconds_needed(launch_s, ns.launch_s, ns.warmup + ns.steps, p.step_time)
        if budget < max(ns.min_config_s, need):
            row["error"] = f"skipped: {budget:.0f} s of the suite's budget left, {need:.0f} s needed"
        else:
            # Twice what it should take: a hung or pathological run gives its time back to the later ones.
            timeout = min(ns.config_timeout_s, budget, max(ns.min_config_s, 2 * need))
            row.update(measure(m, c, steps=ns.steps, warmup=ns.warmup, timeout=timeout, log_dir=log_dir, cpu=cpu))
            if "step_s" in row:
                launch_s.append(max(0.0, row["run_s"] - (ns.warmup + ns.steps) * row["step_s"]))
                row.update(first_step_s=row["step_s"], run_step_s=[row["step_s"]],
                           run_p10_p90_s=[[row["step_p10_s"], row["step_p90_s"]]])
        if "step_s" in row:
            row["time_error"] = p.step_time / row["step_s"] - 1
            row["memory_error"] = p.peak_memory / row["peak_bytes"] - 1 if row.get("peak_bytes") else None
            if derived is not None:
                row["derived_time_error"] = derived.step_time / row["step_s"] - 1
                row["derived_memory_error"] = (derived.peak_memory / row["peak_bytes"] - 1 if row.get("peak_bytes")
                                               else None)
        report["models"][name]["rows"].append(row)
        print(_line(name, row), flush=True)
        Path(ns.out).write_text(json.dumps(report, indent=1))
    # The repeat protocol (--runs N): rounds 2..N measure every configuration measured so far again, each in fresh
    # processes and in the same order, so that a slow stretch of the machine lands on different configurations in
    # different rounds; the row's step is then the median of its runs and its spread is printed beside its error.
    for round_ in range(2, ns.runs + 1):
        for name, m, c in order:
            row = next((r for r in report["models"][name]["rows"] if r["config"] == c.label()), None)
            if row is None or "step_s" not in row:
                continue
            need = seconds_needed(launch_s, ns.launch_s, ns.warmup + ns.steps, row["first_step_s"])
            if left() < max(ns.min_config_s, need):
                print(f"  {name:9s} {row['config']:34s} round {round_} skipped: {left():.0f} s left", flush=True)
                continue
            again = measure(m, c, steps=ns.steps, warmup=ns.warmup, log_dir=log_dir, cpu=cpu,
                            timeout=min(ns.config_timeout_s, left(), max(ns.min_config_s, 2 * need)))
            if "step_s" in again:
                row["run_step_s"].append(again["step_s"])
                row["run_p10_p90_s"].append([again["step_p10_s"], again["step_p90_s"]])
                launch_s.append(max(0.0, again["run_s"] - (ns.warmup + ns.steps) * again["step_s"]))
                _fold_runs(row)
            print(f"  round {round_}" + _line(name, row)[1:], flush=True)
            Path(ns.out).write_text(json.dumps(report, indent=1))
    # Second pass (single runs only), once every configuration had its turn: the worst misses measured again in
    # fresh processes while the budget lasts (a model's miss repeats; a disturbed measurement does not).
    report["launch_seconds"] = [round(x, 1) for x in launch_s]
    misses = [] if ns.runs > 1 else sorted(((abs(r["time_error"]), name, r) for name, e in report["models"].items() for r in e["rows"]
                     if "time_error" in r and abs(r["time_error"]) > ns.remeasure_above), key=lambda t: -t[0])
    for _, name, row in misses:
        need = seconds_needed(launch_s, ns.launch_s, ns.warmup + ns.steps, row["step_s"])
        if left() < max(ns.min_config_s, need):
            continue
        m = models[name]
        c = next(c for c in m.configs if c.label() == row["config"])
        if c.compile:  # a second compile costs what a first does: not worth the budget's end
            continue
        again = measure(m, c, steps=ns.steps, warmup=ns.warmup, timeout=min(ns.config_timeout_s, left()),
                        log_dir=log_dir, cpu=cpu)
        if "step_s" in again:
            row["repeat_step_s"] = again["step_s"]
            row["repeat_p10_p90_s"] = [again["step_p10_s"], again["step_p90_s"]]
        print("  again" + _line(name, row)[1:], flush=True)
    every = []
    for entry in report["models"].values():
        entry.update(summarize(entry["rows"]))
        every += [r for r in entry["rows"] if "step_s" in r]
    report["all"] = summarize(every) if len(report["models"]) > 1 else None
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    Path(ns.out).write_text(json.dumps(report, indent=1))
    return report


def _fold_runs(row: dict) -> None:
    """The row's step as the median of its runs' medians, its spread ((max - min) / median of the runs) and the
    errors against that median."""
    runs = row["run_step_s"]
    row["step_s"] = statistics.median(runs)
    row["run_spread"] = (max(runs) - min(runs)) / row["step_s"]
    row["time_error"] = row["predicted_step_s"] / row["step_s"] - 1
    if "derived_step_s" in row:
        row["derived_time_error"] = row["derived_step_s"] / row["step_s"] - 1


def _release(cpu: bool) -> None:
    if not cpu:
        import torch

        torch.cuda.empty_cache()  # the profiler's cached blocks, out of the way of the runs' processes


def _save_profile(ns, name: str, doc: dict) -> None:
    Path(ns.out).with_name(f"profile_{ns.suite}_{name}.json").write_text(json.dumps(doc, allow_nan=False))


def _overheads(doc: dict) -> str:
    o, c, opt = doc.get("overheads") or {}, doc.get("call_overhead") or {}, doc.get("optimizer") or {}
    per_block = (f" + {1e3 * o['step_seconds_per_block']:.3f} ms per block beyond {o.get('step_blocks', 0)}"
                 if o.get("step_seconds_per_block") else "")
    return (f"micro-batch {1e3 * o.get('microbatch_seconds', 0):.2f} ms, step {1e3 * o.get('step_seconds', 0):.2f} ms"
            f"{per_block},"
            f" call fwd/bwd {1e3 * c.get('forward_seconds', 0):.2f}/{1e3 * c.get('backward_seconds', 0):.2f} ms,"
            f" optimizer {1e3 * opt.get('step_seconds', 0):.1f} ms"
            + (f"; in-situ host scale {o['host_scale'][0]:.2f} (checkpointed {o['host_scale'][1]:.2f}), tiny model per"
               f" micro-batch ms {({k: round(1e3 * v, 2) for k, v in o['host_microbatch_seconds'].items()})}"
               if o.get("host_scale") else ""))


def _line(name: str, r: dict) -> str:
    head = f"  {name:9s} {r['config']:34s} pred {r['predicted_step_s'] * 1e3:8.1f} ms"
    if "step_s" not in r:
        return head + "  " + r["error"].strip().splitlines()[-1][:100]
    mem = (f" mem {r['predicted_peak_bytes'] / 1e9:6.2f}/{r['peak_bytes'] / 1e9:6.2f} GB ({100 * r['memory_error']:+5.1f} %)"
           if r.get("memory_error") is not None else "")
    again = f" again {r['repeat_step_s'] * 1e3:.1f}" if "repeat_step_s" in r else ""
    if len(r.get("run_step_s", ())) > 1:
        again += (f" runs {'/'.join(f'{x * 1e3:.1f}' for x in r['run_step_s'])} (median of {len(r['run_step_s'])},"
                  f" spread {100 * r['run_spread']:.1f} %)")
    again += f" derived {r['derived_step_s'] * 1e3:.1f}" if "derived_step_s" in r else ""
    again += f" runahead {r['runahead_step_s'] * 1e3:.1f}" if "runahead_step_s" in r else ""
    again += f" burst {r['burst_step_s'] * 1e3:.1f}" if "burst_step_s" in r else ""
    again += f" run {r['run_s']:.0f} s" if "run_s" in r else ""
    spread = ("" if len(r.get("run_step_s", ())) > 1  # the runs' medians follow instead of one run's p10-p90
              else f" [{r['step_p10_s'] * 1e3:.1f}-{r['step_p90_s'] * 1e3:.1f}]")
    return (head + f" meas {r['step_s'] * 1e3:8.1f}{spread}{again}"
            f" ({100 * r['time_error']:+6.1f} %)" + mem)


def _print_summary(report: dict) -> None:
    print(f"\nSUMMARY suite={report['suite']} gpus={report['gpus']} wall {report['wall_seconds']} s")
    entries = list(report["models"].items()) + ([("all", report["all"])] if report.get("all") else [])
    for name, s in entries:
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        print(f"  {name:9s} measured {s.get('measured', 0)}/{s.get('configs', 0)}"
              f"  MAPE {fmt(s.get('time_mape') and 100 * s['time_mape'], '.1f')} %"
              f" (with repeats {fmt(s.get('time_mape_both') and 100 * s['time_mape_both'], '.1f')} %)"
              f"  spearman {fmt(s.get('spearman'), '.3f')}"
              + (f" (medians of {min(s['runs'])}-{max(s['runs'])} runs; first runs alone MAPE"
                 f" {100 * s['time_mape_first_run']:.1f} %; largest spread {100 * s['max_run_spread']:.1f} %)"
                 if s.get("runs") else "")
              + ""
              f"  memory max err {fmt(s.get('memory_max_abs_error') and 100 * s['memory_max_abs_error'], '.1f')} %"
              f"  choice/best {fmt(s.get('choice_vs_best_measured') and 100 * s['choice_vs_best_measured'], '.1f')} %"
              + (f" ({s['planner_choice']} vs {s['best_measured']})" if s.get("planner_choice") else "")
              + (f"  profile {s['profile_seconds']} s" if "profile_seconds" in s else ""))
        if s.get("runahead_time_mape") is not None:
            print(f"  {name:9s} with the host one action ahead in pipelines (Workload.host_runahead): MAPE"
                  f" {100 * s['runahead_time_mape']:.1f} %  spearman {fmt(s.get('runahead_spearman'), '.3f')}")
        if s.get("burst_time_mape") is not None:
            print(f"  {name:9s} at the grids' burst clock (no sustained-clock term): MAPE"
                  f" {100 * s['burst_time_mape']:.1f} %  spearman {fmt(s.get('burst_spearman'), '.3f')}")
        if s.get("derived_time_mape") is not None:
            print(f"  {name:9s} with tp derived from tp = 1 (as before the measured tp grids): MAPE"
                  f" {100 * s['derived_time_mape']:.1f} %  spearman {fmt(s.get('derived_spearman'), '.3f')}")


def breakdown(c: Candidate, w: Workload) -> dict:
    """One micro-batch of a one-stage candidate, term by term (seconds): the layers' device spans, their host times,
    the host floor the model takes, the per-micro-batch overhead; and the step's fixed terms."""
    from lightning_3d.planner import layer_terms

    out = layer_terms(c.microbatch_size, c.tp, c.stage_checkpointing[0], w)
    return {k: round(v * 1e3, 3) for k, v in out.items()}


def recompute(report_path: str, profiles: dict[str, str], host_runahead: bool = False) -> dict:
    """The predictions of a saved report's configurations rebuilt from its saved profiles with the current model,
    against the measured steps: per configuration old and new prediction, error, and the new one's breakdown."""
    report = json.loads(Path(report_path).read_text())
    if report.get("suite") not in ("one", "four"):
        raise SystemExit(f"{report_path} names no suite ('one' or 'four'): it predates the suites' report format, whose"
                         " rows --recompute rebuilds; recompute a report that `--suite one|four` wrote.")
    suite = {"one": ONE, "four": FOUR}[report["suite"]]
    gpus = report["gpus"]
    out: dict = {"report": report_path, "models": {}}
    every_old, every_new = [], []
    for name, entry in report["models"].items():
        if name not in profiles:
            continue
        m = suite[name]
        doc = json.loads(Path(profiles[name]).read_text())
        intra = (doc.get("collectives") or {}).get("intra_node_bandwidth") or 300e9
        rows_old, rows_new = [], []
        for row in entry["rows"]:
            if "step_s" not in row:
                continue
            c = next(c for c in m.configs if c.label() == row["config"])
            cm = ProfiledCostModel(doc, derive_tp=True, compiled=c.compile)
            w = Workload(shape_of(m, cm), m.seq, m.batch, cm, ClusterSpec(1, gpus, cm.device, intra, intra), target_len=m.target,
                         host_runahead=host_runahead)
            cand = candidate(m, c, cm)
            p = simulate_candidate(cand, w) if cand.pp > 1 else predict(cand, w)
            new = dict(row, predicted_step_s=p.step_time, time_error=p.step_time / row["step_s"] - 1,
                       predicted_peak_bytes=p.peak_memory,
                       memory_error=p.peak_memory / row["peak_bytes"] - 1 if row.get("peak_bytes") else None)
            rows_old.append(row), rows_new.append(new)
            terms = breakdown(cand, w) if cand.pp == 1 else {}
            memory = (f"; memory old {100 * row['memory_error']:+.1f} % new {100 * new['memory_error']:+.1f} %"
                      if row.get("memory_error") is not None and new["memory_error"] is not None else "")
            print(f"  {name:9s} {row['config']:24s} meas {row['step_s'] * 1e3:7.1f} old {row['predicted_step_s'] * 1e3:7.1f}"
                  f" ({100 * row['time_error']:+6.1f} %) new {p.step_time * 1e3:7.1f} ({100 * new['time_error']:+6.1f} %)"
                  f"{memory}  per-mb ms {terms}", flush=True)
        out["models"][name] = {"old": summarize(rows_old), "new": summarize(rows_new), "rows": rows_new}
        every_old += rows_old
        every_new += rows_new
        old, new = out["models"][name]["old"], out["models"][name]["new"]
        print(f"  {name}: MAPE old {100 * old.get('time_mape', 0):.1f} % new {100 * new.get('time_mape', 0):.1f} %;"
              f" spearman old {old.get('spearman') or 0:.3f} new {new.get('spearman') or 0:.3f}; memory max error old"
              f" {100 * (old.get('memory_max_abs_error') or 0):.1f} % new {100 * (new.get('memory_max_abs_error') or 0):.1f} %;"
              " tp grids measured:"
              f" {'yes' if has_tp_grids(doc) else 'no (derived from tp = 1)'}")
    out["all"] = {"old": summarize(every_old), "new": summarize(every_new)}
    print(f"ALL: MAPE old {100 * out['all']['old'].get('time_mape', 0):.1f} % new {100 * out['all']['new'].get('time_mape', 0):.1f} %")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("one", "four"), default="one")
    parser.add_argument("--device", default=None, help="default: the GPUs; cpu: smoke test with tiny models")
    parser.add_argument("--out", default=None, help="JSON (default: $OUT/planner_validate_<suite>.json)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration (their median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=5, help="profiler repeats per shape")
    parser.add_argument("--budget-s", type=float, default=500.0, help="the suite's wall time")
    parser.add_argument("--config-timeout-s", type=float, default=120.0, help="per configuration, at most (each one's"
                        " is twice its seconds_needed, within this and the budget left)")
    parser.add_argument("--min-config-s", type=float, default=25.0, help="skip a configuration with less left")
    parser.add_argument("--launch-s", type=float, default=40.0, help="a run's seconds outside its steps (process"
                        " start, NCCL, model build) assumed until the first run measures it: a configuration starts"
                        " only if this plus 3 x (warmup + steps) x its prediction is left")
    parser.add_argument("--compile-reserve-s", type=float, default=150.0,
                        help="seconds a compiled configuration needs left (its grids' compile and its run's)")
    parser.add_argument("--compile-round", type=int, default=1,
                        help="round (0-based, over the models) in which compiled configurations are measured")
    parser.add_argument("--runs", type=int, default=1, help="fresh-process runs per configuration, interleaved"
                        " (every configuration once per round); the step is the median of the runs' medians")
    parser.add_argument("--configs", nargs="+", default=None, metavar="LABEL", help="only these configurations"
                        " (labels as printed, e.g. '1,1,1 4x2' '1,1,1 8x1 ckpt')")
    parser.add_argument("--remeasure-above", type=float, default=0.15, help="time error that triggers a re-run")
    parser.add_argument("--models", nargs="+", default=None, help="a subset of the suite's models")
    parser.add_argument("--recompute", default=None, metavar="REPORT", help="no measurement: rebuild a saved report's"
                        " predictions from its saved profiles (--profiles) with the current model, with a breakdown")
    parser.add_argument("--profiles", nargs="+", default=[], metavar="NAME=PATH", help="with --recompute")
    parser.add_argument("--host-runahead", action="store_true", help="with --recompute: predict with"
                        " Workload(host_runahead=True) (pipelines: each rank's host one action ahead of its device)")
    ns = parser.parse_args(argv)
    if ns.recompute:
        try:
            profiles = dict(p.split("=", 1) for p in ns.profiles)
        except ValueError:
            parser.error(f"--profiles takes NAME=PATH pairs, got {ns.profiles}")
        return recompute(ns.recompute, profiles, host_runahead=ns.host_runahead)
    warnings.simplefilter("ignore")
    if ns.out is None:
        ns.out = os.path.join(os.environ.get("OUT", "."), f"planner_validate_{ns.suite}.json")
    cpu = ns.device == "cpu"
    models = {"one": ONE_CPU if cpu else ONE, "four": FOUR_CPU if cpu else FOUR}[ns.suite]
    if ns.models:
        unknown = sorted(set(ns.models) - set(models))
        if unknown:
            parser.error(f"--models {unknown}: this suite has {sorted(models)}")
        models = {k: v for k, v in models.items() if k in ns.models}
    if ns.runs < 1:
        parser.error(f"--runs must be >= 1, got {ns.runs}")
    if ns.configs:
        labels = {c.label() for m in models.values() for c in m.configs}
        unknown = sorted(set(ns.configs) - labels)
        if unknown:
            parser.error(f"--configs {unknown}: the suite's labels are {sorted(labels)}")
        models = {k: replace_configs(v, ns.configs) for k, v in models.items()}
        models = {k: v for k, v in models.items() if v.configs}
    gpus = 1 if ns.suite == "one" else 4
    if cpu:
        import torch

        torch.set_num_threads(1)  # as train_throughput's workers run (OMP_NUM_THREADS=1): profile and runs alike
    else:
        import torch

        if torch.cuda.device_count() < gpus:
            parser.error(f"--suite {ns.suite} needs {gpus} GPUs; {torch.cuda.device_count()} visible (--device cpu:"
                         f" smoke test)")
    log_dir = Path(tempfile.mkdtemp(prefix="planner_validate_"))
    report = run_suite(models, gpus, ns, log_dir)
    _print_summary(report)
    print(f"wrote {ns.out}")
    return report


if __name__ == "__main__":
    main()
