"""Compute cost of selective stage compression (SC) per optimizer step: PyTorch's ``powerSGD_hook`` against ours.

Takes the gradients of pipeline stage 0 of a GPT preset (its blocks and embeddings), splits them into buckets as
the strategy does (``--bucket-mb``, in reverse registration order), and times one PowerSGD step over all buckets
on one GPU in a one-process group, so only compression and decompression are timed (the collectives are no-ops).
Both run at the same rank with error feedback and warm start; their time is what SC adds to a step before it
saves any bandwidth. The table also prints how long the uncompressed and compressed bytes take at the all-reduce
bandwidths of BENCHMARKING.md, so the break-even is visible.

    python benchmarks/sc_kernels.py --preset 350m --pp 2 --ranks 32 64 128 --out sc_kernels.json
    python benchmarks/sc_kernels.py --device cpu --preset tiny --ranks 4 --repeats 2   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.compression_kernels import timed  # noqa: E402
from lightning_3d.compression.selective import DataParallelPowerSGD, compression_sizes  # noqa: E402
from lightning_3d.recipes.gpt.config import preset  # noqa: E402
from lightning_3d.recipes.gpt.model import GPTModel  # noqa: E402

# All-reduce bus bandwidths measured on the lent 4 x H200 host (../shared/BENCHMARKING.md), GB/s.
ALLREDUCE_GBPS = {"nvlink": 346.0, "ib": 25.0, "ethernet": 3.8}


class TorchBucket:
    """The part of DDP's ``GradBucket`` that torch's ``powerSGD_hook`` reads."""

    def __init__(self, index: int, flat: torch.Tensor, shapes: list[torch.Size], is_last: bool) -> None:
        self.i, self.flat, self.last, self.views, offset = index, flat, is_last, [], 0
        for shape in shapes:
            self.views.append(flat[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()

    def buffer(self) -> torch.Tensor:
        return self.flat

    def index(self) -> int:
        return self.i

    def gradients(self) -> list[torch.Tensor]:
        return self.views

    def is_last(self) -> bool:
        return self.last


def stage_buckets(name: str, pp: int, bucket_mb: float) -> list[list[torch.Size]]:
    """Parameter shapes of pipeline stage 0 (embedding + its share of blocks), in the strategy's bucket order."""
    config = preset(name)
    with torch.device("meta"):
        model = GPTModel(config)
    model.prune(range(config.num_layers // pp), keep_embedding=True, keep_head=pp == 1)
    buckets, current, size = [], [], 0
    for p in reversed(list(model.parameters())):
        nbytes = p.numel() * 4
        if current and size + nbytes > bucket_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
        current.append(p.shape)
        size += nbytes
    return buckets + [current] if current else buckets


def measure(buckets: list[list[torch.Size]], rank: int, repeats: int, device: torch.device) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    flats = [torch.randn(sum(s.numel() for s in shapes), device=device) for shapes in buckets]
    theirs = PowerSGDState(dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                           use_error_feedback=True, warm_start=True, batch_tensors_with_same_shape=True)
    theirs.iter = 2  # past the warm-up: compress from the first call
    ours = DataParallelPowerSGD(dist.group.WORLD, rank=rank, warmup_steps=0)

    def step_torch() -> None:
        for i, (flat, shapes) in enumerate(zip(flats, buckets, strict=True)):
            powerSGD_hook(theirs, TorchBucket(i, flat.clone(), shapes, i == len(buckets) - 1)).wait()

    def step_ours() -> None:
        for i, (flat, shapes) in enumerate(zip(flats, buckets, strict=True)):
            ours.launch(i, flat.clone(), shapes, is_last=i == len(buckets) - 1).wait()

    before = sum(f.numel() * 4 for f in flats)
    after = sum(compression_sizes(s, rank, 2.0)[2] * 4 for shapes in buckets for s in shapes)
    row = {"rank": rank, "bytes_before": before, "bytes_after": after}
    for label, fn in (("torch_hook", step_torch), ("ours", step_ours)):
        samples = timed(fn, repeats, device)
        row[f"{label}_ms"] = 1e3 * statistics.median(samples)
        row[f"{label}_ms_spread"] = [1e3 * min(samples), 1e3 * max(samples)]
    # ring all-reduce over 2 replicas moves the buffer once per rank: bytes / bus bandwidth
    row["allreduce_ms"] = {k: {"uncompressed": before / bw / 1e6, "compressed": after / bw / 1e6}
                           for k, bw in ALLREDUCE_GBPS.items()}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="350m")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages: stage 0 holds 1/pp of the blocks")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--ranks", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
        buckets = stage_buckets(args.preset, args.pp, args.bucket_mb)
        rows = [measure(buckets, r, args.repeats, device) for r in args.ranks]
        dist.destroy_process_group()
    print(f"GPT-{args.preset} stage 0 of {args.pp}: {len(buckets)} buckets of <= {args.bucket_mb} MB, "
          f"{rows[0]['bytes_before'] / 1e6:.0f} MB of fp32 gradients, device {device}")
    print("rank | torch hook ms | ours ms | speedup | MB sent | all-reduce ms nvlink / ib / ethernet: plain -> compressed")
    for r in rows:
        ar = " / ".join(f"{v['uncompressed']:.1f}->{v['compressed']:.1f}" for v in r["allreduce_ms"].values())
        print(f"{r['rank']} | {r['torch_hook_ms']:.1f} | {r['ours_ms']:.1f} | {r['torch_hook_ms'] / r['ours_ms']:.1f}x"
              f" | {r['bytes_after'] / 1e6:.0f} | {ar}")
    if args.out:
        env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "nvls": os.environ.get("NCCL_NVLS_ENABLE")}
        args.out.write_text(json.dumps({"environment": env, "config": {k: str(v) for k, v in vars(args).items()},
                                        "results": rows}, indent=1))


if __name__ == "__main__":
    main()
