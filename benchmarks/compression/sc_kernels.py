"""Compute cost of selective stage compression (SC) per optimizer step: PyTorch's ``powerSGD_hook`` against ours.

Takes the gradients of pipeline stage 0 of a GPT preset (its blocks and embeddings) and times one PowerSGD step over
all of them on one GPU in a one-process group, so only compression and decompression are timed (the collectives are
no-ops): torch's hook over the DDP-style buckets the strategy makes for an exact stage (``--bucket-mb``, reverse
registration order), ours over the one the strategy makes for an SC stage (same shapes adjacent).
Both run at the same rank with error feedback and warm start; their time is what SC adds to a step before it
saves any bandwidth. The table also prints how long the uncompressed and compressed bytes take at the all-reduce
bandwidths of benchmarks/CONVENTIONS.md, so the break-even is visible.

    python benchmarks/compression/sc_kernels.py --preset 350m --pp 2 --ranks 32 64 128 --out sc_kernels.json
    python benchmarks/compression/sc_kernels.py --device cpu --preset tiny --ranks 4 --repeats 2   # smoke
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks.compression.compression_kernels import timed  # noqa: E402
from lightning_3d.compression.selective import DataParallelPowerSGD, compression_sizes  # noqa: E402
from lightning_3d.distributed.grad_sync import GradientSynchronizer  # noqa: E402
from lightning_3d.recipes.gpt.config import preset  # noqa: E402
from lightning_3d.recipes.gpt.model import GPTModel  # noqa: E402

# All-reduce bus bandwidths measured on a 4 x H200 host in each regime (benchmarks/CONVENTIONS.md), GB/s.
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


def stage_parameters(name: str, pp: int) -> list[torch.nn.Parameter]:
    """Parameters (on the meta device) of pipeline stage 0: the embedding and its share of the blocks."""
    config = preset(name)
    with torch.device("meta"):
        model = GPTModel(config)
    model.prune(range(config.num_layers // pp), keep_embedding=True, keep_head=pp == 1)
    return list(model.parameters())


def synchronizer_buckets(params: list[torch.nn.Parameter], bucket_mb: float, compressed: bool) -> list[list[torch.Size]]:
    """Parameter shapes in the buckets our gradient synchronizer makes for a stage: an exact stage's are DDP-style
    (reverse registration order, at most ``bucket_mb`` each, what torch's hook would get), an SC stage's one bucket
    with same shapes adjacent."""
    sync = GradientSynchronizer({0: params}, dp_group=None, dp_size=1, bucket_size_mb=bucket_mb,
                                compressed_stages={0} if compressed else set())
    sync.remove_hooks()
    return [[p.shape for p in b.params] for b in sync.buckets]


def precision_effect(flat: torch.Tensor, shapes: list[torch.Size], rank: int) -> dict:
    """One PowerSGD step from the same state and input with TF32 and with IEEE fp32 products: how far apart the two
    results are, next to how far either is from its input (what rank ``rank`` leaves out, carried by error feedback)."""
    out = {}
    for precision in ("tf32", "fp32"):
        sc = DataParallelPowerSGD(dist.group.WORLD, rank=rank, warmup_steps=0, seed=0, matmul_precision=precision)
        out[precision] = sc.launch(0, flat.clone(), shapes, is_last=True).wait()
    return {"tf32_vs_fp32": float((out["tf32"] - out["fp32"]).norm() / out["fp32"].norm()),
            "compression_error": float((flat - out["fp32"]).norm() / flat.norm())}


def measure(torch_buckets: list[list[torch.Size]], our_buckets: list[list[torch.Size]], rank: int, repeats: int,
            device: torch.device, profile: bool = False) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    torch_flats = [torch.randn(sum(s.numel() for s in shapes), device=device) for shapes in torch_buckets]
    our_flats = [torch.randn(sum(s.numel() for s in shapes), device=device) for shapes in our_buckets]
    theirs = PowerSGDState(dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                           use_error_feedback=True, warm_start=True, batch_tensors_with_same_shape=True)
    theirs.iter = 2  # past the warm-up: compress from the first call
    ours = DataParallelPowerSGD(dist.group.WORLD, rank=rank, warmup_steps=0)  # the default: TF32 products
    ours_fp32 = DataParallelPowerSGD(dist.group.WORLD, rank=rank, warmup_steps=0, matmul_precision="fp32")

    def step_torch() -> None:
        for i, (flat, shapes) in enumerate(zip(torch_flats, torch_buckets, strict=True)):
            powerSGD_hook(theirs, TorchBucket(i, flat.clone(), shapes, i == len(torch_buckets) - 1)).wait()

    def step_ours(compressor: DataParallelPowerSGD = ours) -> None:
        for i, (flat, shapes) in enumerate(zip(our_flats, our_buckets, strict=True)):
            compressor.launch(i, flat.clone(), shapes, is_last=i == len(our_buckets) - 1).wait()

    before = sum(f.numel() * 4 for f in our_flats)
    after = sum(compression_sizes(s, rank, 2.0)[2] * 4 for shapes in our_buckets for s in shapes)
    row = {"rank": rank, "bytes_before": before, "bytes_after": after,
           "buckets": {"torch_hook": len(torch_buckets), "ours": len(our_buckets)}}
    for label, fn in (("torch_hook", step_torch), ("ours", step_ours), ("ours_fp32", lambda: step_ours(ours_fp32))):
        samples = timed(fn, repeats, device)
        row[f"{label}_ms"] = 1e3 * statistics.median(samples)
        row[f"{label}_ms_spread"] = [1e3 * min(samples), 1e3 * max(samples)]
    if profile:  # where our step's time goes, by kernel and by host-side operator
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            step_ours()
            if device.type == "cuda":
                torch.cuda.synchronize()
        averages = prof.key_averages()
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"PROFILE rank {rank}, one step of ours, by {sort}\n" + averages.table(sort_by=sort, row_limit=15)
              + "\nby CPU time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    row["precision_effect"] = precision_effect(our_flats[0], our_buckets[0], rank)
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
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step of ours")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1,
                                **({"device_id": torch.device("cuda", 0)} if device.type == "cuda" else {}))
        params = stage_parameters(args.preset, args.pp)
        torch_buckets, our_buckets = (synchronizer_buckets(params, args.bucket_mb, sc) for sc in (False, True))
        rows = [measure(torch_buckets, our_buckets, r, args.repeats, device, args.profile) for r in args.ranks]
        dist.destroy_process_group()
    print(f"GPT-{args.preset} stage 0 of {args.pp}: {rows[0]['bytes_before'] / 1e6:.0f} MB of fp32 gradients; torch's"
          f" hook over {len(torch_buckets)} DDP buckets of <= {args.bucket_mb} MB, ours over {len(our_buckets)}"
          f" (the strategy's SC layout); device {device}")
    print("rank | torch hook ms | ours ms (TF32, default) | ours ms (fp32) | hook / ours | TF32 vs fp32 result |"
          " compression error | MB sent | all-reduce ms nvlink / ib / ethernet: plain -> compressed")
    for r in rows:
        ar = " / ".join(f"{v['uncompressed']:.1f}->{v['compressed']:.1f}" for v in r["allreduce_ms"].values())
        effect = r["precision_effect"]
        print(f"{r['rank']} | {r['torch_hook_ms']:.1f} | {r['ours_ms']:.1f} | {r['ours_fp32_ms']:.1f}"
              f" | {r['torch_hook_ms'] / r['ours_ms']:.1f}x | {effect['tf32_vs_fp32']:.1e} | {effect['compression_error']:.3f}"
              f" | {r['bytes_after'] / 1e6:.0f} | {ar}")
    if args.out:
        env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "nvls": os.environ.get("NCCL_NVLS_ENABLE")}
        args.out.write_text(json.dumps({"environment": env, "config": {k: str(v) for k, v in vars(args).items()},
                                        "results": rows}, indent=1))


if __name__ == "__main__":
    main()
