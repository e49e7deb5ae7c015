"""Host time of the pipeline runtime on CPU (gloo): what a GPU run at pp > 1 waits on when its kernels are short. The
pipeline counterpart of ``tp_host_time.py``.

A narrow, deep GPT (``--layers`` blocks of width ``--hidden``, vocabulary ``--vocab``, ``--seq-length`` tokens, one
sample per micro-batch) trains through ``Trainer.fit`` with ``Compressed3DStrategy`` at (1, pp, 1) for every ``--pp``
and schedule, ``--microbatches`` micro-batches per step. With such small shapes the arithmetic is negligible, so
each rank's CPU time is host work: Python, dispatch, autograd, the runtime's actions, the point-to-point exchange and
Lightning's loop. Every figure is the training thread's CPU time (waiting for the other rank costs wall time, not CPU
time), split within each step by the runtime's own spans (``PipelineRuntime.observer``), so it needs no difference
of two runs:

- **layers per micro-batch**: the stage modules' forward and backward (and W) spans, over the micro-batches;
- **runtime per micro-batch**: the runtime's step less those spans (the schedule's actions, sends and receives, shape
  headers, the loss hand-over), over the micro-batches; the part that grows with the pipeline;
- **outside the runtime per step**: the training batch less the runtime's step (Lightning's loop, the gradient
  synchronizer's finish, clipping, the optimizer).

Medians over ``--steps`` timed steps, per rank. ``--profile`` adds a cProfile (in thread CPU time) of every rank's
timed steps: lightning_3d's functions by own time per micro-batch (``--all-functions``: every function).

    python benchmarks/parallel/pp_host_time.py                                   # pp 1 and 2, 1F1B, 8 micro-batches
    python benchmarks/parallel/pp_host_time.py --pp 2 --schedules 1f1b zb_h1 gpipe --profile --out pp_host.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[1, 2], help="pipeline sizes (one process per stage)")
    p.add_argument("--schedules", nargs="+", default=["1f1b"], help="schedules for pp > 1")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--steps", type=int, default=15, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="cProfile every rank's timed steps")
    p.add_argument("--all-functions", action="store_true", help="--profile lists every function, not only lightning_3d's")
    p.add_argument("--top", type=int, default=20, help="functions listed by --profile")
    p.add_argument("--out", type=Path, default=None, help="JSON of every run")
    p.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)  # internal: one run's JSON spec
    return p.parse_args(argv)


# ----- one run (a fresh Trainer under Lightning's launcher) ----------------------------------------------------------
def worker(spec: dict) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    from lightning_3d import Compressed3DStrategy
    from lightning_3d.recipes import GPT
    from lightning_3d.recipes.data import SyntheticLMDataModule

    torch.set_num_threads(1)

    class HostClock(pl.Callback):
        """Per timed step, the training thread's CPU seconds: the training batch, the runtime's step and its spans by
        name (the runtime's observer slot: docs/architecture.md)."""

        def __init__(self) -> None:
            self.batch, self.step, self.spans, self._timed = [], [], [], False
            self.profiler = cProfile.Profile(time.thread_time) if spec["profile"] else None

        # ----- the runtime's observer -------------------------------------------------------------------------
        def on_step(self, phase: str, train: bool, num_microbatches: int) -> None:
            if self._timed and train:
                if phase == "begin":
                    self._step = time.thread_time()
                else:
                    self.step.append(time.thread_time() - self._step)

        @contextlib.contextmanager
        def span(self, name: str, stage: int, microbatch: int):
            start = time.thread_time()
            try:
                yield
            finally:
                if self._timed:
                    self.spans[-1][name] = self.spans[-1].get(name, 0.0) + time.thread_time() - start

        def on_received(self, stage: int, microbatch: int, tensors) -> None:
            pass

        # ----- Lightning's hooks ------------------------------------------------------------------------------
        def on_train_start(self, trainer, module) -> None:
            trainer.strategy.pipeline_runtime.observer = self

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            # Timed from the first step after the warm-up, decided here so that clock and profile cover the same steps.
            self._timed = trainer.global_step >= spec["warmup"]
            if self._timed:
                self.spans.append({})
                if self.profiler is not None:
                    self.profiler.enable()
            self._batch = time.thread_time()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if not self._timed:
                return
            if self.profiler is not None:
                self.profiler.disable()
            self.batch.append(time.thread_time() - self._batch)

    m, pp = spec["microbatches"], spec["pp"]
    data = SyntheticLMDataModule(vocab_size=spec["vocab"], seq_length=spec["seq_length"], batch_size=m,
                                 num_samples=m * (spec["warmup"] + spec["steps"]) + 1, shuffle=False)
    model = GPT("tiny", vocab_size=spec["vocab"], seq_length=spec["seq_length"], num_layers=spec["layers"],
                hidden_size=spec["hidden"], num_heads=spec["heads"], dropout=0.0)
    clock = HostClock()
    strategy = Compressed3DStrategy(parallelism={"pipeline_parallel_size": pp},
                                    pipeline={"num_microbatches": m, "schedule": spec["schedule"]},
                                    runtime={"process_group_backend": "gloo"})
    trainer = pl.Trainer(accelerator="cpu", devices=pp, max_steps=spec["warmup"] + spec["steps"], precision="32-true",
                         strategy=strategy, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[clock])
    trainer.fit(model, datamodule=data)
    rows = [None] * trainer.world_size
    mine = {"rank": trainer.global_rank, "batch": clock.batch, "step": clock.step, "spans": clock.spans,
            "profile": top_functions(clock.profiler, spec, len(clock.batch) * m) if clock.profiler else None}
    dist.all_gather_object(rows, mine)
    if trainer.is_global_zero:
        Path(spec["result"]).write_text(json.dumps({"spec": spec, "ranks": rows}))


def top_functions(profiler: cProfile.Profile, spec: dict, microbatches: int) -> list[dict]:
    """lightning_3d's functions by own (tottime) CPU seconds per micro-batch, with their cumulative time and calls."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        if "lightning_3d" not in path and not spec["all_functions"]:
            continue
        where = path[path.rfind("lightning_3d"):] if "lightning_3d" in path else path.split("site-packages/")[-1]
        rows.append({"function": f"{where}:{line}({name})", "calls_per_mb": calls / microbatches,
                     "own_us_per_mb": 1e6 * tottime / microbatches, "cum_us_per_mb": 1e6 * cumtime / microbatches})
    return sorted(rows, key=lambda r: -r["own_us_per_mb"])[: spec["top"]]


# ----- driver -----------------------------------------------------------------------------------------------------
def run(spec: dict, tmp: Path) -> dict:
    spec = dict(spec, result=str(tmp / f"pp{spec['pp']}_{spec['schedule']}.json"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                       os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0 or not Path(spec["result"]).exists():
        raise SystemExit(f"run {spec} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(Path(spec["result"]).read_text())


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def breakdown(rank: dict, m: int) -> dict:
    """A rank's medians (ms): layers and runtime per micro-batch, outside the runtime per step, the batch, waits."""
    layers = [sum(v for k, v in spans.items() if k != "wait") for spans in rank["spans"]]
    waits = [spans.get("wait", 0.0) for spans in rank["spans"]]
    runtime = [step - lay - wait for step, lay, wait in zip(rank["step"], layers, waits, strict=True)]
    outside = [batch - step for batch, step in zip(rank["batch"], rank["step"], strict=True)]
    return {"rank": rank["rank"], "layers_ms_per_microbatch": median_ms(layers) / m,
            "runtime_ms_per_microbatch": median_ms(runtime) / m, "outside_runtime_ms_per_step": median_ms(outside),
            "batch_ms": median_ms(rank["batch"]), "wait_ms_per_step": median_ms(waits), "profile": rank["profile"]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return {}
    if args.microbatches < 1 or any(p < 1 or args.layers % p for p in args.pp):
        raise SystemExit(f"--microbatches {args.microbatches} must be >= 1 and each --pp {args.pp} divide --layers {args.layers}")
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="pp_host_time_"))
    keys = ("layers", "hidden", "heads", "vocab", "seq_length", "steps", "warmup", "top", "profile", "all_functions",
            "microbatches")
    base = {k: getattr(args, k) for k in keys}
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "layouts": []}
    for pp in args.pp:
        for schedule in (["1f1b"] if pp == 1 else args.schedules):
            raw = run(dict(base, pp=pp, schedule=schedule), tmp)
            ranks = [breakdown(r, args.microbatches) for r in raw["ranks"]]
            report["layouts"].append({"pp": pp, "schedule": schedule, "ranks": ranks})
            for r in ranks:
                print(f"pp {pp} {schedule:14s} rank {r['rank']}: per micro-batch layers {r['layers_ms_per_microbatch']:6.2f} ms,"
                      f" runtime {r['runtime_ms_per_microbatch']:5.2f} ms; per step outside the runtime"
                      f" {r['outside_runtime_ms_per_step']:6.2f} ms, waits {r['wait_ms_per_step']:5.2f} ms, batch"
                      f" {r['batch_ms']:6.1f} ms", flush=True)
                for f in r["profile"] or []:
                    print(f"    {f['own_us_per_mb']:8.1f} us own {f['cum_us_per_mb']:9.1f} us cum"
                          f" {f['calls_per_mb']:6.1f} calls per micro-batch  {f['function']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
