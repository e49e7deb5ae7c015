"""Context-parallel scaling: GPT training throughput at one long sequence length, cp = 1 against cp = 2 (or 4).

Each configuration trains the recipe's GPT through ``Compressed3DStrategy(context_parallel_size=cp)`` on ``cp``
devices (data_parallel_size 1: every device holds a 1/cp slice of every sequence), one sequence per step, bf16
autocast on CUDA, activation checkpointing and the fused chunked loss (no full-vocabulary logits), on random tokens.
Every configuration runs in a fresh process group (``--worker``), so an out-of-memory leaves nothing behind.
Reported per configuration: the median step time of ``--steps`` timed steps after ``--warmup``, tokens/s, TFLOP/s
per device (``GPTConfig.flops_per_token``: 6·N + 12·L·h·s, recomputation not counted) and peak memory per device.
Results go to ``--out`` (default ``$OUT/context_parallel_scaling.json``), rewritten after every configuration.
Design: docs/context_parallel.md.

    python benchmarks/parallel/context_parallel_scaling.py --preset 1.3b --seq 65536 --cp 1 2
    python benchmarks/parallel/context_parallel_scaling.py --device cpu --preset tiny --seq 256 --cp 1 2 --steps 1 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of ``seq`` random tokens (labels shifted); sample ``i`` is the same on every rank."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        x = torch.randint(0, self.vocab, (self.seq + 1,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x[:-1], "labels": x[1:]}


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl

    from lightning_3d import Compressed3DStrategy
    from lightning_3d.recipes import GPT

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def _sync(self) -> None:
            if torch.cuda.is_available() and args.device == "cuda":
                torch.cuda.synchronize()

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self._sync()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self._sync()
            self.times.append(time.perf_counter() - self._start)

    cuda = args.device == "cuda"
    model = GPT(args.preset, vocab_size=args.vocab_size, seq_length=args.seq, activation_checkpointing=True,
                fused_head_loss=True, warmup_steps=1)
    strategy = Compressed3DStrategy(data_parallel_size=1, context_parallel_size=args.cp, compression=False)
    timer = StepTimer()
    steps = args.warmup + args.steps
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=args.cp, strategy=strategy, max_steps=steps,
                         precision="bf16-mixed" if cuda else "32-true", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
                         use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0)
    data = torch.utils.data.DataLoader(RandomTokens(steps, args.seq, args.vocab_size), batch_size=1)
    trainer.fit(model, train_dataloaders=data)
    if trainer.global_rank != 0:
        return
    step = statistics.median(timer.times[args.warmup:])
    tokens = args.seq  # one sequence per step, shared by the cp devices
    flops = model.flops_per_token(args.seq) * tokens / step
    result = {"cp": args.cp, "seq": args.seq, "preset": args.preset, "device": args.device,
              "device_name": torch.cuda.get_device_name() if cuda else "cpu", "step_s": step,
              "tokens_per_s": tokens / step, "tflops_per_device": flops / args.cp / 1e12,
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "step_times": timer.times}
    Path(args.result).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1.3b")
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.cp = args.cp[0]
        worker(args)
        return
    out = args.out or Path(os.environ.get("OUT", ".")) / "context_parallel_scaling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for cp in args.cp:
        result_file = out.with_suffix(f".cp{cp}.tmp")
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--worker", "--result", str(result_file), "--cp", str(cp), "--seq", str(args.seq),
               "--preset", args.preset, "--device", args.device, "--vocab-size", str(args.vocab_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            if result_file.exists():
                results.append(json.loads(result_file.read_text()))
                result_file.unlink()
            else:
                results.append({"cp": cp, "seq": args.seq, "error": (run.stdout + run.stderr)[-3000:]})
        except subprocess.TimeoutExpired:
            results.append({"cp": cp, "seq": args.seq, "error": f"timed out after {args.timeout} s"})
        out.write_text(json.dumps({"results": results}, indent=1))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "step_times"})[:1500], flush=True)


if __name__ == "__main__":
    main()
