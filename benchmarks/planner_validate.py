"""One-GPU validation of the planner's cost model: profile GPT-350M, GPT-1.3B and T5-770M on this GPU, predict the
step time and peak memory of one-GPU configurations (micro-batch size and count, activation checkpointing), measure
them with benchmarks/train_throughput.py (fresh processes, synthetic data, bf16-mixed), and compare. JSON to
``$OUT/planner_validate.json`` (or --out).

    python benchmarks/planner_validate.py --models gpt_350m gpt_1.3b   # ~ 6 GPU-minutes on an H100
    python benchmarks/planner_validate.py --models t5_770m --out "$OUT/planner_validate_t5.json"
    python benchmarks/planner_validate.py --gpus 4 --out "$OUT/planner_validate_4gpu.json"   # the multi-GPU issue

Per model: the profile's cost (seconds; the goal is <= 10 GPU-minutes for the three), and per configuration the
predicted and measured step time and peak memory (``torch.cuda.max_memory_allocated``) with their errors; per
model the time MAPE, the worst memory error, and the planner's choice (the configuration it predicts fastest)
against the best measured one (goal: >= 97 % of its throughput). Every configuration of a model trains the same
global batch, so their throughputs compare. ``--gpus 4``: twelve GPT-350M configurations over (dp, pp, tp),
schedules, virtual stages, micro-batching and checkpointing on four GPUs (collectives profiled too), with the
correlation of predicted and measured step times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning_3d.recipes  # noqa: E402,F401  (registers the GPT and T5 recipes with the planner)
from lightning_3d.costs import ClusterSpec, ProfiledCostModel  # noqa: E402
from lightning_3d.planner.model import Candidate, Workload, predict  # noqa: E402
from lightning_3d.planner.profile import profile_model  # noqa: E402

# name -> (model, preset, vocab, seq, target, profiled micro-batch sizes, [(mbs, num_microbatches, checkpointing)])
MODELS = {
    "gpt_350m": ("gpt", "350m", 50257, 1024, None, [1, 2, 4, 8, 16],
                 [(1, 16, False), (2, 8, False), (4, 4, False), (8, 2, False), (4, 4, True), (16, 1, True)]),
    "gpt_1.3b": ("gpt", "1.3b", 50257, 1024, None, [1, 2, 4, 8],
                 [(1, 8, False), (2, 4, False), (4, 2, False), (8, 1, True)]),
    "t5_770m": ("t5", "770m", 32128, 512, 128, [2, 4, 8, 16],
                [(2, 8, False), (4, 4, False), (8, 2, False), (16, 1, True)]),
    # CPU smoke test of this script (--device cpu): no memory figures, times of the CPU
    "gpt_tiny": ("gpt", "tiny", 4096, 64, None, [1, 2], [(1, 2, False), (2, 1, True)]),
}


# Multi-GPU validation (--gpus N, the multi-GPU issue runs it): GPT-350M layouts (dp, pp, tp), schedule,
# virtual stages, micro-batch size and count, checkpointing; every layout keeps the per-replica batch (mbs × m), as
# train_throughput.py does, so the prediction's global batch is dp × mbs × m.
MULTI = [
    ((4, 1, 1), "1f1b", None, 4, 4, False), ((4, 1, 1), "1f1b", None, 8, 2, True),
    ((2, 2, 1), "1f1b", None, 4, 4, False), ((2, 2, 1), "gpipe", None, 4, 4, False),
    ((2, 2, 1), "interleaved_1f1b", 2, 4, 4, False), ((1, 4, 1), "1f1b", None, 4, 8, False),
    ((1, 4, 1), "1f1b", None, 2, 16, False), ((1, 4, 1), "interleaved_1f1b", 2, 4, 8, False),
    ((1, 4, 1), "gpipe", None, 4, 8, True), ((2, 1, 2), "1f1b", None, 4, 4, False),
    ((1, 2, 2), "1f1b", None, 4, 8, False), ((1, 1, 4), "1f1b", None, 8, 4, False),
]


def config_dict(model: str, preset: str, vocab: int, seq: int, target: int | None) -> dict:
    if model == "gpt":
        return {"trainer": {"precision": "bf16-mixed"},
                "model": {"class_path": "lightning_3d.recipes.GPT", "init_args": {"preset_name": preset, "vocab_size": vocab}},
                "data": {"init_args": {"seq_length": seq}}}
    return {"trainer": {"precision": "bf16-mixed"},
            "model": {"class_path": "lightning_3d.recipes.T5", "init_args": {"preset_name": preset, "vocab_size": vocab}},
            "data": {"init_args": {"input_length": seq, "target_length": target, "objective": "pairs"}}}


def measure(model: str, preset: str, vocab: int, seq: int, target: int | None, mbs: int, m: int, ckpt: bool,
            steps: int, warmup: int, log_dir: Path, cpu: bool = False) -> dict:
    out = log_dir / f"{model}_{preset}_mbs{mbs}_m{m}_ckpt{int(ckpt)}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--model", model, "--preset", preset,
           "--vocab-size", str(vocab), "--seq-length", str(seq), "--micro-batch-size", str(mbs), "--num-microbatches",
           str(m), "--layouts", "1,1,1", "--steps", str(steps), "--warmup", str(warmup), "--precision",
           "32-true" if cpu else "bf16-mixed", "--devices", "1", "--out", str(out)] + (["--accelerator", "cpu"] if cpu else [])
    if target:
        cmd += ["--target-length", str(target)]
    if ckpt:
        cmd.append("--activation-checkpointing")
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 or not out.exists():
        return {"error": (run.stdout + run.stderr)[-2000:]}
    row = json.loads(out.read_text())["results"][0]
    if row.get("error"):
        return {"error": row["error"]}
    peak = row["peak_mem_gb"] * 1e9 if row.get("peak_mem_gb") else None
    return {"step_s": row["step_ms"]["median"] / 1e3, "peak_bytes": peak,
            "tokens_per_s": row["tokens_per_s"]}


def measure_layout(layout, schedule, v, mbs, m, ckpt, steps, warmup, log_dir: Path, gpus: int) -> dict:
    out = log_dir / ("multi_" + "_".join(map(str, (*layout, schedule, v, mbs, m, int(ckpt)))) + ".json")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--model", "gpt", "--preset", "350m",
           "--vocab-size", "50257", "--seq-length", "1024", "--micro-batch-size", str(mbs), "--num-microbatches", str(m),
           "--layouts", ",".join(map(str, layout)), "--schedule", schedule, "--steps", str(steps), "--warmup", str(warmup),
           "--precision", "bf16-mixed", "--devices", str(gpus), "--compression", "off", "--out", str(out)]
    if v:
        cmd += ["--virtual-stages", str(v)]
    if ckpt:
        cmd.append("--activation-checkpointing")
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if run.returncode != 0 or not out.exists():
        return {"error": (run.stdout + run.stderr)[-2000:]}
    row = json.loads(out.read_text())["results"][0]
    if row.get("error"):
        return {"error": row["error"]}
    return {"step_s": row["step_ms"]["median"] / 1e3, "peak_bytes": row["peak_mem_gb"] * 1e9}


def validate_multi(ns, log_dir: Path) -> dict:
    """Predicted against measured step time and memory of the MULTI configurations on ``ns.gpus`` GPUs."""
    import numpy as np

    from lightning_3d.costs import ClusterSpec as Cluster
    from lightning_3d.planner.model import simulate_candidate

    cfg = config_dict("gpt", "350m", 50257, 1024, None)
    started = time.perf_counter()
    doc = profile_model(cfg, microbatch_sizes=[1, 2, 4, 8], seq_lens=[1024], repeats=ns.repeats, collectives=True,
                        log=lambda *a: None)
    profile_s = time.perf_counter() - started
    Path(ns.out).with_name("profile_gpt_350m_multi.json").write_text(json.dumps(doc, allow_nan=False))
    cm = ProfiledCostModel(doc, derive_tp=True)
    intra = (doc.get("collectives") or {}).get("intra_node_bandwidth") or 300e9
    cluster = Cluster(1, ns.gpus, cm.device, intra, intra)
    rows = []
    for layout, schedule, v, mbs, m, ckpt in MULTI:
        dp, pp, tp = layout
        if dp * pp * tp != ns.gpus:
            continue
        stages = pp * (v or 1)
        w = Workload(cm.shape, 1024, dp * mbs * m, cm, cluster)
        split = tuple(24 // stages + (1 if i < 24 % stages else 0) for i in range(stages))
        c = Candidate(dp, pp, tp, mbs, m, schedule, v or 1, split, (ckpt,) * stages, False)
        p = simulate_candidate(c, w) if pp > 1 else predict(c, w)
        got = measure_layout(layout, schedule, v, mbs, m, ckpt, ns.steps, ns.warmup, log_dir, ns.gpus)
        row = {"layout": layout, "schedule": schedule, "virtual_stages": v, "microbatch_size": mbs, "num_microbatches": m,
               "activation_checkpointing": ckpt, "predicted_step_s": p.step_time, "predicted_peak_bytes": p.peak_memory, **got}
        rows.append(row)
        print(json.dumps(row))
    ok = [r for r in rows if "step_s" in r]
    out = {"profile_seconds": round(profile_s, 1), "gpus": ns.gpus, "configs": rows}
    if len(ok) >= 3:
        pred, meas = np.array([r["predicted_step_s"] for r in ok]), np.array([r["step_s"] for r in ok])
        out["pearson"] = float(np.corrcoef(pred, meas)[0, 1])
        out["spearman"] = float(np.corrcoef(np.argsort(np.argsort(pred)), np.argsort(np.argsort(meas)))[0, 1])
        out["time_mape"] = float(np.mean(np.abs(pred / meas - 1)))
        chosen = ok[int(np.argmin(pred / np.array([r["layout"][0] * r["microbatch_size"] * r["num_microbatches"] for r in ok])))]
        best = ok[int(np.argmin(meas / np.array([r["layout"][0] * r["microbatch_size"] * r["num_microbatches"] for r in ok])))]
        # Per-sample time (the configurations train different global batches): the planner's pick against the best.
        per = lambda r, key: r[key] / (r["layout"][0] * r["microbatch_size"] * r["num_microbatches"])  # noqa: E731
        out["choice_vs_best_measured"] = per(best, "step_s") / per(chosen, "step_s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt_350m", "gpt_1.3b", "t5_770m"], choices=list(MODELS))
    parser.add_argument("--device", default=None, help="default: the current GPU; cpu: smoke test with gpt_tiny")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "planner_validate.json"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="profiler repeats per shape")
    parser.add_argument("--gpus", type=int, default=1, help="> 1: the multi-GPU validation (GPT-350M layouts)")
    ns = parser.parse_args()
    warnings.simplefilter("ignore")
    report = {"benchmark": "planner_validate", "models": {}}
    log_dir = Path(tempfile.mkdtemp(prefix="planner_validate_"))
    if ns.gpus > 1:
        report["multi_gpu"] = validate_multi(ns, log_dir)
        Path(ns.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {ns.out}")
        return
    for name in ns.models:
        model, preset, vocab, seq, target, sizes, configs = MODELS[name]
        cfg = config_dict(model, preset, vocab, seq, target)
        if ns.device == "cpu":
            cfg["trainer"]["precision"] = "32-true"
        started = time.perf_counter()
        doc = profile_model(cfg, device=ns.device, microbatch_sizes=sizes, seq_lens=[seq], target_lens=[target] if target else None,
                            repeats=ns.repeats, collectives=False, log=lambda *a: None)
        profile_s = time.perf_counter() - started
        profile_path = Path(ns.out).with_name(f"profile_{name}.json")
        profile_path.write_text(json.dumps(doc, allow_nan=False))
        cm = ProfiledCostModel(doc)
        cluster = ClusterSpec(1, 1, cm.device, 1e11, 1e10)
        rows = []
        for mbs, m, ckpt in configs:
            w = Workload(cm.shape, seq, mbs * m, cm, cluster, target_len=target)
            L = len(w.block_kinds())
            p = predict(Candidate(1, 1, 1, mbs, m, "1f1b", 1, (L,), (ckpt,), False), w)
            got = measure(model, preset, vocab, seq, target, mbs, m, ckpt, ns.steps, ns.warmup, log_dir, ns.device == "cpu")
            row = {"microbatch_size": mbs, "num_microbatches": m, "activation_checkpointing": ckpt,
                   "predicted_step_s": p.step_time, "predicted_peak_bytes": p.peak_memory, **got}
            if "step_s" in got:
                row["time_error"] = p.step_time / got["step_s"] - 1
                row["memory_error"] = p.peak_memory / got["peak_bytes"] - 1 if got["peak_bytes"] else None
            rows.append(row)
            print(json.dumps(row))
        ok = [r for r in rows if "step_s" in r]
        summary = {"profile_seconds": round(profile_s, 1), "configs": rows, "profile": str(profile_path)}
        if ok:
            summary["time_mape"] = sum(abs(r["time_error"]) for r in ok) / len(ok)
            errors = [abs(r["memory_error"]) for r in ok if r["memory_error"] is not None]
            summary["memory_max_abs_error"] = max(errors) if errors else None
            chosen = min(ok, key=lambda r: r["predicted_step_s"])
            best = min(ok, key=lambda r: r["step_s"])
            summary["planner_choice"] = {k: chosen[k] for k in ("microbatch_size", "num_microbatches", "activation_checkpointing")}
            summary["choice_vs_best_measured"] = best["step_s"] / chosen["step_s"]
        report["models"][name] = summary
        Path(ns.out).write_text(json.dumps(report, indent=1))
        print(f"{name}: profile {profile_s:.0f} s, MAPE {summary.get('time_mape')}, memory {summary.get('memory_max_abs_error')},"
              f" choice {summary.get('choice_vs_best_measured')}")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
