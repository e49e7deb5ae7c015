"""Planning time of dynamic micro-batching (``lightning_3d.dynamic.plan_step``) on one CPU core, for global batches
of about ``--tokens`` tokens with a long-tailed (log-normal) length distribution, GPT-1.3B shape by default.

Prints one JSON document: per layout the median / min / max planning milliseconds over ``--repeats`` batches (wall
clock and this process's CPU time, which a loaded machine inflates less), the
plan's micro-batch count and its predicted step time against padding the batch to its longest sample (same cost
model). Pin it to one core (``taskset -c 0``) and set ``OMP_NUM_THREADS=1``; the goal is <= 200 ms per
65,536-token batch. The cost model is ``--profile`` (a measured profile, for its model) or the analytic one
(``lightning_3d.costs.AnalyticCostModel``) when present,
otherwise a FLOP-count stand-in defined here (reported as ``cost_model``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from lightning_3d.costs.model import ModelShape
from lightning_3d.dynamic import plan_step
from lightning_3d.dynamic.plan import default_cost_model

GPT_1_3B = ModelShape("gpt", num_layers=24, hidden_size=2048, num_heads=16, ffn_hidden_size=8192, vocab_size=50304)


class FlopStandIn:
    """6·params·tokens plus attention's 4·s²·h per layer at 40 % of 312 TFLOP/s; 34·h·s·b bytes stored per layer
    (Korthikanti et al., no recomputation; 2·h·s·b under full recomputation). Only for timing the planner."""

    source = "flop-stand-in"

    def __init__(self, shape: ModelShape) -> None:
        self.h, self.f, self.v = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size

    def layer_time(self, kind, microbatch_size, seq_len, *, target_len=None, recompute=False, tp=1):
        b, s = np.asarray(microbatch_size, float), np.asarray(seq_len, float)
        h = self.h
        if kind == "embedding":
            flops = 2 * b * s * h
        elif kind == "head":
            flops = 2 * b * s * h * self.v
        else:
            flops = 2 * b * s * (4 * h * h + 2 * h * self.f) + 4 * b * s * s * h
        fwd = flops / tp / (0.4 * 312e12) + 20e-6
        return fwd, 2 * fwd + (fwd if recompute else 0)

    def layer_memory(self, kind, microbatch_size, seq_len, *, target_len=None, recompute=False, tp=1):
        b, s = np.asarray(microbatch_size, float), np.asarray(seq_len, float)
        per_token = (2 if recompute else 34) * self.h if kind != "head" else 4 * self.v
        stored = b * s * per_token / tp
        return stored, stored + 4 * b * s * self.h


def batch(rng: np.random.Generator, tokens: int, median: float, sigma: float, cap: int) -> np.ndarray:
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(min(cap, max(1, rng.lognormal(np.log(median), sigma)))))
    return np.array(lengths)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--median", type=float, default=120.0)
    parser.add_argument("--sigma", type=float, default=1.1)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--memory-budget", type=float, default=40e9, help="activation bytes per GPU")
    parser.add_argument("--layouts", nargs="+", default=["1,1", "1,4", "2,2", "1,2,interleaved"],
                        help="dp,pp[,interleaved]")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compact", action="store_true", help="one JSON line per layout")
    parser.add_argument("--profile", default=None, help="a profile file (default: the analytic cost model)")
    args = parser.parse_args(argv)
    shape = GPT_1_3B
    if args.profile:  # a measured profile (``lightning-3d profile``), planned for its own model
        from lightning_3d.costs import ProfiledCostModel

        cost_model = ProfiledCostModel(args.profile)
        shape = cost_model.shape
    else:
        try:
            cost_model = default_cost_model(shape)
        except ImportError:
            cost_model = FlopStandIn(shape)
    rng = np.random.default_rng(args.seed)
    batches = [batch(rng, args.tokens, args.median, args.sigma, args.max_seq_len) for _ in range(args.repeats)]
    results = []
    for layout in args.layouts:
        parts = layout.split(",")
        dp, pp = int(parts[0]), int(parts[1])
        interleaved = len(parts) > 2
        kw = dict(cost_model=cost_model, shape=shape, dp=dp, pp=pp, memory_budget=args.memory_budget,
                  max_seq_len=args.max_seq_len, schedule="interleaved_1f1b" if interleaved else "1f1b",
                  virtual_stages=2 if interleaved else 1)
        plan_step(batches[0], **kw)  # warm caches (schedule builders)
        ms, cpu_ms, counts, speedups = [], [], [], []
        for lengths in batches:
            start, cpu = time.perf_counter(), time.process_time()
            plan = plan_step(lengths, **kw)
            ms.append(1000 * (time.perf_counter() - start))
            cpu_ms.append(1000 * (time.process_time() - cpu))
            counts.append(sum(len(r.microbatches) for r in plan.replicas))
            try:  # the comparison only: every sample padded to the longest may fit no plan (memory, a profile's grid)
                padded = plan_step(np.full(len(lengths), lengths.max()), **kw)
                speedups.append(padded.makespan / plan.makespan)
            except ValueError:
                speedups.append(np.nan)
        results.append({"dp": dp, "pp": pp, "schedule": kw["schedule"], "samples_mean": float(np.mean([len(b) for b in batches])),
                        "plan_ms": {"median": statistics.median(ms), "min": min(ms), "max": max(ms)},
                        "plan_cpu_ms": {"median": statistics.median(cpu_ms), "min": min(cpu_ms), "max": max(cpu_ms)},
                        "microbatches_mean": float(np.mean(counts)),
                        "predicted_speedup_over_padding_to_longest": float(np.nanmean(speedups))
                        if not np.all(np.isnan(speedups)) else None})
    report = {"tokens_per_batch": args.tokens, "median_length": args.median, "sigma": args.sigma,
              "load_average": os.getloadavg()[0] if hasattr(os,
                                                            "getloadavg") else None, "cost_model": cost_model.source,
                                                            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
              "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
              "results": results}
    if args.compact:  # one line per layout
        print(json.dumps({k: v for k, v in report.items() if k != "results"}))
        for r in results:
            print(json.dumps({"dp": r["dp"], "pp": r["pp"], "schedule": r["schedule"], "samples": r["samples_mean"],
                              "plan_cpu_ms_median": round(r["plan_cpu_ms"]["median"], 1),
                              "plan_cpu_ms_max": round(r["plan_cpu_ms"]["max"], 1),
                              "microbatches": r["microbatches_mean"]}))
    else:
        print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
