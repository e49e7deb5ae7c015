"""One GEMM of GPT-1.3B's training step at a time, in each operand layout, alignment and kind of data it can meet.

The recipe's model and a plain GPT run the same cuBLAS kernels by name and count, some slower per call in one of
them. This script times each GEMM shape of a GPT block and head at micro-batch x sequence rows (forward ``x @ W.T``,
the input gradient ``dy @ W``, the weight gradient ``dy.T @ x``) in the layouts a model can hand cuBLAS (contiguous,
a weight stored transposed, a column slice of a fused q/k/v output, the head over an unaligned vocabulary) and on
several kinds of data (standard normal, weights of init scale, values with few mantissa bits, zeros), each run
back to back for ``--seconds`` so the GPU reaches the clock it holds under sustained load, with the SM clock and power
sampled meanwhile (benchmarks/tools/gpu_clocks.py). Prints one row per case: ms per call, TFLOP/s, median SM MHz, watts.

    python benchmarks/speed/gemm_layouts.py --out gemm.json
    python benchmarks/speed/gemm_layouts.py --tokens 256 --hidden 64 --seconds 0.05   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
from benchmarks.tools.gpu_clocks import ClockSampler  # noqa: E402


def data(kind: str, shape: tuple[int, ...], device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """bf16 operands: "normal" N(0, scale), "uniform" U(-scale, scale) (PyTorch's default linear init), "coarse" N(0,
    scale) rounded to 2 mantissa bits, "repeated" one N(0, scale) row repeated in every row, "zeros"."""
    if kind == "zeros":
        return torch.zeros(shape, device=device, dtype=torch.bfloat16)
    if kind == "repeated":
        return (torch.randn(shape[-1], device=device) * scale).to(torch.bfloat16).expand(shape).contiguous()
    if kind == "uniform":
        return ((torch.rand(shape, device=device) * 2 - 1) * scale).to(torch.bfloat16)
    x = torch.randn(shape, device=device) * scale
    if kind == "coarse":
        m, e = torch.frexp(x)
        x = torch.ldexp(torch.round(m * 4) / 4, e)
    return x.to(torch.bfloat16)


def cases(tokens: int, hidden: int, vocab: int):
    """(name, flops, thunk builder) of each case; builders allocate their operands on call."""
    f = 4 * hidden

    def linear(rows: int, k: int, n: int, kind: str = "normal", wt: bool = False, xslice: bool = False,
               wscale: float = 0.02):
        def build(device):
            x = data(kind, (rows, 3 * k if xslice else k), device)
            x = x[:, k:2 * k] if xslice else x  # a column slice: leading dimension 3k, as q/k/v views of one output
            w = data(kind, (k, n) if wt else (n, k), device, wscale)
            w = w.t() if wt else w  # (n, k) either way; stored transposed when wt
            return lambda: torch.nn.functional.linear(x, w)
        return build

    def dgrad(rows: int, k: int, n: int, kind: str = "normal"):
        def build(device):
            dy, w = data(kind, (rows, n), device, 1e-3), data(kind, (n, k), device, 0.02)
            return lambda: dy @ w
        return build

    def wgrad(rows: int, k: int, n: int, kind: str = "normal"):
        def build(device):
            dy, x = data(kind, (rows, n), device, 1e-3), data(kind, (rows, k), device)
            return lambda: dy.t() @ x
        return build

    mm = lambda rows, k, n: 2.0 * rows * k * n  # noqa: E731
    out = []
    for kind in ("normal", "uniform", "coarse", "repeated", "zeros"):
        out.append((f"fc fwd {kind}", mm(tokens, hidden, f), linear(tokens, hidden, f, kind)))
    out += [
        ("fc fwd normal W(0,1)", mm(tokens, hidden, f), linear(tokens, hidden, f, wscale=1.0)),
        ("fc fwd W stored transposed", mm(tokens, hidden, f), linear(tokens, hidden, f, wt=True)),
        ("fc dgrad", mm(tokens, hidden, f), dgrad(tokens, hidden, f)),
        ("fc wgrad", mm(tokens, hidden, f), wgrad(tokens, hidden, f)),
        ("mlp proj fwd", mm(tokens, f, hidden), linear(tokens, f, hidden)),
        ("mlp proj dgrad", mm(tokens, f, hidden), dgrad(tokens, f, hidden)),
        ("mlp proj wgrad", mm(tokens, f, hidden), wgrad(tokens, f, hidden)),
        ("q fwd (separate)", mm(tokens, hidden, hidden), linear(tokens, hidden, hidden)),
        ("qkv fwd (fused 3h)", mm(tokens, hidden, 3 * hidden), linear(tokens, hidden, 3 * hidden)),
        ("o fwd, input a column slice", mm(tokens, hidden, hidden), linear(tokens, hidden, hidden, xslice=True)),
    ]
    aligned = -(-vocab // 64) * 64
    for v in sorted({vocab, aligned}):
        out += [(f"head fwd V={v}", mm(tokens, hidden, v), linear(tokens, hidden, v)),
                (f"head dgrad V={v}", mm(tokens, hidden, v), dgrad(tokens, hidden, v)),
                (f"head wgrad V={v}", mm(tokens, hidden, v), wgrad(tokens, hidden, v))]
    return out


def time_case(thunk, seconds: float, device: torch.device, sampler: ClockSampler | None) -> dict:
    for _ in range(3):
        thunk()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start, calls = time.perf_counter(), 0
    if sampler:
        sampler.samples.clear()
        sampler.start()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            thunk()
        calls += 10
        sync()
    elapsed = time.perf_counter() - start
    if sampler:
        sampler.stop()
    row = {"ms": 1e3 * elapsed / calls, "calls": calls}
    if sampler and sampler.samples:
        clocks = sorted(s[0] for s in sampler.samples)
        power = sorted(s[1] for s in sampler.samples)
        row.update(sm_mhz=clocks[len(clocks) // 2], watts=power[len(power) // 2])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16 * 2048, help="GEMM rows: micro-batch x sequence")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seconds", type=float, default=1.5, help="sustained run per case")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sampler = ClockSampler(torch.cuda.current_device(), 0.005) if device.type == "cuda" else None
    sampler = sampler if sampler is not None and sampler._nvml is not None else None
    if device.type == "cuda":  # the clock a sustained load settles at, before the first case
        time_case(cases(args.tokens, args.hidden, args.vocab)[0][2](device), 3 * args.seconds, device, None)
    rows = []
    print(f"tokens {args.tokens}, hidden {args.hidden}, vocab {args.vocab}, {args.seconds} s per case,"
          f" {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print("case | ms/call | TFLOP/s | SM MHz | W")
    for name, flops, build in cases(args.tokens, args.hidden, args.vocab):
        row = {"case": name, **time_case(build(device), args.seconds, device, sampler)}
        row["tflops"] = flops / row["ms"] / 1e9
        rows.append(row)
        print(f"{name} | {row['ms']:.3f} | {row['tflops']:.1f} | {row.get('sm_mhz', '-')} | {row.get('watts', '-')}",
              flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
