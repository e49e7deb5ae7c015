"""Throughput of compressed backpropagation's kernels (Optimus-CC Fig. 14) for 2.5B and 8.3B boundary shapes.

For each hidden size (1920: GPT-2.5B, 3072: GPT-8.3B), tokens per micro-batch and rank, it times the sender
(LEP add, one power step with a warm-started Q, fp32 QR, error update) and the receiver (P·Qᵀ) with CUDA
events, and compares them with sending the gradient uncompressed at the p2p bandwidths of benchmarks/CONVENTIONS.md.

    python benchmarks/compression/compression_kernels.py --out compression_kernels.json
    python benchmarks/compression/compression_kernels.py --device cpu --hidden 64 --tokens 128 --ranks 4 8 --repeats 3  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from lightning_3d.compression.backprop import CompressedBackprop, CompressedBackpropConfig  # noqa: E402
from lightning_3d.pipeline.codec import BoundaryKey  # noqa: E402

# Point-to-point bandwidths measured on a 4 x H200 host in each regime (benchmarks/CONVENTIONS.md), in GB/s.
P2P_GBPS = {"nvlink": 131.0, "ib": 23.0, "ethernet": 2.2}


def timed(fn, repeats: int, device: torch.device) -> list[float]:
    """Seconds per call, one sample per call, after two warm-up calls."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return samples


def measure(hidden: int, tokens: int, rank: int, dtype: torch.dtype, repeats: int, device: torch.device) -> dict:
    # epilogue_only=False: the key below is not a cool-down send, and every call must compress
    codec = CompressedBackprop(CompressedBackpropConfig(rank=rank, epilogue_only=False, min_compression_ratio=0.0))
    grads = [torch.randn(1, tokens, hidden, device=device, dtype=dtype) for _ in range(4)]  # rotate: no cache reuse
    meta = ((1, tokens, hidden), dtype)
    key = BoundaryKey(1, 0, False)
    state = {"i": 0}

    def encode():
        state["i"] = (state["i"] + 1) % len(grads)
        return codec.encode(grads[state["i"]], key)

    parts = encode()
    encode_s = timed(encode, repeats, device)
    decode_s = timed(lambda: codec.decode(parts, meta, key), repeats, device)
    raw_bytes = tokens * hidden * grads[0].element_size()
    sent_bytes = sum(p.numel() * p.element_size() for p in parts)
    enc, dec = statistics.median(encode_s), statistics.median(decode_s)
    row = {"hidden": hidden, "tokens": tokens, "rank": rank, "dtype": str(dtype).replace("torch.", ""),
           "raw_MB": raw_bytes / 1e6, "sent_MB": sent_bytes / 1e6, "ratio": raw_bytes / sent_bytes,
           "encode_ms": enc * 1e3, "encode_ms_p10_p90": [q * 1e3 for q in _p10_p90(encode_s)],
           "decode_ms": dec * 1e3, "decode_ms_p10_p90": [q * 1e3 for q in _p10_p90(decode_s)],
           "encode_GBps": raw_bytes / enc / 1e9}
    for regime, gbps in P2P_GBPS.items():  # time to move the gradient: as is, or compressed (+ both kernels)
        row[f"{regime}_speedup"] = (raw_bytes / gbps / 1e9) / (sent_bytes / gbps / 1e9 + enc + dec)
    return row


def _p10_p90(samples: list[float]) -> list[float]:
    ordered = sorted(samples)
    return [ordered[int(0.1 * (len(ordered) - 1))], ordered[int(0.9 * (len(ordered) - 1))]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[1920, 3072])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192], help="tokens per micro-batch")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 24, 32, 40])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("compression_kernels.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = [measure(h, n, r, dtype, args.repeats, device) for h in args.hidden for n in args.tokens for r in args.ranks]
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "command": " ".join(sys.argv), "p2p_GBps": P2P_GBPS}
    args.out.write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    print(f"{env['date_utc']}  torch {env['torch']}  {env['device']}  (speedup = uncompressed send / (compressed send + kernels))")
    print("hidden | tokens | rank | ratio | encode ms [p10-p90] | decode ms | enc GB/s | IB-like x | Ethernet x")
    for r in rows:
        print(f"{r['hidden']:6} | {r['tokens']:6} | {r['rank']:4} | {r['ratio']:5.1f} | {r['encode_ms']:7.3f} "
              f"[{r['encode_ms_p10_p90'][0]:.3f}-{r['encode_ms_p10_p90'][1]:.3f}] | {r['decode_ms']:7.3f} | "
              f"{r['encode_GBps']:7.1f} | {r['ib_speedup']:8.2f} | {r['ethernet_speedup']:9.2f}")


if __name__ == "__main__":
    main()
