"""Soak run: does a long CPU fit stay flat? GPT-tiny at (dp, pp, tp) = (1, 2, 1) with compressed backpropagation
(the default at pp = 2), validation every 100 steps and a checkpoint every 200, for ``--steps`` optimizer steps
(1,000 by default), on the offline default corpus, under Lightning's own launcher (this process is rank 0).

Every ``--every`` steps each rank's resident set size (RSS, after that step's validation and checkpoint, if any), the
median and mean training-step time of the window (``on_train_batch_start`` to ``on_train_batch_end``: validation and
checkpoint saves are outside it), the process CPU time per step (insensitive to other jobs sharing the cores, unlike
wall time), the C heap as glibc's allocator sees it (``mallinfo2``: bytes in use, bytes free but kept) and Python's
tracked and frozen object counts are gathered on rank 0 and printed. At the end, the goal check from the first window
(step ``--every``) to the last: RSS flat within 5 % and step time within 5 %, and the RSS slope over the last half of
the windows (a leak shows as a steady slope even where the change is still small).

Diagnostics for a growth (each costs time, so none is on by default):
``--tracemalloc N`` the N source lines whose Python-allocated memory grew most since the previous window, every
rank's, printed by rank 0; ``--gc-types N`` the N types whose count of tracked objects grew most (objects frozen by
the strategy's ``gc_freeze`` are not counted there, see the frozen count); ``--malloc-trim`` returns the allocator's
free memory to the system before each reading (``malloc_trim(0)``): growth that disappears with it is the allocator
keeping freed memory, not a leak. ``MALLOC_ARENA_MAX=2`` in the environment tests arena fragmentation the same way.
``--threads N`` the N threads of each rank that used the most CPU time in the window, by name (Linux ``/proc``): which
pool is busy when the CPU time per step jumps (intra-op threads carry the process's name; torch names its autograd and
gloo threads).

The host's GPUs are hidden from the ranks (``CUDA_VISIBLE_DEVICES=""``; ``--keep-gpus`` leaves them): the fit runs on
the CPU, and torch.distributed.checkpoint's file writer asks ``torch.cuda.is_available()`` on its first save, which on
a GPU host initialises the CUDA driver in every rank once (its libraries' file-backed pages and its threads;
benchmarks/RESULTS.md, 2026-12-02f) — a one-time step in RSS that belongs to the host, not to the job.

    python benchmarks/tools/soak.py                      # 1,000 steps, 2 CPU processes
    python benchmarks/tools/soak.py --steps 300 --every 50 --json soak.json
    python benchmarks/tools/soak.py --steps 300 --every 50 --tracemalloc 8 --gc-types 8
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import lightning.pytorch as pl
import psutil
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

# The repository's package without an install (as the other benchmarks run): the launcher re-runs this script for
# the other ranks, which take the same path.
ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from lightning_3d import Compressed3DStrategy  # noqa: E402
from lightning_3d.recipes import GPT  # noqa: E402
from lightning_3d.recipes.data import CausalLMDataModule  # noqa: E402
from lightning_3d.strategies.config import ParallelismConfig, PipelineConfig  # noqa: E402

GOAL_PCT = 5.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    """glibc's ``mallinfo2`` and ``malloc_trim``, or None elsewhere (musl, macOS): the heap columns are then left out."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of this process, by thread id, with the thread's name; empty where
    ``/proc`` is missing."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended between the listing and the read
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # fields from the state on: utime and stime are 12th and 13th
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return out


def _rss_parts() -> dict[str, float]:
    """RSS split as Linux counts it: anonymous memory (the heaps: what a leak grows) and file-backed pages (shared
    libraries and memory-mapped files as far as they were touched, which the kernel can drop). Empty elsewhere."""
    parts = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("RssAnon", "RssFile"):
                    parts[f"{name[3:].lower()}_mib"] = int(value.split()[0]) / 2**10
    except OSError:
        pass
    return parts


