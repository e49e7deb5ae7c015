"""Search time of the planner (``lightning_3d.planner.search``) on large spaces, on this CPU; JSON to --out.

    python benchmarks/planner/planner_search.py --out planner_search.json

Cases: GPT with 96 layers on 64 GPUs (8 nodes of 8 H100s), and a 1,024-layer GPT on 64 GPUs (the goals:
<= 10 s and <= 60 s; Aceso reports ~246 s for its largest search). Costs from the analytic model (the search does
the same work on a profile). Each case reports the wall-clock seconds, the number of (dp, pp, tp, micro-batch,
schedule, virtual stages, compression) layouts, candidates evaluated, and the best configuration with its prediction.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings

from lightning_3d.costs import AnalyticCostModel, ClusterSpec, ModelShape, device_spec
from lightning_3d.planner import SearchOptions, Workload, search

CASES = {
    "gpt_96l_64gpu": (ModelShape("gpt", 96, 8192, 64, 4 * 8192, 51200), 2048, 512, 64),
    "gpt_1024l_64gpu": (ModelShape("gpt", 1024, 2048, 16, 4 * 2048, 51200), 2048, 512, 64),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="planner_search.json")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--time-budget", type=float, default=600.0, help="search budget (s); the goal is far below")
    ns = parser.parse_args()
    warnings.simplefilter("ignore")
    results = []
    for name in ns.cases:
        shape, seq, batch, gpus = CASES[name]
        cluster = ClusterSpec(gpus // 8, 8, device_spec("h100"), 450e9, 50e9)
        w = Workload(shape, seq, batch, AnalyticCostModel(shape, cluster.device), cluster)
        start = time.perf_counter()
        r = search(w, gpus, SearchOptions(time_budget_s=ns.time_budget))
        seconds = time.perf_counter() - start
        best = r.top[0].summary() if r.top else None
        results.append({"case": name, "layers": shape.num_layers, "gpus": gpus, "seconds": round(seconds, 3),
                        "layouts": r.skeletons, "candidates": r.evaluated, "truncated": r.truncated, "best": best})
        print(f"{name}: {seconds:.2f} s, {r.skeletons} layouts, {r.evaluated} candidates"
              + (f"; best dp={best['dp']} pp={best['pp']} tp={best['tp']} {best['schedule']} v={best['virtual_stages']}"
                 f" mbs={best['microbatch_size']} m={best['num_microbatches']}: {best['step_time_s']:.3f} s" if best else ""))
    doc = {"benchmark": "planner_search", "python": platform.python_version(), "machine": platform.machine(),
           "processor": platform.processor(), "results": results}
    with open(ns.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
