"""Host time per training step of the T5 recipe under Compressed3DStrategy on one CPU process.

T5-770M on one GPU is host-bound: the GPU waits while the host issues the step's operators. On a CPU with a
T5 of 770M's depth (24 encoder + 24 decoder blocks) but tiny widths, the GEMMs cost almost nothing and what is left is
what the host does per operator, per layer and per micro-batch (Python, dispatch, autograd, the compiled graphs'
wrappers, the strategy's hooks): the part of the GPU step this script measures. Each configuration trains in the
real path (Lightning, the strategy, the recipe compiled per stage), and reports the median [min-max] wall and process
CPU time per step over ``--steps`` timed steps, the fused weight-gradient accumulations per step (custom-op calls or
in-graph accumulations), and with ``--profile`` the top host operators of one extra step by self CPU time.

    python benchmarks/speed/host_time_t5.py                                # 24+24 blocks, aot_eager, fusion on and off
    python benchmarks/speed/host_time_t5.py --backend inductor --profile   # Inductor's C++ kernels (slow cold compile)
    python benchmarks/speed/host_time_t5.py --layers 2 --steps 2 --warmup 1 --fusion on   # smoke (tests/test_benchmarks.py)
    python benchmarks/speed/host_time_t5.py --fusion on --gc-report   # + the full collection's pause, frozen or not

``--gc-report`` (the strategy's garbage collection: docs/speed.md, "Garbage collection"): after each timed step (out
of its timing) a full collection counts the cyclic garbage the step left (objects, and tensors among them), and after
the fit, with the compiled model, the strategy and the trainer still alive, it times full collections of the heap as
it is and after ``gc.freeze()`` (median of 3 each), with the number of tracked objects.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
OP = "lightning_3d::accumulate_weight_grad"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24, help="encoder blocks (the decoder gets as many); 770m: 24")
    p.add_argument("--hidden", type=int, default=32, help="d_model (tiny: GEMMs negligible)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=16, help="input tokens")
    p.add_argument("--target-length", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", type=int, default=8, help="770m benchmark: 8")
    p.add_argument("--fusion", nargs="+", default=["on", "off"], choices=("on", "off"),
                   help="gradient_accumulation_fusion")
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor", "eager"),
                   help="torch.compile backend of the per-stage compile ('eager': no compile)")
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "explicit"))
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"),
                   help="32-true by default: bf16 GEMMs on a CPU without bf16 units cost tens of microseconds even"
                        " at these sizes, which is not the host time a GPU step waits on")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing (the first compiles)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--profile", action="store_true", help="profile one extra step: top host ops by self CPU time")
    p.add_argument("--gc-report", action="store_true", help="cyclic garbage per step; full-collection pause with and"
                   " without gc.freeze after the fit")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    return p.parse_args(argv)


def run_one(args: argparse.Namespace, fusion: bool) -> dict:
    import lightning.pytorch as pl
    import torch

    import lightning_3d.recipes.training as training
    from lightning_3d import Compressed3DStrategy
    from lightning_3d.recipes.t5.module import T5

    compiled = args.backend != "eager"
    if compiled:
        training.COMPILE_BACKEND = args.backend
    torch.manual_seed(0)
    module = T5("tiny", vocab_size=args.vocab_size, num_layers=args.layers, hidden_size=args.hidden,
                num_heads=args.heads, head_dim=args.head_dim, ffn_hidden_size=args.ffn, compile=compiled,
                compile_scope="stage", attention=args.attention, optimizer_foreach=True)
    steps = args.warmup + args.steps + (1 if args.profile else 0)
    batch = args.micro_batch_size * args.num_microbatches
    data = _data(args, batch * (steps + 1))

    timer = _Timer(args, torch)
    strategy = Compressed3DStrategy(num_microbatches=args.num_microbatches, gradient_accumulation_fusion=fusion)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=args.precision, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer])
    trainer.fit(module, train_dataloaders=data)
    gc_report = _gc_pauses(timer.garbage) if args.gc_report else None
    wall, cpu = timer.wall_ms, timer.cpu_ms
    return {
        "fusion": fusion, "backend": args.backend,
        "wall_ms": statistics.median(wall), "wall_range_ms": [min(wall), max(wall)],
        "cpu_ms": statistics.median(cpu), "cpu_range_ms": [min(cpu), max(cpu)],
        "fused_accumulations_per_step": timer.accumulations,
        "per_microbatch_cpu_ms": statistics.median(cpu) / args.num_microbatches,
        "losses": timer.losses, "profile": timer.profile, "profiled_op_calls": timer.op_calls, "gc": gc_report,
    }


def _gc_pauses(garbage: list[dict]) -> dict:
    """Full collections of the heap after the fit (everything the run built still alive), as it is and frozen."""
    import gc

    def pause_ms() -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            gc.collect()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    enabled = gc.isenabled()
    gc.disable()
    try:
        tracked = len(gc.get_objects())
        full_ms = pause_ms()
        gc.freeze()
        frozen_ms, frozen = pause_ms(), gc.get_freeze_count()
        gc.unfreeze()
    finally:
        if enabled:
            gc.enable()
    return {"tracked_objects": tracked, "full_collection_ms": full_ms, "frozen_objects": frozen,
            "full_collection_after_freeze_ms": frozen_ms, "garbage_per_step": garbage}


def _data(args: argparse.Namespace, samples: int):
    import torch
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(2, args.vocab_size, (args.seq_length,), generator=g),
             "labels": torch.randint(2, args.vocab_size, (args.target_length,), generator=g)} for _ in range(samples)]
    return DataLoader(rows, batch_size=args.micro_batch_size * args.num_microbatches)


class _Timer:
    """A Lightning callback (built lazily so that importing this file needs no Lightning): per-step wall and process
    CPU time of the timed steps, the fused accumulations of the last step, and one profiled step after them."""

    def __new__(cls, args: argparse.Namespace, torch):
        import lightning.pytorch as pl

        class Timer(pl.Callback):
            def __init__(self) -> None:
                self.wall_ms: list[float] = []
                self.cpu_ms: list[float] = []
                self.losses: list[float] = []
                self.accumulations = 0
                self.profile: list[dict] = []
                self.op_calls: dict[str, int] = {}
                self.garbage: list[dict] = []
                self._prof = None

            def on_train_batch_start(self, trainer, module, batch, idx) -> None:
                if args.profile and idx == args.warmup + args.steps:
                    self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    self._prof.__enter__()
                self._wall, self._cpu = time.perf_counter(), time.process_time()

            def on_train_batch_end(self, trainer, module, out, batch, idx) -> None:
                wall, cpu = time.perf_counter() - self._wall, time.process_time() - self._cpu
                self.losses.append(float(out["loss"] if isinstance(out, dict) else out))
                sync = trainer.strategy.engine.grad_sync
                self.accumulations = sync._fused_accumulations if sync is not None else 0
                if self._prof is not None:
                    self._prof.__exit__(None, None, None)
                    averages = self._prof.key_averages()
                    self.op_calls = {"aten": sum(e.count for e in averages if e.key.startswith("aten::")),
                                     "accumulate_weight_grad": sum(e.count for e in averages if e.key == OP)}
                    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
                    self.profile = [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3}
                                    for e in rows[:15]]
                    self._prof = None
                elif args.warmup <= idx < args.warmup + args.steps:
                    self.wall_ms.append(wall * 1e3)
                    self.cpu_ms.append(cpu * 1e3)
                    if args.gc_report:
                        self.garbage.append(_step_garbage())

        return Timer()


def _step_garbage() -> dict:
    """The cyclic garbage left since the last full collection: objects found unreachable, and tensors among them."""
    import gc

    import torch

    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what it finds in gc.garbage, to look at
    try:
        found = gc.collect()
        tensors = sum(issubclass(type(o), torch.Tensor) for o in gc.garbage)  # type(): proxies too
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return {"objects": found, "tensors": tensors}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(f"T5 host time: {args.layers}+{args.layers} blocks, d_model {args.hidden}, {args.num_microbatches} x "
          f"{args.micro_batch_size} x ({args.seq_length}+{args.target_length}), {args.precision}, compile "
          f"{args.backend} per stage, {args.attention}, torch {torch.__version__}", flush=True)
    results = []
    for f in args.fusion:
        r = run_one(args, f == "on")
        results.append(r)
        print(f"fusion {f:3}: step wall {r['wall_ms']:.1f} ms [{r['wall_range_ms'][0]:.1f}-{r['wall_range_ms'][1]:.1f}]"
              f"  cpu {r['cpu_ms']:.1f} ms ({r['per_microbatch_cpu_ms']:.2f} per micro-batch)"
              f"  fused accumulations/step {r['fused_accumulations_per_step']}  last loss {r['losses'][-1]:.4f}",
              flush=True)
        if r["gc"]:
            g = r["gc"]
            per_step = " ".join(f"{x['objects']}/{x['tensors']}" for x in g["garbage_per_step"])
            print(f"    gc: full collection after the fit {g['full_collection_ms']:.1f} ms over {g['tracked_objects']}"
                  f" tracked objects; after gc.freeze() ({g['frozen_objects']} frozen)"
                  f" {g['full_collection_after_freeze_ms']:.2f} ms; cyclic garbage per timed step (objects/tensors):"
                  f" {per_step}", flush=True)
        if r["profiled_op_calls"]:
            print(f"    profiled step: {r['profiled_op_calls']['aten']} aten ops,"
                  f" {r['profiled_op_calls']['accumulate_weight_grad']} {OP} calls; top host ops by self CPU time:")
        for row in r["profile"]:
            print(f"    {row['self_cpu_ms']:8.2f} ms {row['calls']:6d}x  {row['name'][:80]}")
    if len(results) == 2:
        on, off = results
        print(f"fusion on - off: {on['cpu_ms'] - off['cpu_ms']:+.1f} ms cpu per step")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=1))


if __name__ == "__main__":
    main()
