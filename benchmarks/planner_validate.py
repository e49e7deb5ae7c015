"""One-GPU validation of the planner's cost model: profile GPT-350M, GPT-1.3B and T5-770M on this GPU, predict the
step time and peak memory of one-GPU configurations (micro-batch size and count, activation checkpointing), measure
them with benchmarks/train_throughput.py (fresh processes, synthetic data, bf16-mixed), and compare. JSON to
``$OUT/planner_validate.json`` (or --out).

    python benchmarks/planner_validate.py --models gpt_350m gpt_1.3b   # ~ 6 GPU-minutes on an H100
    python benchmarks/planner_validate.py --models t5_770m --out "$OUT/planner_validate_t5.json"

Per model: the profile's cost (seconds; the goal is <= 10 GPU-minutes for the three), and per configuration the
predicted and measured step time and peak memory (``torch.cuda.max_memory_allocated``) with their errors; per
model the time MAPE, the worst memory error, and the planner's choice (the configuration it predicts fastest)
against the best measured one (goal: >= 97 % of its throughput). Every configuration of a model trains the same
global batch, so their throughputs compare.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt_350m", "gpt_1.3b", "t5_770m"], choices=list(MODELS))
    parser.add_argument("--device", default=None, help="default: the current GPU; cpu: smoke test with gpt_tiny")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "planner_validate.json"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="profiler repeats per shape")
    ns = parser.parse_args()
    warnings.simplefilter("ignore")
    report = {"benchmark": "planner_validate", "models": {}}
    log_dir = Path(tempfile.mkdtemp(prefix="planner_validate_"))
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