class Soak(pl.Callback):
    """Per window of ``every`` steps, every rank's memory and step time (and the optional diagnostics), printed by
    rank 0."""

    def __init__(self, every: int, tracemalloc_top: int = 0, gc_types_top: int = 0, malloc_trim: bool = False,
                 threads_top: int = 0) -> None:
        self.every, self.rows, self.threads_top = every, [], threads_top
        self._thread_cpu: dict[int, tuple[str, float]] = {}
        self.tracemalloc_top, self.gc_types_top, self.malloc_trim = tracemalloc_top, gc_types_top, malloc_trim
        self.process = psutil.Process()
        self.libc = _libc()
        self._start = self._cpu_start = 0.0
        self._times: list[float] = []
        self._cpu: list[float] = []
        self._snapshot = None
        self._types: collections.Counter | None = None

    def on_train_start(self, trainer, module) -> None:
        if self.tracemalloc_top:
            tracemalloc.start(1)
            self._snapshot = tracemalloc.take_snapshot()
        if self.gc_types_top:
            self._types = self._count_types()
        if self.threads_top:
            self._thread_cpu = _thread_cpu()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        # A window ends after its last step's validation and checkpoint (both run after on_train_batch_end): here, at
        # the start of the next batch; the last window at the end of training.
        step = trainer.global_step
        if step and step % self.every == 0 and (not self.rows or self.rows[-1]["step"] != step):
            self._record(trainer)
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._times.append(time.perf_counter() - self._start)
        self._cpu.append(time.process_time() - self._cpu_start)

    @staticmethod
    def _count_types() -> collections.Counter:
        return collections.Counter(type(o).__qualname__ for o in gc.get_objects())

    def _record(self, trainer) -> None:
        step = trainer.global_step
        mine = {"rank": trainer.global_rank}
        if self.malloc_trim and self.libc is not None:
            self.libc.malloc_trim(0)
        mine["rss_mib"] = self.process.memory_info().rss / 2**20
        mine.update(_rss_parts())
        mine["step_ms"] = 1e3 * statistics.fmean(self._times) if self._times else 0.0
        mine["step_ms_median"] = 1e3 * statistics.median(self._times) if self._times else 0.0
        mine["cpu_ms"] = 1e3 * statistics.fmean(self._cpu) if self._cpu else 0.0
        self._times, self._cpu = [], []
        if self.libc is not None:
            info = self.libc.mallinfo2()
            # In use: small blocks in the arenas plus mmapped large blocks; free: what the arenas keep for reuse.
            mine["heap_used_mib"] = (info.uordblks + info.hblkhd) / 2**20
            mine["heap_free_mib"] = info.fordblks / 2**20
        mine["torch_threads"] = torch.get_num_threads()
        if self.threads_top:
            now = _thread_cpu()
            used = sorted(((cpu - self._thread_cpu.get(tid, (name, 0.0))[1], name, tid)
                           for tid, (name, cpu) in now.items()), reverse=True)
            self._thread_cpu = now
            mine["threads"] = len(now)
            mine["thread_cpu"] = [f"{1e3 * s:9.0f} ms  {name} ({tid})" for s, name, tid in used[: self.threads_top]]
        mine["gc_tracked"] = len(gc.get_objects())
        mine["gc_frozen"] = gc.get_freeze_count()
        if self.tracemalloc_top and tracemalloc.is_tracing():
            snapshot = tracemalloc.take_snapshot()
            diff = snapshot.compare_to(self._snapshot, "lineno")
            self._snapshot = snapshot
            mine["traced_mib"] = tracemalloc.get_traced_memory()[0] / 2**20
            mine["top_growth"] = [f"{d.size_diff / 2**10:+9.1f} KiB {d.count_diff:+7d} objects  {d.traceback}"
                                  for d in diff[: self.tracemalloc_top] if d.size_diff > 0]
        if self.gc_types_top:
            types = self._count_types()
            grown = types - self._types
            self._types = types
            mine["types_growth"] = [f"{n:+7d} {name}" for name, n in grown.most_common(self.gc_types_top)]
        every = [None] * trainer.world_size
        dist.all_gather_object(every, mine)
        self.rows.append({"step": step, "ranks": every})
        if trainer.is_global_zero:
            print(f"step {step:5d}  " + "  ".join(_short(r) for r in every), flush=True)
            for r in every:
                if "thread_cpu" in r:
                    print(f"    rank {r['rank']}: {r['threads']} threads, torch {r['torch_threads']} intra-op;"
                          " busiest in the window:", flush=True)
                for line in r.get("top_growth", []) + r.get("types_growth", []) + r.get("thread_cpu", []):
                    print(f"    rank {r['rank']}: {line}", flush=True)

    def on_train_end(self, trainer, module) -> None:  # before the strategy's teardown
        if not self.rows or self.rows[-1]["step"] != trainer.global_step:
            self._record(trainer)
        if self.tracemalloc_top:
            tracemalloc.stop()


