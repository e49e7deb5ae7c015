"""Where the GPU time of a recorded step goes: a summary of a Chrome trace from ``peers.py --trace``.

Per trace: the span from the first to the last GPU kernel, the time some compute kernel runs (union over streams),
the time NCCL kernels run, the time only NCCL runs (communication not hidden behind compute), the idle time, and the
compute time by kernel family (cuBLAS GEMMs, attention, Triton from torch.compile, elementwise/copies, optimizer),
with the largest non-GEMM kernels named by the operator that launched them. ``--gaps N``: the N longest stretches
the GPU idled between kernels, each with the operator that launched the kernel after it, how late the host issued
that kernel, and what the host ran meanwhile (its operators, and its waits on the device: ``cudaStreamSynchronize``
and the other synchronising calls of ``WAITS``); and every such wait, by the operator that waited. A device-bound
step whose measured time exceeds its kernels' sum loses the difference in these gaps.

    python benchmarks/tools/trace_summary.py peers_logs/00.trace.json.gz peers_logs/02.trace.json.gz
    python benchmarks/tools/trace_summary.py --gaps 12 peers_logs/00.trace.json.gz
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


#: host runtime calls that block until the device is done (an ``item`` is an asynchronous copy and one of these)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def summarize(path: Path, top: int = 6, gaps: int = 0) -> dict:
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
    out = {"trace": str(path), "kernels": len(kernels), "span_ms": span, "compute_ms": compute, "nccl_ms": nccl,
           "nccl_only_ms": busy - compute, "idle_ms": span - busy,
           "compute_by_family_ms": dict(by_family.most_common()), "largest_other_ms": dict(by_op.most_common(top))}
    if gaps:
        out.update(idle_gaps(events, kernels, launcher, gaps))
    return out


def idle_gaps(events: list[dict], kernels: list[dict], launcher: dict[int, str], n: int) -> dict:
    """The ``n`` longest idle stretches between kernels (any stream) and the host's waits on the device.

    Per gap: its length; the kernel after it, by launching operator; ``issued_late_ms``, how long after the gap began
    the host issued that kernel (about the gap's length: the host was late, busy with the operators listed; near
    zero: the kernel waited on something else, e.g. an event); the host's operators during the gap, by their
    milliseconds inside it (not those that span far more than the gap), and its waits on the device there."""
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"), key=lambda e: e["ts"])
    waits = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
             and e["name"] in WAITS and e.get("dur", 0) > 0]
    order = sorted(kernels, key=lambda e: e["ts"])
    found, end, before = [], order[0]["ts"] + order[0]["dur"], order[0]
    for k in order[1:]:
        if k["ts"] > end:
            found.append((k["ts"] - end, end, before, k))
        if k["ts"] + k["dur"] >= end:
            end, before = k["ts"] + k["dur"], k
    rows = []
    for length, start, before, after in sorted(found, key=lambda g: -g[0])[:n]:
        stop = start + length
        launch = runtime.get(after.get("args", {}).get("correlation"))
        # The host's operators during the gap, by their time inside it; one that spans far more than the gap (a
        # training step, an optimizer step) says nothing about it.
        inside = [(min(stop, e["ts"] + e.get("dur", 0)) - max(start, e["ts"]), e) for e in ops
                  if e["ts"] < stop and e["ts"] + e.get("dur", 0) > start
                  and not (e["ts"] <= start and e["ts"] + e.get("dur", 0) >= stop and e.get("dur", 0) > 4 * length)]
        inside.sort(key=lambda t: -t[0])
        rows.append({"ms": length / 1e3, "at_ms": (start - order[0]["ts"]) / 1e3,
                     "after": launcher.get(before.get("args", {}).get("correlation"), "?"),
                     "before": launcher.get(after.get("args", {}).get("correlation"), "?"),
                     "issued_late_ms": None if launch is None else (launch["ts"] - start) / 1e3,
                     "host_ops": [f"{e['name']} {t / 1e3:.2f}" for t, e in inside[:5]],
                     "host_waits": [f"{w['name']} {w['dur'] / 1e3:.2f}" for w in waits
                                    if w["ts"] < stop and w["ts"] + w["dur"] > start]})
    by_waiter: Counter = Counter()
    for w in waits:
        by_waiter[f"{w['name']} in {launcher.get(w.get('args', {}).get('correlation'), '?')}"] += 1
    return {"gaps": rows, "gaps_total_ms": sum(g[0] for g in found) / 1e3,
            "gaps_over_0.1ms": sum(g[0] > 100 for g in found), "waits": dict(by_waiter.most_common())}


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
    p.add_argument("--gaps", type=int, default=0, help="also the N longest idle gaps and the host's waits")
    args = p.parse_args()
    summaries = [summarize(t, gaps=args.gaps) for t in args.traces]
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
        if "gaps" in s:
            print(f"  idle between kernels: {s['gaps_total_ms']:.1f} ms in all, {s['gaps_over_0.1ms']} gaps over"
                  " 0.1 ms; the longest:")
            for g in s["gaps"]:
                late = "?" if g["issued_late_ms"] is None else f"{g['issued_late_ms']:.2f}"
                print(f"    {g['ms']:7.2f} ms at {g['at_ms']:8.1f}: after {g['after']}, before {g['before']} (issued"
                      f" {late} ms into the gap); host: {'; '.join(g['host_ops']) or '-'}"
                      + (f"; waits: {'; '.join(g['host_waits'])}" if g["host_waits"] else ""))
            print("  host waits on the device: " + ("; ".join(f"{k} x{v}" for k, v in s["waits"].items()) or "none"))
    if args.out:
        args.out.write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
