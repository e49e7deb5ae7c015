"""Training throughput of the GPT or T5 recipe under Compressed3DStrategy for a list of (dp, pp, tp) layouts.

The driver (this script without ``--worker``) starts fresh torchrun-style worker processes for every layout
(a new process group, NCCL state and CUDA memory each), prints a table and writes JSON. See benchmarks/README.md.

    python benchmarks/parallel/train_throughput.py --preset 350m --layouts 4,1,1 1,4,1 1,1,4 2,2,1 2,1,2 1,2,2
    python benchmarks/parallel/train_throughput.py --model t5 --preset 770m --seq-length 512 --target-length 128 --layouts 1,2,2 2,2,1
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from lightning_3d.strategies.config import nest_options  # noqa: E402
from lightning_3d.utils.peak_flops import dense_peak_flops  # noqa: E402

# MFU is against the dense bf16 peak of one H100/H200 SXM, from the library's one table (benchmarks/CONVENTIONS.md).
PEAK_TFLOPS = dense_peak_flops("h200", "bf16") / 1e12
FLOPS_FORMULA = ("model FLOPs/token = 6*N + 12*L*h*s (Megatron convention: N = parameters incl. embeddings, tied"
                 " counted once, unpadded vocab; causal attention counted in full)")
T5_FLOPS_FORMULA = ("model FLOPs per (input+target) token = T5Config.flops_per_sample(s, t) / (s + t): 6 x the matmul"
                    " weights each token passes (source: encoder + decoder cross-attention k/v; target: rest of the"
                    " decoder + head, unpadded vocab) + attention in full 12*inner*(L_enc*s^2 + L_dec*(t^2 + t*s));"
                    " s = --seq-length (encoder), t = --target-length (decoder); tokens = inputs + targets")
# --model: per-model defaults of the options whose default is None (GPT's are the ones the script always had).
MODEL_DEFAULTS = {"gpt": dict(preset="350m", vocab_size=50257, seq_length=1024),
                  "t5": dict(preset="770m", vocab_size=32128, seq_length=512, target_length=128)}
BATCH_NOTE = ("per-replica batch = micro_batch_size * num_microbatches for every layout (per-GPU work held"
              " comparable); tokens/step = dp * per-replica batch * seq, so the global batch grows with dp")
ALWAYS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COMPRESSION_MODES = {
    "off": dict(compression=False, fused_embedding_sync=False),
    "fe": dict(compression=False, fused_embedding_sync=True),
    # fe with the optimizer state sharded over the replicas (docs/sharded_optimizer.md): against fe, its memory.
    "fe-sharded": dict(compression=False, fused_embedding_sync=True, shard_optimizer_state=True),
    # cb, cb-lep and all use the library's CB defaults (only the schedule's cool-down sends compressed, LEP off);
    # cb-lep adds lazy error propagation, cb-every compresses every backward send.
    "cb": dict(compression=True, compressed_stages=[], fused_embedding_sync=False),
    "cb-every": dict(compression=True, compressed_stages=[], cb_epilogue_only=False, fused_embedding_sync=False),
    "cb-lep": dict(compression=True, compressed_stages=[], cb_lazy_error_propagation=True, fused_embedding_sync=False),
    # sc: SC on its default stages on any link (by default it runs only where the measured link is slower than
    # sc_max_link_gbps); all: the library's defaults, SC included only on such a link.
    "sc": dict(compression=True, compressed_backprop=False, fused_embedding_sync=False, sc_max_link_gbps=float("inf")),
    "all": dict(compression=True),
    # SC on every stage, the last included (the default leaves the last stage exact): for slow links, where the last
    # stage's all-reduce outlasts the pipeline's cool-down that should hide it.
    "all-stages": dict(compression=True, compressed_stages="every"),
    # The same with SC's products in IEEE fp32 instead of the default TF32 (what that default buys).
    "all-stages-fp32": dict(compression=True, compressed_stages="every", sc_matmul_precision="fp32"),
}
# Callbacks attached for the overhead measurement, each at its most expensive useful setting.
CALLBACK_VARIANTS = ("state", "diagnostics", "comm", "throughput", "timeline", "allcb")


def parse_variant(text: str) -> str:
    mode, _, callback = text.partition("+")
    if mode not in COMPRESSION_MODES or (callback and callback not in CALLBACK_VARIANTS):
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODE[+CALLBACK] with MODE in {tuple(COMPRESSION_MODES)}"
                                         f" and CALLBACK in {CALLBACK_VARIANTS}")
    return text


REGIMES = {"nvlink": {}, "ib": {"NCCL_P2P_DISABLE": "1"},
           "ethernet": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", choices=tuple(MODEL_DEFAULTS), help="recipe: GPT (causal LM) or T5")
    p.add_argument("--preset", default=None, help="a preset of the model's recipe (default: gpt 350m, t5 770m)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: gpt 50257, t5 32128")
    p.add_argument("--seq-length", type=int, default=None, help="gpt: sequence length (1024); t5: input length (512)")
    p.add_argument("--target-length", type=int, default=None, help="t5 only: target (decoder) length (128)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch, per replica")
    p.add_argument("--num-microbatches", type=int, default=8)
    p.add_argument("--layouts", nargs="+", default="4,1,1 1,4,1 1,1,4 2,2,1 2,1,2 1,2,2".split(), help="dp,pp,tp")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_interleaved"))
    p.add_argument("--virtual-stages", type=int, default=None, help="interleaved schedules only")
    p.add_argument("--pipeline-layer-split", default=None, help="layers per stage, comma-separated (default: even)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--precision", default="bf16-mixed", choices=("bf16-mixed", "bf16-true", "32-true"))
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before them")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true", help="the strategy's cuda_graphs=True (pp = tp = 1, GPUs)")
    p.add_argument("--compile", default="off", choices=["off", "default", "max-autotune-no-cudagraphs"],
                   help="per-block torch.compile of the recipe (GPT or T5)")
    p.add_argument("--out", type=Path, default=Path("results.json"))
    p.add_argument("--regime", default="nvlink", choices=tuple(REGIMES), help="interconnect regime, see benchmarks/CONVENTIONS.md")
    p.add_argument("--devices", type=int, default=None, help="GPUs to use at most (default: all visible)")
    p.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"), help="cpu: smoke test only")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per layout")
    p.add_argument("--profile", action="store_true", help="rank 0 prints a torch.profiler table of 2 steps")
    p.add_argument("--compression", nargs="+", default=["off"], type=parse_variant, metavar="MODE[+CALLBACK]",
                   help="one or more variants, each run in turn by the same worker processes of a layout (one process"
                        " group, fresh model, trainer and strategy per variant). MODE: off (exact baseline, two-collective"
                        " tied sync), fe, cb (cool-down sends only, no LEP), cb-every (every backward send), cb-lep (cb with LEP),"
                        " sc, all (the defaults), all-stages (the defaults with SC on every stage); +CALLBACK attaches one of "
                        + ", ".join(CALLBACK_VARIANTS) + " (callback overhead)")
    p.add_argument("--cb-rank", type=int, default=16)
    p.add_argument("--sc-rank", type=int, default=128)
    p.add_argument("--sc-warmup", type=int, default=2, help="plain all-reduce steps before PowerSGD")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model == "gpt" and args.target_length is not None:
        p.error("--target-length is for --model t5 (GPT trains on --seq-length tokens)")
    for key, value in MODEL_DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1 (the first step builds caches and is never timed)")
    return args


def parse_layout(text: str) -> tuple[int, int, int]:
    dp, pp, tp = (int(x) for x in text.split(","))
    if min(dp, pp, tp) < 1:
        raise ValueError(f"layout {text!r} is not 'dp,pp,tp' with positive sizes")
    return dp, pp, tp


def layout_schedule(args: argparse.Namespace, pp: int) -> tuple[str, int | None]:
    """(schedule, virtual_stages) a layout runs: interleaving and zero bubble need pp >= 2, so one-stage layouts run
    1F1B."""
    one_stage = pp == 1 and args.schedule in ("interleaved_1f1b", "zb_h1", "zb_interleaved")
    return ("1f1b", None) if one_stage else (args.schedule, args.virtual_stages)


# ----- worker ----------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's timeout asks for the stacks first
    if os.environ.get("L3D_HANG_DUMP"):  # diagnosis: print every thread's stack if the run is still going then
        faulthandler.dump_traceback_later(float(os.environ["L3D_HANG_DUMP"]), exit=False)
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.loggers import CSVLogger

    from benchmarks.tools.graph_memory import GraphedPeak
    from lightning_3d import Compressed3DStrategy
    from lightning_3d.recipes import GPT, T5
    from lightning_3d.recipes.data import SyntheticLMDataModule, SyntheticSeq2SeqDataModule
    from lightning_3d.utils.comm_stats import KINDS as TRAFFIC_KINDS

    dp, pp, tp = parse_layout(args.layout)
    cuda = args.accelerator == "gpu"
    per_replica = args.micro_batch_size * args.num_microbatches
    max_steps = args.warmup + args.steps

    class StepTimer(pl.Callback):
        """Wall time of every step between GPU-synchronised batch start and end; rank 0 writes the result."""

        def __init__(self, result: Path) -> None:
            self.result = result
            self.start_mem = torch.cuda.memory_allocated(int(os.environ["LOCAL_RANK"])) if cuda else 0
            self.step_s, self.loop_s = [], []  # loop: batch end to batch end, also data loading and H2D copy
            self._start = self._last_end = 0.0
            self.loss = float("nan")
            self.graphed = GraphedPeak()

        def _now(self, trainer: pl.Trainer) -> float:
            if cuda:
                torch.cuda.synchronize(trainer.strategy.root_device)
            return time.perf_counter()

        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
            if args.profile and trainer.global_step == args.warmup and trainer.global_rank == 0:
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                   torch.profiler.ProfilerActivity.CUDA])
                self.profiler.__enter__()
            self._start = self._now(trainer)

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, out: Any, batch: Any, idx: int) -> None:
            end = self._now(trainer)
            if trainer.global_step > args.warmup:  # global_step already counts this step
                self.step_s.append(end - self._start)
                self.loop_s.append(end - self._last_end)
            self._last_end = end
            self.loss = float(out["loss"]) if isinstance(out, dict) else float(out)
            if cuda:
                self.graphed.on_train_batch_end(trainer, module, out, batch, idx)
            if getattr(self, "profiler", None) is not None and trainer.global_step == args.warmup + 2:
                self.profiler.__exit__(None, None, None)
                averages = self.profiler.key_averages()
                print("PROFILE (2 steps, rank 0) by device time\n" + averages.table(sort_by="self_device_time_total", row_limit=22),
                      "\nPROFILE by CPU time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
                self.profiler = None

        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            device = trainer.strategy.root_device
            # A step is as slow as its slowest rank: take the max over ranks, step by step.
            times = torch.tensor([self.step_s, self.loop_s], dtype=torch.float64, device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            # Peak over the fit, and what was still allocated when this variant started (earlier variants of the same
            # processes leave next to nothing: tests/test_teardown.py).
            if cuda:  # with cuda_graphs, the resident peak: the pool's uncounted bytes added (benchmarks/tools/graph_memory.py)
                self.graphed.on_train_end(trainer, module)
            mem = ([self.graphed.peak(device), torch.cuda.max_memory_reserved(device), self.start_mem,
                    self.graphed.pool_bytes] if cuda else [0, 0, 0, 0])
            mem = torch.tensor(mem, dtype=torch.float64, device=device)  # max over ranks, on the NCCL device
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            # Bytes of the last step summed over ranks, per traffic kind (the strategy's own accounting).
            stats, kinds = trainer.strategy.communication_stats("last_step"), list(TRAFFIC_KINDS)
            sent = torch.tensor([[stats[k]["bytes_before"], stats[k]["bytes_after"]] for k in kinds],
                                dtype=torch.float64, device=device)
            dist.all_reduce(sent)
            if trainer.global_rank == 0:
                self.result.write_text(json.dumps({
                    "comm_bytes_last_step": {k: {"before": int(b), "after": int(a)} for k, (b, a) in zip(kinds, sent.tolist())},
                    "step_s": times[0].tolist(), "loop_s": times[1].tolist(), "final_loss": self.loss,
                    # the measured link behind SC's default (None where nothing was measured)
                    "dp_link_gbps": trainer.strategy.data_parallel_link_gbps,
                    "sc_on_rank0": trainer.strategy.selective_compression is not None,
                    "peak_mem_gb": mem[0].item() / 1e9 if cuda else None,
                    "peak_reserved_gb": mem[1].item() / 1e9 if cuda else None,
                    "start_mem_gb": mem[2].item() / 1e9 if cuda else None,
                    # CUDA graphs' pool (0 without graphs); peak_mem_gb adds the part of it the allocator does not count
                    "graph_pool_gb": mem[3].item() / 1e9 if cuda else None,
                    "device_name": torch.cuda.get_device_name(device) if cuda else "cpu"}))

    schedule, virtual_stages = layout_schedule(args, pp)

    def run_variant(variant: str) -> None:
        """A fresh strategy, trainer and model, trained. A function of its own, so that they all die with its frame:
        in the worker's frame, the ``f_locals`` snapshot that ``save_hyperparameters`` takes of its caller (here when
        the data module is built) kept the previous variant's model, trainer and optimizer state allocated until the
        next variant built its modules, after its ``start_mem`` and peak-memory reset."""
        mode, _, callback = variant.partition("+")
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        strategy = Compressed3DStrategy(**nest_options(dict(
            data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                        num_microbatches=args.num_microbatches, schedule=schedule,
                                        virtual_stages=virtual_stages, sequence_parallel=args.sequence_parallel,
                                        pipeline_layer_split=[int(x) for x in args.pipeline_layer_split.split(",")]
                                        if args.pipeline_layer_split else None,
                                        cb_rank=args.cb_rank, sc_rank=args.sc_rank, sc_warmup=args.sc_warmup,
                                        cuda_graphs=args.cuda_graphs, **mode_options(mode, pp), **diagnosis_timeout())))
        timer = StepTimer(variant_result_path(args.result, variant))
        log_dir = args.result.with_name(f"{args.result.stem}.{variant}.logs")
        trainer = pl.Trainer(
            accelerator=args.accelerator, devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
            precision=args.precision, max_steps=max_steps, enable_checkpointing=False,
            logger=CSVLogger(log_dir, name="", version=""), log_every_n_steps=1,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            use_distributed_sampler=True, callbacks=[timer, *benchmark_callbacks(callback, args, log_dir)],
        )
        torch.manual_seed(0)
        if args.model == "t5":
            data = SyntheticSeq2SeqDataModule(vocab_size=args.vocab_size, input_length=args.seq_length,
                                              target_length=args.target_length, batch_size=per_replica,
                                              num_samples=per_replica * dp * (max_steps + 1))
            # The special ids from the data, as the CLI links them (Lightning's logger refuses differing hparams).
            model = T5(preset_name=args.preset, vocab_size=args.vocab_size, pad_token_id=data.pad_token_id,
                       eos_token_id=data.eos_token_id, activation_checkpointing=args.activation_checkpointing,
                       compile=compile_option(args.compile))
        else:
            model = GPT(preset_name=args.preset, seq_length=args.seq_length, vocab_size=args.vocab_size,
                        activation_checkpointing=args.activation_checkpointing, compile=compile_option(args.compile))
            data = SyntheticLMDataModule(vocab_size=args.vocab_size, seq_length=args.seq_length, batch_size=per_replica,
                                         num_samples=per_replica * dp * (max_steps + 1))
        trainer.fit(model, datamodule=data)

    for variant in args.compression:  # one process group, one variant after the other
        run_variant(variant)


def mode_options(mode: str, pp: int) -> dict:
    options = dict(COMPRESSION_MODES[mode])
    if options.get("compressed_stages") == "every":
        options["compressed_stages"] = list(range(pp))
    return options


def compile_option(flag: str) -> bool | str:
    """--compile off|default|MODE -> the recipes' ``compile`` argument."""
    return {"off": False, "default": True}.get(flag, flag)


