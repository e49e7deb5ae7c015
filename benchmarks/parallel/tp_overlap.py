"""One column-parallel GEMM's forward and backward at tp = 2 (or ``--nproc``), with and without the backward overlap
of ``column_parallel_linear`` (docs/tensor_parallel.md): the input gradient's all-reduce (reduce-scatter under
sequence parallelism) launched after the dgrad GEMM and waited for after the wgrad GEMM, against the synchronous
path (``copy_to_region`` / ``gather_sequence`` then ``F.linear``, what ``L3D_TP_OVERLAP=0`` runs).

For each layer shape of the GPT preset (q/k/v fused: hidden -> 3 x hidden; the MLP's first layer: hidden -> 4 x hidden),
with sequence parallelism off and on (and under SP the overlapped path a second time with ``regather``: this rank's
chunk of the input saved, all-gathered again in the backward), each rank times ``--iters`` forward and backward passes
after ``--warmup`` (CUDA events on GPUs, wall clock between barriers on CPU), counts the bytes the forward saves for the
backward (``saved_tensors_hooks``, exact), and checks that both paths give the same output and gradients (bitwise: the
same operations in another order). Rank 0 prints one row per run and writes JSON.

    python benchmarks/parallel/tp_overlap.py                                  # 2 GPUs, GPT-1.3B shapes, 8 x 2048 tokens
    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/parallel/tp_overlap.py    # kernels started in issue order (Megatron's)
    python benchmarks/parallel/tp_overlap.py --device cpu --preset tiny --seq-length 16 --micro-batch-size 2 --iters 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, fp32 (a smoke test)")
    p.add_argument("--nproc", type=int, default=2, help="tensor-parallel size (processes, one GPU each)")
    p.add_argument("--preset", default="1.3b", help="GPT preset whose hidden size sets the shapes")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=20, help="timed forward + backward passes per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("tp_overlap.json"))
    return p.parse_args(argv)


def run_one(layer: str, out_features: int, sp: bool, overlap: bool, args: argparse.Namespace, mesh,
            hidden: int, regather: bool = False) -> tuple[dict, list[torch.Tensor]]:
    from torch.autograd.graph import saved_tensors_hooks

    from lightning_3d.tensor_parallel import TensorParallel, column_parallel_linear

    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = TensorParallel(mesh, sp, overlap=overlap, regather=regather)
    b, s = args.micro_batch_size, args.seq_length
    # The same tensors for both paths; every rank its own (its shard of the weight, its chunk of the sequence).
    g = torch.Generator(device).manual_seed(1000 + rank)
    x = torch.randn(b, s // world if sp else s, hidden, generator=g, device=device, dtype=dtype)
    weight = torch.randn(out_features // world, hidden, generator=g, device=device, dtype=dtype) * hidden ** -0.5
    bias = torch.randn(out_features // world, generator=g, device=device, dtype=dtype)
    grad = torch.randn(b, s, out_features // world, generator=g, device=device, dtype=dtype)
    leaves = [t.requires_grad_() for t in (x, weight, bias)]

    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        column_parallel_linear(x, weight, bias, tp)
    forward_ms, backward_ms = [], []
    for i in range(args.warmup + args.iters):
        for t in leaves:
            t.grad = None
        if args.device == "cuda":
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
            y = column_parallel_linear(x, weight, bias, tp)
            mid.record()
            y.backward(grad)
            end.record()
            torch.cuda.synchronize()
            times = (start.elapsed_time(mid), mid.elapsed_time(end))
        else:
            dist.barrier()
            t0 = time.perf_counter()
            y = column_parallel_linear(x, weight, bias, tp)
            t1 = time.perf_counter()
            y.backward(grad)
            t2 = time.perf_counter()
            times = ((t1 - t0) * 1e3, (t2 - t1) * 1e3)
        if i >= args.warmup:
            forward_ms.append(times[0])
            backward_ms.append(times[1])
    result = {"layer": layer, "in_features": hidden, "out_features": out_features, "sequence_parallel": sp,
              "overlap": overlap, "regather": regather, "tokens": b * s, "dtype": str(dtype).removeprefix("torch."),
              "forward_ms": statistics.median(forward_ms), "backward_ms": statistics.median(backward_ms),
              "backward_ms_min": min(backward_ms), "saved_bytes": saved[0]}
    return result, [y.detach()] + [t.grad for t in leaves]


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.recipes.gpt.config import preset

    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (world,))
    hidden = preset(args.preset).hidden_size
    results = []
    if rank == 0:
        print(f"{'layer':<5} {'SP':<3} {'overlap':<8} {'fwd ms':>8} {'bwd ms':>8} {'bwd vs sync':>11} {'saved MiB':>9}"
              f"  same output and gradients as sync", flush=True)
    for layer, out_features in (("qkv", 3 * hidden), ("fc", 4 * hidden)):
        for sp in (False, True):
            variants = [(False, False), (True, False)] + ([(True, True)] if sp else [])
            runs = [run_one(layer, out_features, sp, overlap, args, mesh, hidden, regather)
                    for overlap, regather in variants]
            sync, sync_tensors = runs[0]
            for r, tensors in runs:
                equal = all(torch.equal(a, b) for a, b in zip(sync_tensors, tensors))
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(sync_tensors, tensors))
                # Every rank's verdict: a difference on any rank counts.
                verdict = torch.tensor([0.0 if equal else 1.0, diff], device=sync_tensors[0].device)
                dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
                r["equal_to_sync"], r["max_abs_diff_to_sync"] = bool(verdict[0].item() == 0), verdict[1].item()
                results.append(r)
                if rank == 0:
                    mode = ("regather" if r["regather"] else "on") if r["overlap"] else "off"
                    print(f"{layer:<5} {'on' if sp else 'off':<3} {mode:<8}"
                          f" {r['forward_ms']:8.3f} {r['backward_ms']:8.3f}"
                          f" {r['backward_ms'] / sync['backward_ms']:10.2f}x {r['saved_bytes'] / 2**20:9.3f}"
                          f"  {r['equal_to_sync']} (max abs diff {r['max_abs_diff_to_sync']:.3g})", flush=True)
    if rank == 0:
        report = {"benchmark": "tp_overlap", "world": world, "torch": torch.__version__,
                  "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  "switches": {k: v for k, v in os.environ.items() if k == "CUDA_DEVICE_MAX_CONNECTIONS"},
                  "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"--nproc {args.nproc} needs as many GPUs; {torch.cuda.device_count()} visible"
                         " (--device cpu runs on gloo).")
    if args.seq_length % args.nproc:
        raise SystemExit(f"--seq-length {args.seq_length} must divide by --nproc {args.nproc} (sequence parallelism).")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
