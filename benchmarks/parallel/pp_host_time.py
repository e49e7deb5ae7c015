"""Host time per micro-batch of the pipeline runtime on CPU (gloo): what a GPU run at pp > 1 waits on when its kernels
are short. The pipeline counterpart of ``tp_host_time.py``.

A narrow, deep GPT (``--layers`` blocks of width ``--hidden``, vocabulary ``--vocab``, ``--seq-length`` tokens, one
sample per micro-batch) trains through ``Trainer.fit`` with ``Compressed3DStrategy`` at (1, pp, 1) for every ``--pp``
and schedule, once with ``--microbatches`` LOW and once with HIGH micro-batches per step. With such small shapes the
arithmetic is negligible, so each rank's CPU time per step is host work: Python, dispatch, autograd, the
runtime's actions, the point-to-point exchange (gloo's copies) and Lightning's loop. The difference between HIGH and
LOW over HIGH - LOW is the host time **per micro-batch** (per rank); what is left at LOW is the per-step part.

Dividing by the rank's blocks compares layouts: at pp = 1 the per-micro-batch time is all layers' host work; at
pp = 2 each rank holds half of the blocks, so ``per micro-batch - pp-1 per micro-batch x blocks held / blocks`` is
the pipeline's own cost per micro-batch (the runtime's actions, sends and receives, the shape header, the loss
hand-over on the last stage). Process CPU time is the steadier measure on a shared machine: waiting for the other
rank costs wall time, not CPU time. The training thread's CPU time is the figure; the process's (which adds the
communication threads) is printed beside it. ``--profile`` adds a cProfile (in thread CPU time) of every rank's HIGH
steps, the functions of lightning_3d by own time.

    python benchmarks/parallel/pp_host_time.py                                   # pp 1 and 2, 1F1B, 4 and 12 micro-batches
    python benchmarks/parallel/pp_host_time.py --pp 2 --schedules 1f1b zb_h1 gpipe --profile --out pp_host.json
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--microbatches", type=int, nargs=2, default=[4, 12], metavar=("LOW", "HIGH"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--steps", type=int, default=15, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="cProfile rank 0's timed HIGH steps")
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
        """Per timed step: wall, process CPU and training-thread CPU seconds of the training batch (forward, backward,
        optimizer); process CPU includes the communication threads (gloo's)."""

        def __init__(self) -> None:
            self.wall, self.cpu, self.thread = [], [], []
            # The training thread's CPU time (not wall time: waiting for the other rank is not host work).
            self.profiler = cProfile.Profile(time.thread_time) if spec["profile"] else None

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            # Timed from the first step after the warm-up, decided here so that clock and profile cover the same steps.
            self._timed = trainer.global_step >= spec["warmup"]
            if self._timed and self.profiler is not None:
                self.profiler.enable()
            self._t = (time.perf_counter(), time.process_time(), time.thread_time())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if not self._timed:
                return
            if self.profiler is not None:
                self.profiler.disable()
            self.wall.append(time.perf_counter() - self._t[0])
            self.cpu.append(time.process_time() - self._t[1])
            self.thread.append(time.thread_time() - self._t[2])

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
    mine = {"rank": trainer.global_rank, "wall": clock.wall, "cpu": clock.cpu, "thread": clock.thread,
            "profile": top_functions(clock.profiler, spec["top"], len(clock.cpu) * m) if clock.profiler else None}
    dist.all_gather_object(rows, mine)
    if trainer.is_global_zero:
        Path(spec["result"]).write_text(json.dumps({"spec": spec, "ranks": rows}))


def spec_all_functions() -> bool:
    return os.environ.get("PP_HOST_ALL_FUNCTIONS") == "1"


def top_functions(profiler: cProfile.Profile, top: int, microbatches: int) -> list[dict]:
    """lightning_3d's functions by own (tottime) CPU seconds per micro-batch, with their cumulative time and calls."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        if "lightning_3d" not in path and not spec_all_functions():
            continue
        where = path[path.rfind("lightning_3d"):] if "lightning_3d" in path else path.split("site-packages/")[-1]
        rows.append({"function": f"{where}:{line}({name})", "calls_per_mb": calls / microbatches,
                     "own_us_per_mb": 1e6 * tottime / microbatches, "cum_us_per_mb": 1e6 * cumtime / microbatches})
    return sorted(rows, key=lambda r: -r["own_us_per_mb"])[:top]


# ----- driver -----------------------------------------------------------------------------------------------------
def run(spec: dict, tmp: Path) -> dict:
    spec = dict(spec, result=str(tmp / f"pp{spec['pp']}_{spec['schedule']}_m{spec['microbatches']}.json"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                       os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0 or not Path(spec["result"]).exists():
        raise SystemExit(f"run {spec} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(Path(spec["result"]).read_text())


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return {}
    low, high = args.microbatches
    if not 1 <= low < high:
        raise SystemExit(f"--microbatches LOW HIGH needs 1 <= LOW < HIGH, got {low} {high}")
    if any(p < 1 or args.layers % p for p in args.pp):
        raise SystemExit(f"--pp {args.pp}: each must divide --layers {args.layers}")
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="pp_host_time_"))
    base = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq_length", "steps", "warmup", "top")}
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "layouts": []}
    per_layer_pp1 = None
    for pp in args.pp:
        for schedule in (["1f1b"] if pp == 1 else args.schedules):
            runs = {m: run(dict(base, pp=pp, schedule=schedule, microbatches=m, profile=args.profile and m == high), tmp)
                    for m in (low, high)}
            ranks = []
            for r in range(pp):
                got = {key: [median_ms(runs[m]["ranks"][r][key]) for m in (low, high)] for key in ("cpu", "thread", "wall")}
                per_mb = (got["thread"][1] - got["thread"][0]) / (high - low)
                ranks.append({"rank": r, "thread_ms_per_step": got["thread"], "cpu_ms_per_step": got["cpu"],
                              "wall_ms_per_step": got["wall"], "thread_ms_per_microbatch": per_mb,
                              "cpu_ms_per_microbatch": (got["cpu"][1] - got["cpu"][0]) / (high - low),
                              "thread_ms_per_step_fixed": got["thread"][0] - low * per_mb,
                              "profile": runs[high]["ranks"][r]["profile"]})
            if pp == 1:
                per_layer_pp1 = ranks[0]["thread_ms_per_microbatch"] / args.layers
            row = {"pp": pp, "schedule": schedule, "ranks": ranks}
            if per_layer_pp1 is not None:  # the pipeline's own per-micro-batch cost, beyond its blocks' share
                for rank in ranks:
                    rank["pipeline_ms_per_microbatch"] = rank["thread_ms_per_microbatch"] - per_layer_pp1 * args.layers / pp
            report["layouts"].append(row)
            for rank in ranks:
                extra = (f", beyond its blocks {rank['pipeline_ms_per_microbatch']:6.2f}"
                         if "pipeline_ms_per_microbatch" in rank and pp > 1 else "")
                print(f"pp {pp} {schedule:8s} rank {rank['rank']}: thread CPU per micro-batch"
                      f" {rank['thread_ms_per_microbatch']:6.2f} ms{extra} (process {rank['cpu_ms_per_microbatch']:6.2f});"
                      f" per step at {low}/{high}: thread {rank['thread_ms_per_step'][0]:.1f}/"
                      f"{rank['thread_ms_per_step'][1]:.1f} ms, wall {rank['wall_ms_per_step'][0]:.1f}/"
                      f"{rank['wall_ms_per_step'][1]:.1f} ms", flush=True)
                for f in rank["profile"] or []:
                    print(f"    {f['own_us_per_mb']:8.1f} us own {f['cum_us_per_mb']:9.1f} us cum"
                          f" {f['calls_per_mb']:6.1f} calls per micro-batch  {f['function']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
