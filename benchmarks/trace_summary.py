"""Where the GPU time of a recorded step goes: a summary of a Chrome trace from ``peers.py --trace``.

Per trace: the span from the first to the last GPU kernel, the time some compute kernel runs (union over streams),
the time NCCL kernels run, the time only NCCL runs (communication not hidden behind compute), the idle time, and the
compute time by kernel family (cuBLAS GEMMs, attention, Triton from torch.compile, elementwise/copies, optimizer),
with the largest non-GEMM kernels named by the operator that launched them.

    python benchmarks/trace_summary.py peers_logs/00.trace.json.gz peers_logs/02.trace.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path

FAMILIES = (  # first match wins; lower-case substrings of kernel names
    ("gemm", ("gemm", "sm90_", "cutlass", "nvjet", "xmma")),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("optimizer", ("adam", "multi_tensor")),
    ("triton", ("triton",)),
    ("elementwise/copy/reduce", ("elementwise", "copy", "fill", "reduce", "cat")),
)


def family(name: str) -> str:
    lower = name.lower()
    return next((f for f, keys in FAMILIES if any(k in lower for k in keys)), "other")


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e3


def summarize(path: Path, top: int = 6) -> dict:
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"trace": str(path), "kernels": 0}
    is_nccl = [("nccl" in e["name"].lower()) for e in kernels]
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / 1e3
    compute = union_ms([(e["ts"], e["ts"] + e["dur"]) for e, n in zip(kernels, is_nccl) if not n])
    nccl = union_ms([(e["ts"], e["ts"] + e["dur"]) for e, n in zip(kernels, is_nccl) if n])
    busy = union_ms([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    by_family: Counter = Counter()
    launcher = _launching_ops(events)
    by_op: Counter = Counter()
    for e, n in zip(kernels, is_nccl):
        if n:
            continue
        fam = family(e["name"])
        by_family[fam] += e["dur"] / 1e3
        if fam not in ("gemm", "triton"):
            by_op[f"{launcher.get(e.get('args', {}).get('correlation'), '?')}: {e['name'][:70]}"] += e["dur"] / 1e3
    return {"trace": str(path), "kernels": len(kernels), "span_ms": span, "compute_ms": compute, "nccl_ms": nccl,
            "nccl_only_ms": busy - compute, "idle_ms": span - busy,
            "compute_by_family_ms": dict(by_family.most_common()), "largest_other_ms": dict(by_op.most_common(top))}


def _launching_ops(events: list[dict]) -> dict[int, str]:
    """Kernel correlation id -> the innermost CPU operator open at its launch (same thread), in one sweep per thread."""
    by_thread: dict[int, list[tuple[float, int, dict]]] = {}
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            by_thread.setdefault(e["tid"], []).append((e["ts"], 0, e))  # ops before launches at the same time
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            by_thread.setdefault(e["tid"], []).append((e["ts"], 1, e))
    found: dict[int, str] = {}
    for items in by_thread.values():
        items.sort(key=lambda item: (item[0], item[1], -item[2].get("dur", 0)))
        open_ops: list[dict] = []
        for ts, is_launch, e in items:
            while open_ops and open_ops[-1]["ts"] + open_ops[-1]["dur"] < ts:
                open_ops.pop()
            if is_launch:
                if open_ops:
                    found[e["args"]["correlation"]] = open_ops[-1]["name"]
            else:
                open_ops.append(e)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None, help="also write the summaries as JSON")
    args = p.parse_args()
    summaries = [summarize(t) for t in args.traces]
    for s in summaries:
        if not s["kernels"]:
            print(f"{s['trace']}: no GPU kernels (a CPU run?)")
            continue
        print(f"{s['trace']}: span {s['span_ms']:.1f} ms, compute {s['compute_ms']:.1f}, NCCL {s['nccl_ms']:.1f}"
              f" (only NCCL {s['nccl_only_ms']:.1f}), idle {s['idle_ms']:.1f}")
        for name, ms in s["compute_by_family_ms"].items():
            print(f"    {name:26s} {ms:8.1f} ms")
        for name, ms in s["largest_other_ms"].items():
            print(f"      {ms:7.1f}  {name}")
    if args.out:
        args.out.write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
