"""Soak run: does a long CPU fit stay flat? GPT-tiny at (dp, pp, tp) = (1, 2, 1) with compressed backpropagation
(the default at pp = 2), validation every 100 steps and a checkpoint every 200, for ``--steps`` optimizer steps
(1,000 by default), on the offline default corpus, under Lightning's own launcher (this process is rank 0).

Every ``--every`` steps each rank's resident set size (RSS, after that step's validation and checkpoint, if any) and
the mean training-step time of the window (``on_train_batch_start`` to ``on_train_batch_end``: validation and
checkpoint saves are outside it) are gathered on rank 0 and printed; at the end, the change from the first window
(step ``--every``) to the last: the goal is RSS flat within 5 % and step time within 5 %.

    python benchmarks/tools/soak.py                      # 1,000 steps, 2 CPU processes
    python benchmarks/tools/soak.py --steps 300 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import psutil
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes import GPT
from lightning_3d.recipes.data import CausalLMDataModule


class Soak(pl.Callback):
    """RSS and mean step time per window of ``every`` steps, every rank's, printed by rank 0."""

    def __init__(self, every: int) -> None:
        self.every, self.rows, self._start, self._times = every, [], 0.0, []
        self.process = psutil.Process()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        # A window ends after its last step's validation and checkpoint (both run after on_train_batch_end): here, at
        # the start of the next batch; the last window at the end of training.
        step = trainer.global_step
        if step and step % self.every == 0 and (not self.rows or self.rows[-1]["step"] != step):
            self._record(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._times.append(time.perf_counter() - self._start)

    def _record(self, trainer) -> None:
        step = trainer.global_step
        mine = {"rank": trainer.global_rank, "rss_mib": self.process.memory_info().rss / 2**20,
                "step_ms": 1e3 * sum(self._times) / max(1, len(self._times))}
        self._times = []
        every = [None] * trainer.world_size
        dist.all_gather_object(every, mine)
        row = {"step": step, "ranks": every}
        self.rows.append(row)
        if trainer.is_global_zero:
            ranks = "  ".join(f"rank {r['rank']}: RSS {r['rss_mib']:7.1f} MiB, step {r['step_ms']:6.1f} ms" for r in every)
            print(f"step {step:5d}  {ranks}", flush=True)

    def on_train_end(self, trainer, module) -> None:  # before the strategy's teardown
        if not self.rows or self.rows[-1]["step"] != trainer.global_step:
            self._record(trainer)


def summary(rows: list[dict]) -> dict:
    first, last = rows[0], rows[-1]
    out = {"first_step": first["step"], "last_step": last["step"], "ranks": []}
    for a, b in zip(first["ranks"], last["ranks"], strict=True):
        out["ranks"].append({"rank": a["rank"], "rss_change_pct": 100 * (b["rss_mib"] / a["rss_mib"] - 1),
                             "step_time_change_pct": 100 * (b["step_ms"] / a["step_ms"] - 1),
                             "rss_mib": [a["rss_mib"], b["rss_mib"]], "step_ms": [a["step_ms"], b["step_ms"]]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    parser.add_argument("--every", type=int, default=100, help="steps per window, validation interval (default 100)")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints (default 200)")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes = pipeline stages (default 2)")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None, help="checkpoints and data cache (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write every window and the summary here")
    args = parser.parse_args()
    if args.steps < args.every:
        parser.error(f"--steps={args.steps} must be at least --every={args.every} (one window)")
    workdir = args.workdir or Path(os.environ.get("L3D_SOAK_DIR") or tempfile.mkdtemp(prefix="soak-"))
    os.environ["L3D_SOAK_DIR"] = str(workdir)  # the other ranks (started by the launcher) use the same directory

    data = CausalLMDataModule(seq_length=args.seq_length, batch_size=args.batch_size, cache_dir=str(workdir / "cache"))
    model = GPT("tiny", vocab_size=data.vocab_size, seq_length=args.seq_length)
    soak = Soak(args.every)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, precision="32-true",
        strategy=Compressed3DStrategy(pipeline_parallel_size=args.devices, num_microbatches=args.num_microbatches),
        val_check_interval=args.every, check_val_every_n_epoch=None, limit_val_batches=4, num_sanity_val_steps=0,
        callbacks=[soak, ModelCheckpoint(dirpath=workdir / "checkpoints", every_n_train_steps=args.checkpoint_every,
                                         save_top_k=1)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "windows": soak.rows, "summary": summary(soak.rows)}
        for r in result["summary"]["ranks"]:
            print(f"rank {r['rank']}: step {result['summary']['first_step']} -> {result['summary']['last_step']}:"
                  f" RSS {r['rss_mib'][0]:.1f} -> {r['rss_mib'][1]:.1f} MiB ({r['rss_change_pct']:+.1f} %),"
                  f" step time {r['step_ms'][0]:.1f} -> {r['step_ms'][1]:.1f} ms ({r['step_time_change_pct']:+.1f} %)")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
