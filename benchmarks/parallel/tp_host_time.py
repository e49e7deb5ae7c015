"""Host time per training step of the GPT recipe at tp = 2 on CPU (gloo, 2 processes): the DTensor-module plan
against the local-tensor layers (docs/tensor_parallel.md).

On a CPU everything is host time; with small shapes the step is dominated by what the host does per operator
(Python, dispatch, DTensor sharding propagation, autograd bookkeeping), which is what a GPU run waits on when its
kernels are short. Each rank runs one pipeline stage holding the whole model (embedding, blocks, head) through
forward, ``loss_parallel`` cross-entropy, backward over ``--num-microbatches`` micro-batches, the gradient placement
alignment the strategy does, and an AdamW step. Prints a table and writes JSON (median, quartiles and range of
per-step wall and process CPU time over ``--steps`` timed steps, for the whole step and for forward + backward).
Process CPU time is the steadier measure on a shared machine: waiting for the other rank costs wall time only.

    python benchmarks/parallel/tp_host_time.py --presets tiny 125m --steps 20 --out tp_host_time.json
    python benchmarks/parallel/tp_host_time.py --presets tiny --implementations local --compile off leaves module
    python benchmarks/parallel/tp_host_time.py --presets 1.3b --layers 24 --hidden 64 --heads 4 --vocab 512 \
        --implementations local --compile leaves --sequence-parallel off --breakdown

``--breakdown`` (compiled runs) adds, after the timed steps, a few counted steps that say where the host time of a
step goes: calls and time of the compiled blocks' wrapper (staging the local tensors, then the compiled call), the
local leaves' hand-overs of their gradients and the parameter hooks they run, the autograd nodes of one
micro-batch's graph, and torch.profiler's self-CPU time per event (dynamo's guard evaluation is its "TorchDynamo
Cache Lookup"). The counting wraps the functions only in those steps, so the timed steps carry no instrumentation.
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
    p.add_argument("--layers", type=int, default=None, help="replace the preset's layer count")
    p.add_argument("--hidden", type=int, default=None, help="replace the preset's hidden size (ffn: 4x)")
    p.add_argument("--heads", type=int, default=None, help="replace the preset's head count")
    p.add_argument("--vocab", type=int, default=None, help="replace the preset's vocabulary size")
    p.add_argument("--breakdown", action="store_true",
                   help="after the timed steps, count and time the host work of a compiled step (see above)")
    p.add_argument("--breakdown-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15, help="profiler events listed by --breakdown")
    p.add_argument("--out", type=Path, default=Path("tp_host_time.json"))
    return p.parse_args(argv)


def build(preset: str, implementation: str, sequence_parallel: bool, args: argparse.Namespace, mesh):
    from lightning_3d.recipes.gpt.config import preset as gpt_preset
    from lightning_3d.recipes.gpt.model import GPTModel
    from lightning_3d.recipes.gpt.parallelize import GPTStage, parallelize_gpt
    from lightning_3d.strategies.stage_builder import replicate_plain_parameters
    from lightning_3d.utils.tensors import materialize_

    config = gpt_preset(preset, seq_length=args.seq_length, dropout=0.0, num_layers=args.layers,
                        hidden_size=args.hidden, num_heads=args.heads, vocab_size=args.vocab)
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

    from lightning_3d.distributed.grad_sync import align_grad_placement
    from lightning_3d.recipes.training import summed_token_cross_entropy

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
    def step() -> tuple[torch.Tensor, float]:
        for tokens in batches:
            microbatch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
            with loss_parallel():
                loss = summed_token_cross_entropy(stage(microbatch=microbatch), microbatch["labels"])
                loss.backward()
        tm = time.perf_counter(), time.process_time()  # the model's forward and backward end here
        for p in params:
            align_grad_placement(p, allow_communication=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss, tm

    wall, cpu, model_wall, model_cpu = [], [], [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss, (tm, cm) = step()
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= args.warmup:
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
            model_wall.append(tm - t0)
            model_cpu.append(cm - c0)
    extra = {}
    if args.breakdown and compiled == "leaves":
        extra["breakdown"] = breakdown(stage, step, batches, args)
    return {"preset": preset, "implementation": implementation, "sequence_parallel": sequence_parallel, "compile": compiled,
            "wall_s": summary(wall), "cpu_s": summary(cpu), "forward_backward_wall_s": summary(model_wall),
            "forward_backward_cpu_s": summary(model_cpu), "loss_last": loss.item(), **extra}


def breakdown(stage, step, batches, args: argparse.Namespace) -> dict:
    """Counts and host times per step (medians over ``--breakdown-steps`` steps) of what a compiled tensor-parallel
    step does besides the graphs' own operators, and the profiler's self-CPU time of one step per event name."""
    from torch.profiler import ProfilerActivity, profile

    from lightning_3d.tensor_parallel import layers as tp_layers

    counts: dict[str, float] = {}

    def add(key: str, seconds: float) -> None:
        counts[key + "_calls"] = counts.get(key + "_calls", 0) + 1
        counts[key + "_ms"] = counts.get(key + "_ms", 0.0) + seconds * 1e3

    def timed(key: str, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                add(key, time.perf_counter() - t)
        return wrapper

    blocks = list(stage.layers.values())
    real_calls = [b._compiled_call_impl for b in blocks]
    real_stage = tp_layers._LocalTensorLayer._stage_locals
    # The leaves registered their bound _hand_over as a hook when made: time those entries, not the class's method.
    leaves = [p.__dict__["_l3d_local_leaf"] for p in stage.parameters() if "_l3d_local_leaf" in p.__dict__]
    hook_dicts = [leaf.tensor._post_accumulate_grad_hooks for leaf in leaves]
    real_hooks_of = [dict(d) for d in hook_dicts]
    real_hooks = tp_layers.run_post_accumulate_grad_hooks
    per_step: list[dict[str, float]] = []
    try:
        for b, call in zip(blocks, real_calls):
            b._compiled_call_impl = timed("block_call", call)
        tp_layers._LocalTensorLayer._stage_locals = timed("stage_locals", real_stage)
        for d in hook_dicts:
            for key, fn in list(d.items()):
                d[key] = timed("hand_over", fn)
        tp_layers.run_post_accumulate_grad_hooks = timed("param_hooks", real_hooks)
        for _ in range(args.breakdown_steps):
            counts.clear()
            dist.barrier()
            t0 = time.process_time()
            step()
            counts["step_cpu_ms"] = (time.process_time() - t0) * 1e3
            per_step.append(dict(counts))
    finally:
        for b, call in zip(blocks, real_calls):
            b._compiled_call_impl = call
        tp_layers._LocalTensorLayer._stage_locals = real_stage
        for d, real_d in zip(hook_dicts, real_hooks_of):
            d.update(real_d)
        tp_layers.run_post_accumulate_grad_hooks = real_hooks
    result = {k: statistics.median(d.get(k, 0.0) for d in per_step) for k in per_step[-1]}
    # Autograd nodes of one micro-batch's graph (everything backward visits, leaves' AccumulateGrad included).
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_3d.recipes.training import summed_token_cross_entropy

    tokens = batches[0]
    microbatch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    with loss_parallel():
        loss = summed_token_cross_entropy(stage(microbatch=microbatch), microbatch["labels"])
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
        loss.backward()
    stage.zero_grad(set_to_none=True)
    result["autograd_nodes_per_microbatch"] = len(seen)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    result["profile_self_cpu_ms"] = {e.key: (round(e.self_cpu_time_total / 1e3, 3), e.count) for e in events[:args.top]}
    guard = [e for e in events if "Cache Lookup" in e.key]
    result["guard_eval_ms"] = sum(e.cpu_time_total for e in guard) / 1e3
    result["guard_eval_calls"] = sum(e.count for e in guard)
    return result


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
                    if "breakdown" in r:
                        print_breakdown(r["breakdown"], args)
    if rank == 0:
        report = {"benchmark": "tp_host_time", "world": world, "torch": torch.__version__, "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    dist.destroy_process_group()


def print_breakdown(b: dict, args: argparse.Namespace) -> None:
    """Per step, per micro-batch and per block call, on rank 0."""
    n_mb = args.num_microbatches
    calls = b.get("block_call_calls", 0) or 1
    print(f"  breakdown per step (median of {args.breakdown_steps}, process CPU {b['step_cpu_ms']:.1f} ms):")
    for key in ("block_call", "stage_locals", "hand_over", "param_hooks"):
        c, ms = b.get(key + "_calls", 0), b.get(key + "_ms", 0.0)
        print(f"    {key:<13} {c:6.0f} calls {ms:8.2f} ms  ({ms / n_mb:.2f} ms/micro-batch,"
              f" {1e3 * ms / calls:.1f} us/block call)")
    print(f"    guard eval    {b['guard_eval_calls']:6d} calls {b['guard_eval_ms']:8.2f} ms (profiled step)")
    print(f"    autograd nodes per micro-batch: {b['autograd_nodes_per_microbatch']}")
    print("    profiler self CPU (ms, count):")
    for key, (ms, count) in b["profile_self_cpu_ms"].items():
        print(f"      {ms:9.2f} {count:6d}  {key[:90]}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
