"""Host time per training step of the GPT recipe at tp = 2 on CPU (gloo, 2 processes): the DTensor-module plan
against the local-tensor layers (docs/tensor_parallel.md).

On a CPU everything is host time; with small shapes the step is dominated by what the host does per operator
(Python, dispatch, DTensor sharding propagation, autograd bookkeeping), which is what a GPU run waits on when its
kernels are short. Each rank runs one pipeline stage holding the whole model (embedding, blocks, head) through
forward, ``loss_parallel`` cross-entropy, backward over ``--num-microbatches`` micro-batches, the gradient placement
alignment the strategy does, and an AdamW step. Prints a table and writes JSON (median, quartiles and range of
per-step wall and process CPU time over ``--steps`` timed steps, for the whole step and for forward + backward).
Process CPU time is the steadier measure on a shared machine: waiting for the other rank costs wall time only.

    python benchmarks/tp_host_time.py --presets tiny 125m --steps 20 --out tp_host_time.json
    python benchmarks/tp_host_time.py --presets tiny --implementations local --compile off leaves module
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "125m"])
    p.add_argument("--implementations", nargs="+", default=["dtensor", "local"], choices=("dtensor", "local"))
    p.add_argument("--sequence-parallel", nargs="+", default=["off", "on"], choices=("off", "on"))
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--compile", nargs="+", default=["off"], choices=("off", "leaves", "module"),
                   help="blocks eager (off), compiled as the recipes compile them (leaves: graphs on the local"
                        " leaves, compile_on_local_tensors), or with Module.compile (module: graphs on the DTensor"
                        " parameters, the recipes' compile before the local leaves); compiled with the aot_eager"
                        " backend (graph capture and AOTAutograd as inductor, no C++ kernels), local layers only")
    p.add_argument("--out", type=Path, default=Path("tp_host_time.json"))
    return p.parse_args(argv)


def build(preset: str, implementation: str, sequence_parallel: bool, args: argparse.Namespace, mesh):
    from lightning_3d.recipes.gpt.config import preset as gpt_preset
    from lightning_3d.recipes.gpt.model import GPTModel
    from lightning_3d.recipes.gpt.parallelize import GPTStage, parallelize_gpt
    from lightning_3d.strategies.stage_builder import replicate_plain_parameters
    from lightning_3d.utils.tensors import materialize_

    config = gpt_preset(preset, seq_length=args.seq_length, dropout=0.0)
    with torch.device("meta"):
        model = GPTModel(config, config.padded_vocab_size(mesh.size()))
    stage = GPTStage(model, range(config.num_layers), first=True, last=True)
    parallelize_gpt(stage, mesh, sequence_parallel, implementation=implementation)
    replicate_plain_parameters(stage, mesh)  # what the strategy does after the plan (norms under the DTensor plan)
    materialize_(model, torch.device("cpu"))
    model.init_weights(1234)
    if model.head.padding_mask is not None:
        mask = torch.zeros(model.head.out_features)
        mask[config.vocab_size:] = float("-inf")
        from lightning_3d.recipes.gpt.model import copy_full_into
        copy_full_into(model.head.padding_mask, mask)
    return config, stage


def run_one(preset: str, implementation: str, sequence_parallel: bool, args: argparse.Namespace, mesh,
            compiled: str = "off") -> dict:
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_3d.recipes.training import summed_token_cross_entropy
    from lightning_3d.strategies.grad_sync import align_grad_placement

    config, stage = build(preset, implementation, sequence_parallel, args, mesh)
    if compiled != "off":
        from torch._dynamo import reset as reset_dynamo

        from lightning_3d.tensor_parallel import compile_on_local_tensors

        reset_dynamo()
        for block in stage.layers.values():
            if compiled == "leaves":
                compile_on_local_tensors(block, backend="aot_eager")
            else:
                block.compile(backend="aot_eager")
    params = [p for p in stage.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    g = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, args.seq_length + 1)
    batches = [torch.randint(0, config.vocab_size, shape, generator=g) for _ in range(args.num_microbatches)]
    wall, cpu, model_wall, model_cpu = [], [], [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for tokens in batches:
            microbatch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
            with loss_parallel():
                loss = summed_token_cross_entropy(stage(microbatch=microbatch), microbatch["labels"])
                loss.backward()
        tm, cm = time.perf_counter(), time.process_time()  # the model's forward and backward end here
        for p in params:
            align_grad_placement(p, allow_communication=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1, c1 = time.perf_counter(), time.process_time()
        if step >= args.warmup:
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
            model_wall.append(tm - t0)
            model_cpu.append(cm - c0)
    return {"preset": preset, "implementation": implementation, "sequence_parallel": sequence_parallel, "compile": compiled,
            "wall_s": summary(wall), "cpu_s": summary(cpu), "forward_backward_wall_s": summary(model_wall),
            "forward_backward_cpu_s": summary(model_cpu), "loss_last": loss.item()}


def runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(implementation, compile) pairs: every implementation eager, then the compiled variants (local layers)."""
    out = [(impl, "off") for impl in args.implementations] if "off" in args.compile else []
    return out + [("local", c) for c in args.compile if c != "off"]


def summary(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4)
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2], "min": min(values), "max": max(values),
            "n": len(values)}


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = []
    for preset in args.presets:
        for sp in args.sequence_parallel:
            for implementation, compiled in runs(args):
                results.append(run_one(preset, implementation, sp == "on", args, mesh, compiled))
                if rank == 0:
                    r = results[-1]
                    print(f"{preset:>6} sp={sp:<3} {implementation:>7} compile={compiled:<6}: wall {r['wall_s']['median'] * 1e3:8.1f} ms"
                          f" [{r['wall_s']['q1'] * 1e3:.1f}, {r['wall_s']['q3'] * 1e3:.1f}]  cpu"
                          f" {r['cpu_s']['median'] * 1e3:8.1f} ms [{r['cpu_s']['q1'] * 1e3:.1f},"
                          f" {r['cpu_s']['q3'] * 1e3:.1f}] (forward+backward cpu"
                          f" {r['forward_backward_cpu_s']['median'] * 1e3:.1f} ms)  loss {r['loss_last']:.4f}",
                          flush=True)
    if rank == 0:
        report = {"benchmark": "tp_host_time", "world": world, "torch": torch.__version__, "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