def _short(r: dict) -> str:
    parts = f" = {r['anon_mib']:.0f} anon + {r['file_mib']:.0f} file" if "anon_mib" in r else ""
    heap = f"; heap {r['heap_used_mib']:.0f} used + {r['heap_free_mib']:.0f} free" if "heap_used_mib" in r else ""
    return (f"rank {r['rank']}: RSS {r['rss_mib']:6.1f} MiB{parts}{heap}, step {r['step_ms_median']:6.1f} ms"
            f" (cpu {r['cpu_ms']:5.1f}), objects {r['gc_tracked']} + {r['gc_frozen']} frozen")


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of ``(step, value)`` points, per 100 steps."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def summary(rows: list[dict]) -> dict:
    """The goal check per rank: RSS and step time (window median) from the first window to the last, within
    ``GOAL_PCT``; the RSS slope over the last half of the windows (at least three) in % of the first window's RSS per
    100 steps, which a leak keeps positive while a one-time jump (a first checkpoint's buffers) leaves it near zero."""
    first, last = rows[0], rows[-1]
    tail = rows[-max(3, len(rows) // 2):]
    out = {"first_step": first["step"], "last_step": last["step"], "goal_pct": GOAL_PCT,
           "slope_windows": [tail[0]["step"], tail[-1]["step"]], "ranks": []}
    for i, (a, b) in enumerate(zip(first["ranks"], last["ranks"], strict=True)):
        rss = 100 * (b["rss_mib"] / a["rss_mib"] - 1)
        step = 100 * (b["step_ms_median"] / a["step_ms_median"] - 1) if a["step_ms_median"] else 0.0
        cpu = 100 * (b["cpu_ms"] / a["cpu_ms"] - 1) if a["cpu_ms"] else 0.0
        slope = _slope([(row["step"], row["ranks"][i]["rss_mib"]) for row in tail]) if len(tail) > 1 else 0.0
        out["ranks"].append({
            "rank": a["rank"], "rss_mib": [a["rss_mib"], b["rss_mib"]], "rss_change_pct": rss,
            "rss_slope_mib_per_100": slope, "rss_slope_pct_per_100": 100 * slope / a["rss_mib"],
            "step_ms_median": [a["step_ms_median"], b["step_ms_median"]], "step_time_change_pct": step,
            "cpu_ms": [a["cpu_ms"], b["cpu_ms"]], "cpu_time_change_pct": cpu,
            "rss_goal_met": abs(rss) <= GOAL_PCT, "step_time_goal_met": abs(step) <= GOAL_PCT,
        })
    return out


def print_summary(s: dict) -> None:
    print(f"Goal: from step {s['first_step']} to {s['last_step']}, RSS and step time within {s['goal_pct']:g} %"
          f" (RSS slope over steps {s['slope_windows'][0]}-{s['slope_windows'][1]})")
    for r in s["ranks"]:
        print(f"rank {r['rank']}: RSS {r['rss_mib'][0]:.1f} -> {r['rss_mib'][1]:.1f} MiB ({r['rss_change_pct']:+.1f} %,"
              f" {'met' if r['rss_goal_met'] else 'NOT met'}), slope {r['rss_slope_mib_per_100']:+.2f} MiB"
              f" ({r['rss_slope_pct_per_100']:+.2f} %) per 100 steps;"
              f" step time (median) {r['step_ms_median'][0]:.1f} -> {r['step_ms_median'][1]:.1f} ms"
              f" ({r['step_time_change_pct']:+.1f} %, {'met' if r['step_time_goal_met'] else 'NOT met'}),"
              f" CPU time per step {r['cpu_ms'][0]:.1f} -> {r['cpu_ms'][1]:.1f} ms ({r['cpu_time_change_pct']:+.1f} %)",
              flush=True)


def hide_gpus(keep: bool, environ=os.environ) -> None:
    """Hide the host's GPUs from this process and the ranks it starts (they inherit the environment), unless
    ``keep``; before the first CUDA call, which is when the driver reads the variable (module docstring)."""
    if not keep:
        environ["CUDA_VISIBLE_DEVICES"] = ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    parser.add_argument("--every", type=int, default=100, help="steps per window, validation interval (default 100)")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints (default 200)")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes = pipeline stages (default 2)")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None, help="checkpoints and data cache (default: a temp dir)")
    parser.add_argument("--train-files", type=Path, nargs="+", default=None,
                        help="local text files to train on instead of the offline default corpus (a machine whose"
                             " data cache was prepared elsewhere: the cache is keyed by the files' path, size and"
                             " modification time)")
    parser.add_argument("--json", type=Path, default=None, help="write every window and the summary here")
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="N",
                        help="print the N source lines of largest Python allocation growth per window (slow)")
    parser.add_argument("--gc-types", type=int, default=0, metavar="N",
                        help="print the N types whose tracked-object count grew most per window")
    parser.add_argument("--flush-denormal", action="store_true",
                        help="flush subnormal floats to zero on this CPU (torch.set_flush_denormal) in every rank:"
                             " tells a phase of subnormal arithmetic (many times slower on x86) from the library's own"
                             " step time")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="print each rank's N threads of most CPU time per window, by name (Linux /proc)")
    parser.add_argument("--malloc-trim", action="store_true",
                        help="malloc_trim(0) before each RSS reading (glibc): tells allocator caching from a leak")
    parser.add_argument("--keep-gpus", action="store_true", help="leave the host's GPUs visible to the CPU ranks"
                        " (default: hidden, see the module docstring)")
    args = parser.parse_args()
    if args.steps < args.every:
        parser.error(f"--steps={args.steps} must be at least --every={args.every} (one window)")
    hide_gpus(args.keep_gpus)
    if args.flush_denormal and not torch.set_flush_denormal(True):
        parser.error("--flush-denormal: this CPU cannot flush subnormals (torch.set_flush_denormal returned False)")
    workdir = args.workdir or Path(os.environ.get("L3D_SOAK_DIR") or tempfile.mkdtemp(prefix="soak-"))
    os.environ["L3D_SOAK_DIR"] = str(workdir)  # the other ranks (started by the launcher) use the same directory

    data = CausalLMDataModule(seq_length=args.seq_length, batch_size=args.batch_size, cache_dir=str(workdir / "cache"),
                              data_files=[str(p.resolve()) for p in args.train_files] if args.train_files else None)
    model = GPT("tiny", vocab_size=data.vocab_size, seq_length=args.seq_length)
    soak = Soak(args.every, args.tracemalloc, args.gc_types, args.malloc_trim, args.threads)
    strategy = Compressed3DStrategy(parallelism=ParallelismConfig(pipeline_parallel_size=args.devices),
                                    pipeline=PipelineConfig(num_microbatches=args.num_microbatches))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, precision="32-true", strategy=strategy,
        val_check_interval=args.every, check_val_every_n_epoch=None, limit_val_batches=4, num_sanity_val_steps=0,
        callbacks=[soak, ModelCheckpoint(dirpath=workdir / "checkpoints", every_n_train_steps=args.checkpoint_every,
                                         save_top_k=1)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        result = {
            "command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                     "torch": torch.__version__, "lightning": pl.__version__,
                     "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX"),
                     "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                     "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")},
            "fit_s": time.perf_counter() - started,
            "args": {k: str(v) for k, v in vars(args).items()}, "windows": soak.rows, "summary": summary(soak.rows),
        }
        print_summary(result["summary"])
        print(f"fit took {result['fit_s']:.0f} s", flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