def diagnosis_timeout() -> dict:
    """``L3D_PG_TIMEOUT=seconds``: a short collective timeout, so NCCL's watchdog names a stuck operation (and its
    element count) instead of waiting the default 30 minutes."""
    seconds = os.environ.get("L3D_PG_TIMEOUT")
    return {"timeout": datetime.timedelta(seconds=float(seconds))} if seconds else {}


def variant_result_path(result: Path, variant: str) -> Path:
    return result.with_name(f"{result.stem}.{variant}.json")


def benchmark_callbacks(name: str, args: argparse.Namespace, log_dir: Path) -> list:
    """The callbacks of one overhead variant, each at its most expensive useful setting (every step)."""
    from lightning_3d.callbacks import (
        CommunicationMonitor,
        CompressionDiagnostics,
        CompressionStateMonitor,
        PipelineTimeline,
        ThroughputMFUMonitor,
    )

    every = max(1, args.steps // 3)  # diagnostics sample every few steps: a few sampled steps fall in the window
    make = {"state": lambda: [CompressionStateMonitor(log_every_n_steps=1)],
            "diagnostics": lambda: [CompressionDiagnostics(every_n_steps=every, plot=True)],
            "comm": lambda: [CommunicationMonitor(log_every_n_steps=1)],
            "throughput": lambda: [ThroughputMFUMonitor(window_size=4)],
            "timeline": lambda: [PipelineTimeline(step=args.warmup + 2, output_dir=str(log_dir))]}
    if name == "allcb":
        return [cb for key in ("state", "diagnostics", "comm", "throughput", "timeline") for cb in make[key]()]
    return make[name]() if name else []


# ----- driver ----------------------------------------------------------------------------------------------
def launch(args: argparse.Namespace, layout: tuple[int, int, int], log_dir: Path, worker_argv: list[str]) -> dict:
    """Run one layout's variants: ``{variant: raw result}``. Once more if the rendezvous port was taken meanwhile
    (the free-port pick can race)."""
    results = _launch_once(args, layout, log_dir, worker_argv)
    if any("EADDRINUSE" in r.get("error", "") for r in results.values()):
        results = _launch_once(args, layout, log_dir, worker_argv)
    return results


def _launch_once(args: argparse.Namespace, layout: tuple[int, int, int], log_dir: Path, worker_argv: list[str]) -> dict:
    """Run one layout in fresh processes; per variant the rank-0 result, or an error with the failing log's tail."""
    world = layout[0] * layout[1] * layout[2]
    name = "dp{}_pp{}_tp{}".format(*layout)
    result_path = log_dir / f"{name}.json"
    for variant in args.compression:
        variant_result_path(result_path, variant).unlink(missing_ok=True)
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    inherited = {k: v for k, v in os.environ.items() if k not in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")}
    env_base = {**inherited, **ALWAYS_ENV, **REGIMES[args.regime], "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "PYTHONUNBUFFERED": "1"}
    env_base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does; the host only feeds the GPUs
    cmd = [sys.executable, str(Path(__file__).resolve()), *worker_argv, "--worker",
           "--layout", ",".join(map(str, layout)), "--result", str(result_path)]
    procs, logs = [], []
    start, failure = time.monotonic(), None
    try:
        # A SIGTERM while a worker is being started would leave that worker (already forked, not yet in `procs`) out
        # of the cleanup below: hold it until every worker is tracked (see _on_sigterm).
        _SIGTERM["deferred"] = True
        for rank in range(world):
            logs.append(log_dir / f"{name}.rank{rank}.log")
            env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                              start_new_session=True))
        _SIGTERM["deferred"] = False
        if _SIGTERM["pending"] is not None:
            sys.exit(128 + _SIGTERM["pending"])
        while any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failure = (f"rank {bad[0]} exited with code {procs[bad[0]].returncode}", bad[0])
                time.sleep(3)  # let the other ranks print their side, then stop them
                break
            if time.monotonic() - start > args.timeout:
                failure = (f"timed out after {args.timeout:.0f}s (each rank's stacks at that moment are in its log)", 0)
                for p in procs:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(3)
                break
            time.sleep(0.2)
    finally:  # also when the driver itself is stopped (SIGTERM, Ctrl-C): no worker may outlive it on the GPUs
        _SIGTERM["deferred"] = False
        for p in procs:  # each worker leads its own session: stop it and whatever it started, then reap it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    wall = round(time.monotonic() - start, 1)
    if args.profile and logs:
        # Rank 0 prints its profiler tables into its log; a time-limited remote job often brings back stdout, not a folder of logs.
        text = logs[0].read_text(errors="replace")
        at = text.find("PROFILE (2 steps")
        while at >= 0:
            after = text.find("PROFILE (2 steps", at + 1)  # each variant's tables once, up to the next variant's
            print("\n".join(text[at : after if after >= 0 else len(text)].splitlines()[:PROFILE_LINES]), flush=True)
            at = after
    if failure is None and any(p.returncode for p in procs):
        failure = (f"exit codes {[p.returncode for p in procs]}", next(r for r, p in enumerate(procs) if p.returncode))
    done = {v: json.loads(variant_result_path(result_path, v).read_text()) for v in args.compression
            if variant_result_path(result_path, v).exists()}
    if failure is None and len(done) < len(args.compression):
        failure = ("rank 0 wrote no result", 0)
    error = None
    if failure is not None:  # the reason, then the last lines of the failing rank's log
        text = logs[failure[1]].read_text(errors="replace")
        if "EADDRINUSE" in text:
            failure = (f"{failure[0]} (EADDRINUSE)", failure[1])
        log_tail = "\n".join(text.splitlines()[-25:])
        error = {"error": f"{failure[0]}; log {logs[failure[1]]}:\n{log_tail}"}
    # wall_s: the whole launch (process start, every variant), the same for all its rows
    return {v: {**(done[v] if v in done else error), "wall_s": wall} for v in args.compression}


def summarize(args: argparse.Namespace, layout: tuple[int, int, int], variant: str, raw: dict,
              flops_per_token: float) -> dict:
    """One result row: throughput from the median step time (max over ranks), its spread, peak memory."""
    world = layout[0] * layout[1] * layout[2]
    row: dict[str, Any] = {"layout": list(layout), "variant": variant, "world_size": world, "schedule": layout_schedule(args, layout[1])[0],
                           "num_microbatches": args.num_microbatches, "micro_batch_size": args.micro_batch_size,
                           "seq_length": args.seq_length, "tokens_per_step": layout[0] * args.micro_batch_size
                           * args.num_microbatches * sample_tokens(args)}
    if args.model == "t5":
        row["target_length"] = args.target_length
    if "error" in raw:
        return {**row, **raw}
    step_s, loop_s = np.asarray(raw.pop("step_s")), np.asarray(raw.pop("loop_s"))
    ms = np.percentile(step_s * 1e3, [50, 10, 90, 0, 100]).tolist()
    tokens_s = row["tokens_per_step"] / np.median(step_s)
    tflops = flops_per_token * tokens_s / world / 1e12
    return {**row, "tokens_per_s": tokens_s, "tflops_per_gpu": tflops,
            "mfu": tflops / PEAK_TFLOPS if args.accelerator == "gpu" else None,
            "step_ms": {**dict(zip(("median", "p10", "p90", "min", "max"), ms)), "mean": float(step_s.mean()) * 1e3,
                        "n": len(step_s)},
            "loop_ms_median": float(np.median(loop_s)) * 1e3, **raw, "error": None}


def sample_tokens(args: argparse.Namespace) -> int:
    """Tokens of one sample: GPT's sequence, T5's input plus target (the count its FLOPs per token refer to)."""
    return args.seq_length + (args.target_length if args.model == "t5" else 0)


def model_config(args: argparse.Namespace) -> tuple[Any, float, str]:
    """(recipe config, training FLOPs per token, the FLOPs convention) of the benchmarked model."""
    if args.model == "t5":
        from lightning_3d.recipes.t5.config import preset as t5_preset

        config = t5_preset(args.preset, vocab_size=args.vocab_size)
        return config, config.flops_per_token(args.seq_length, args.target_length), T5_FLOPS_FORMULA
    from lightning_3d.recipes.gpt.config import preset

    config = preset(args.preset, vocab_size=args.vocab_size, seq_length=args.seq_length)
    return config, config.flops_per_token(args.seq_length), FLOPS_FORMULA


def environment(args: argparse.Namespace) -> dict:
    import lightning

    gpus: list[str] = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # nvidia-smi: the driver makes no CUDA context
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        gpus = [line.strip() for line in out.stdout.splitlines() if line.strip()] if args.accelerator == "gpu" else []
    nccl = str(torch.cuda.nccl.version()) if args.accelerator == "gpu" else None
    return {"command": shlex.join(["python", *sys.argv]),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "python": sys.version.split()[0], "torch": torch.__version__, "lightning": lightning.__version__,
            "cuda": torch.version.cuda, "nccl": nccl, "gpus": gpus, "accelerator": args.accelerator,
            "regime": args.regime, "worker_env": {**ALWAYS_ENV, **REGIMES[args.regime]},
            "switches": {k: v for k, v in os.environ.items()
                         if k.startswith("L3D_TP_") or k == "CUDA_DEVICE_MAX_CONNECTIONS"}}


def table(rows: list[dict], header: str) -> str:
    cols = ["layout (dp,pp,tp)", "variant", "vs first", "schedule", "M", "mb", "seq", "tokens/s", "TFLOP/s/GPU", "MFU %",
            "step ms median [p10-p90]", "peak mem GB", "error"]
    lines = []
    for r in rows:
        ok = r.get("error") is None
        first = next(b for b in rows if b["layout"] == r["layout"])  # the layout's first variant: the baseline
        speedup = (f"{r['tokens_per_s'] / first['tokens_per_s']:.2f}x" if ok and first.get("error") is None else "-")
        lines.append([
            ",".join(map(str, r["layout"])), r["variant"], speedup, r["schedule"], str(r["num_microbatches"]), str(r["micro_batch_size"]),
            f"{r['seq_length']}+{r['target_length']}" if "target_length" in r else str(r["seq_length"]),
            f"{r['tokens_per_s']:,.0f}" if ok else "-",
            f"{r['tflops_per_gpu']:.{1 if r['tflops_per_gpu'] >= 1 else 3}f}" if ok else "-",
            (f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "n/a") if ok else "-",
            "{median:.1f} [{p10:.1f}-{p90:.1f}]".format(**r["step_ms"]) if ok else "-",
            f"{r['peak_mem_gb']:.2f}" if ok and r["peak_mem_gb"] is not None else ("n/a" if ok else "-"),
            "" if ok else r["error"].strip().splitlines()[-1][:80],
        ])
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    fmt = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([header, fmt(cols), "-+-".join("-" * w for w in widths), *(fmt(line) for line in lines)])


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    layouts = [parse_layout(text) for text in args.layouts]
    if args.devices is None:
        args.devices = torch.cuda.device_count() if args.accelerator == "gpu" else max(a * b * c for a, b, c in layouts)
    config, flops_per_token, flops_formula = model_config(args)
    env = environment(args)
    log_dir = args.out.resolve().with_name(args.out.stem + "_logs")  # workers run in the repo root
    log_dir.mkdir(parents=True, exist_ok=True)
    header = (f"{args.model.upper()} {args.preset} (N={config.num_parameters() / 1e6:.1f}M, {flops_per_token / 1e9:.3f} GFLOP/token),"
              f" {args.precision}, regime={args.regime}, {args.steps} timed steps after {args.warmup}\n"
              f"{flops_formula}; TFLOP/s/GPU = FLOPs/token * tokens/s / GPUs; MFU = that / {PEAK_TFLOPS:.0f}\n"
              f"{BATCH_NOTE}; M = micro-batches per step, mb = micro-batch size; step time = max over ranks;"
              f" 'vs first' = tokens/s relative to the layout's first variant (same processes, same run)")
    print(f"command: {env['command']}\n{env['date_utc']}  torch {env['torch']}  lightning {env['lightning']}  "
          f"CUDA {env['cuda']}  NCCL {env['nccl']}  GPUs: {', '.join(env['gpus']) or args.accelerator}", flush=True)
    report = {"environment": env, "model_name": args.model, "flops_convention": flops_formula, "flops_per_token": flops_per_token,
              "num_parameters": config.num_parameters(), "peak_tflops_per_gpu": PEAK_TFLOPS,
              "batch_convention": BATCH_NOTE,
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                         if k not in ("worker", "layout", "result")},
              "model": config.to_dict(), "results": []}
    for layout in layouts:
        world = layout[0] * layout[1] * layout[2]
        print(f"layout dp={layout[0]} pp={layout[1]} tp={layout[2]} on {world} processes,"
              f" variants {' '.join(args.compression)} ...", flush=True)
        too_big = {"error": f"needs {world} devices, {args.devices} available"}
        raws = {v: too_big for v in args.compression} if world > args.devices else launch(args, layout, log_dir, argv)
        for variant, raw in raws.items():
            row = summarize(args, layout, variant, raw, flops_per_token)
            print(f"  {variant}: " + (row["error"].strip().splitlines()[-1] if row["error"] else
                                      f"{row['tokens_per_s']:,.0f} tokens/s, median {row['step_ms']['median']:.1f} ms"),
                  flush=True)
            report["results"].append(row)
        args.out.write_text(json.dumps(report, indent=1))  # after every layout, so a crash keeps what was measured
    print("\n" + table(report["results"], header) + f"\n\nJSON: {args.out}  worker logs: {log_dir}")


#: lines of rank 0's profiler output (both tables) echoed to the driver's stdout per variant
PROFILE_LINES = 60

_SIGTERM: dict = {"deferred": False, "pending": None}


def _on_sigterm(signum: int, frame: object) -> None:
    """The driver's SIGTERM: exit through the launch's cleanup, or, while workers are being started, once they are all
    tracked by it."""
    if _SIGTERM["deferred"]:
        _SIGTERM["pending"] = signum
        return
    sys.exit(128 + signum)


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.worker:
        worker(args)
    else:
        # `timeout` and job control stop the driver with SIGTERM: turn it into SystemExit, so that the launch's
        # cleanup kills the workers (their own sessions would otherwise keep the GPUs busy) and the JSON of the
        # layouts already measured stays written.
        signal.signal(signal.SIGTERM, _on_sigterm)
        driver(args, sys.argv[1:])


if __name__ == "__main__":
    main()
