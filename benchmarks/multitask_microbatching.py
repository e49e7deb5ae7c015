"""Useful tokens/s of the GPT or T5 recipe on the offline multi-task mix under each micro-batching, in one process.

"Useful" tokens are the samples' own tokens (inputs and targets, no padding); every variant trains on the same global
batches (same seed), so the ratio of their useful tokens/s is the speed-up. One GPU, pp = 1 (the pipeline numbers
belong to the multi-GPU suite). docs/multitask.md explains the options.

    python benchmarks/multitask_microbatching.py --model gpt --preset 1.3b --seq-length 2048 --target-length 512 \
        --global-batch 64 --variants padding packing token_budget dynamic --out $OUT/multitask_gpt.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402

from lightning_3d import Compressed3DStrategy  # noqa: E402
from lightning_3d.recipes import GPT, T5  # noqa: E402
from lightning_3d.recipes.data.multitask import MultiTaskDataModule  # noqa: E402
from lightning_3d.recipes.data.multitask_batching import sample_lengths  # noqa: E402


class StepClock(pl.Callback):
    """Wall time of every training step (synchronised on GPU)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self._start)


def counting(collator, useful: list[int], computed: list[int], model_type: str):
    """Wrap a step collator to record each step's useful and computed (padded) tokens (num_workers=0: in order)."""

    def collate(samples):
        mbs = collator(samples)
        useful.append(sum(sum(sample_lengths(s)) for s in samples))  # one replica: all of the global batch
        computed.append(sum(mb["input_ids"].numel() + (mb["labels"].numel() if model_type == "t5" else 0) for mb in mbs))
        return mbs

    return collate


def run(args: argparse.Namespace, variant: str) -> dict:
    data = MultiTaskDataModule(
        model_type=args.model, num_samples=args.num_samples, tokenizer="bpe", tokenizer_vocab_size=args.vocab_size,
        seq_length=args.seq_length, target_length=args.target_length, global_batch_size=args.global_batch,
        microbatching=variant, micro_batch_size=args.micro_batch_size, token_budget=args.token_budget,
        memory_budget_gb=args.memory_budget_gb, val_fraction=0.0, seed=args.seed)
    if args.model == "gpt":
        model = GPT(args.preset, vocab_size=data.vocab_size, seq_length=args.seq_length, compile=args.compile)
    else:
        model = T5(args.preset, vocab_size=data.vocab_size, pad_token_id=data.pad_token_id,
                   eos_token_id=data.eos_token_id, compile=args.compile)
    useful: list[int] = []
    computed: list[int] = []
    original = data.collator
    data.collator = lambda dp, rank: counting(original(dp, rank), useful, computed, args.model)  # type: ignore[method-assign]
    clock = StepClock()
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, precision=args.precision, max_steps=args.steps,
                         strategy=Compressed3DStrategy(compression=False), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[clock], limit_val_batches=0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, datamodule=data)
    timed = slice(args.warmup, None)
    seconds = sum(clock.times[timed])
    return {"variant": variant, "steps_timed": len(clock.times[timed]), "step_s_mean": seconds / max(1, len(clock.times[timed])),
            "useful_tokens_per_s": sum(useful[timed]) / seconds if seconds else None,
            "useful_tokens_per_step": sum(useful[timed]) / max(1, len(useful[timed])),
            "computed_tokens_per_step": sum(computed[timed]) / max(1, len(computed[timed])),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "error": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["gpt", "t5"], default="gpt")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--variants", nargs="+", default=["padding", "packing", "token_budget", "dynamic"])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--target-length", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="padding: samples; packing: rows")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--memory-budget-gb", type=float, default=40.0, help="dynamic: activation memory per GPU")
    parser.add_argument("--num-samples", type=int, default=20000)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--accelerator", default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "multitask_microbatching.json")
    args = parser.parse_args()
    with socket.socket() as s:  # a one-process group for the strategy
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    results = []
    for variant in args.variants:
        try:
            results.append(run(args, variant))
        except Exception as err:  # noqa: BLE001 - one failing variant (e.g. out of memory) must not lose the others
            results.append({"variant": variant, "error": f"{type(err).__name__}: {err}"})
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
