"""The worker side of benchmarks/speed/peers.py: one system, timed the same way for all (GPU-synchronised step ends)."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import signal
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader

from benchmarks.speed.hf_peers import compile_counters, plain_peer, recipe_module, sdpa_backends_of, synthetic_data, synthetic_datamodule
from benchmarks.speed.user_gpt import user_peer
from benchmarks.tools.gpu_clocks import ClockSampler
from benchmarks.tools.graph_memory import GraphedPeak
from lightning_3d.recipes import GPT
from lightning_3d.recipes.data.loader import worker_options
from lightning_3d.recipes.gpt.model import GPTModel
from lightning_3d.recipes.training import compile_blocks, count_target_tokens
from lightning_3d.strategies.stage_builder import replicate_plain_parameters
from lightning_3d.utils.tensors import materialize_


class GCTime:
    """Python's cyclic garbage collections inside the timed steps (rank 0's process): their count per generation and
    summed time. A collection pauses the host mid-step, so on a host-bound step it shows up as step-time spread."""

    def __init__(self) -> None:
        self.counting, self.started = False, 0.0
        self.count = [0, 0, 0]
        self.seconds = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.counting:
            return
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self.started
            self.count[info["generation"]] += 1

    def timing(self, on: bool) -> None:
        self.counting = on

    def result(self, steps: int) -> dict:
        return {"collections": self.count, "ms_per_step": 1e3 * self.seconds / max(steps, 1)}


GC_TIME = GCTime()
CLOCKS: list[ClockSampler] = []  # rank 0's sampler of the GPU's clock and power (run_worker starts it on CUDA)


def timing(on: bool) -> None:
    """Count garbage collections and sample the GPU's clock during timed steps only."""
    GC_TIME.timing(on)
    for sampler in CLOCKS:
        sampler.start() if on else sampler.stop()


def run_worker(args: argparse.Namespace, system: dict) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's timeout asks for the stacks first
    torch.manual_seed(0)
    cuda = args.accelerator == "gpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if int(os.environ.get("RANK", 0)) == 0:
            CLOCKS.append(ClockSampler(torch.cuda.current_device()))
    if system["name"] in ("plain", "hf", "user"):
        result = plain_loop(args, system, torch.device("cuda") if cuda else torch.device("cpu"))
    elif system["name"] == "megatron":
        from benchmarks.speed.megatron_peer import megatron_loop  # megatron-core only when a megatron system runs

        result = megatron_loop(args, system)
    else:
        result = lightning_fit(args, system)
    if int(os.environ.get("RANK", 0)) == 0:
        args.result.write_text(json.dumps(result))
    # Tear the groups down before the interpreter does: left to interpreter shutdown, gloo's group destructors
    # occasionally abort the process ("terminate called without an active exception", exit code -6).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def make_gpt(args: argparse.Namespace, system: dict, cls: type[GPT] = GPT) -> GPT:
    return cls(preset_name=args.preset, vocab_size=args.vocab_size, seq_length=args.seq_length,
               activation_checkpointing=system["ckpt"],
               compile="max-autotune-no-cudagraphs" if system["autotune"] else system["compile"], optimizer_fused=True,
               decay_steps=1000, fp32_residual=system["fp32res"],
               sdpa_backends=sdpa_backends_of(system))


# ----- plain loops: our model, or transformers' -----------------------------------------------------------------
def plain_loop(args: argparse.Namespace, system: dict, device: torch.device) -> dict:
    """The loop a user writes by hand: autocast forward, backward per micro-batch, one fused AdamW step."""
    step_loss, optimizer = (user_peer if system["name"] == "user" else plain_peer)(args, system, device)
    m, mb = args.num_microbatches, args.micro_batch_size
    # The samples in order, micro-batch by micro-batch, collated by --num-workers processes as our data modules do
    # (none: in this process, as the loop's own indexing and stacking would).
    batches = iter(DataLoader(synthetic_data(args), batch_size=mb, shuffle=False, num_workers=args.num_workers,
                              **worker_options(args.num_workers)))
    step_s, losses, start = [], [], 0.0
    profiler = StepProfiler(args)
    for step in range(total_steps(args)):
        _sync(device)
        if timed(args, step - 1):  # a step is timed from its start to the next one's, as StepTimer times ours
            step_s.append(time.perf_counter() - start)
        profiler.at_step(step, 0)
        timing(timed(args, step))
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for _ in range(m):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
            with torch.autocast(device.type, dtype=torch.bfloat16):
                summed = step_loss(batch)
            loss = summed / count_target_tokens(batch["labels"]) / m
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))  # synchronises, as Lightning's loss logging does
        _sync(device)
    profiler.finish()
    return _result(step_s, losses, device)


# ----- Lightning systems -----------------------------------------------------------------------------------------
class FSDPGPT(GPT):
    """The GPT recipe as a ``ModelParallelStrategy`` user writes it: TP plan, per-block compile, then FSDP2."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from lightning_3d.recipes.gpt.parallelize import parallelize_gpt

        if self.model is not None:
            return
        mesh = self.device_mesh
        tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
        with torch.device("meta"):
            self.model = GPTModel(self.config, self.config.padded_vocab_size(tp_mesh.size()),
                                  self.hparams.activation_checkpointing)
        if tp_mesh.size() > 1:
            # torch's DTensor plan, as a ModelParallelStrategy user writes it (not our local-tensor layers)
            parallelize_gpt(self.model, tp_mesh, implementation="dtensor")
            replicate_plain_parameters(self.model, tp_mesh)  # FSDP2 then shards one kind of parameter
        if self.hparams.compile:
            compile_blocks(self.model.layers.values(), self.hparams.compile)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in self.model.layers.values():
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(self.model, mesh=dp_mesh, mp_policy=policy)
        materialize_(self.model, self.trainer.strategy.root_device)
        self.init_weights()

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():  # vocab-parallel cross-entropy needs its context in backward too
            super().backward(loss, *args, **kwargs)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return super().training_step(batch, batch_idx)


class StepTimer(pl.Callback):
    """Wall time of an optimizer step: from the start of its first batch to the start of the next step's first batch,
    both GPU-synchronised. So a step holds everything the loop does for it (Lightning's hooks between batches, the
    data loader's fetch and collation, the copy to the device), as the plain loop's steps hold their own; timed from
    batch start to batch end, those would fall between the timed windows and a Lightning system would look faster
    than its throughput."""

    def __init__(self, batches_per_step: int, args: argparse.Namespace, profiler: StepProfiler) -> None:
        self.batches_per_step, self.args, self.profiler = batches_per_step, args, profiler
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self._start = 0.0
        self._loss: Tensor | float = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, idx: int) -> None:
        if idx % self.batches_per_step == 0:
            _sync(trainer.strategy.root_device)
            step = trainer.global_step  # finished steps: this step's index
            if timed(self.args, step - 1):
                self.step_s.append(time.perf_counter() - self._start)
            self.profiler.at_step(step, trainer.global_rank)
            timing(timed(self.args, step))
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, out: Any, batch: Any, idx: int) -> None:
        # Lightning hands back each batch's loss divided by the accumulation count: their sum is the step's mean.
        # Summed on the device and read once per step, as the plain loop does: reading it per micro-batch would stall
        # the accumulating peers (DDP, FSDP2) on a host sync that ours, one call per step, does not pay.
        self._loss = self._loss + (out["loss"] if isinstance(out, dict) else out).detach()
        if (idx + 1) % self.batches_per_step == 0:
            loss = float(self._loss)
            _sync(trainer.strategy.root_device)
            self.losses.append(loss)
            self._loss = 0.0

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        self.profiler.finish()


def fusion_option(system: dict) -> bool | str:
    """Ours' ``gradient_accumulation_fusion``: +nofuse False, +fuse True, else the strategy's default "auto"."""
    return False if system["nofuse"] else True if system["fuse"] else "auto"


def ours_strategy(args: argparse.Namespace, system: dict) -> Any:
    """The ``Compressed3DStrategy`` of an ``ours`` system, as its suffixes set it."""
    from lightning_3d import Compressed3DStrategy
    from lightning_3d.strategies.config import nest_options

    return Compressed3DStrategy(**nest_options(dict(
        data_parallel_size=system["dp"], pipeline_parallel_size=system["pp"], tensor_parallel_size=system["tp"],
        num_microbatches=args.num_microbatches, schedule=args.schedule if system["pp"] > 1 else "1f1b",
        compression=system["cc"], fused_embedding_sync=system["cc"], gradient_accumulation_fusion=fusion_option(system),
        # CPU runs of the script (its tests) ignore CUDA-graph modes, as for the plain model
        cuda_graphs=bool(system["cudagraphs"]) and torch.cuda.is_available(),
        **({"gc_interval": None} if system["pygc"] else {"gc_interval": 1} if system["gc1"] else {}),
        **({"on_nonfinite": "ignore"} if system["nocheck"] else {}))))


def lightning_fit(args: argparse.Namespace, system: dict) -> dict:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    m, mb = args.num_microbatches, args.micro_batch_size
    name = system["name"]
    if name == "ours":
        strategy = ours_strategy(args, system)
        module, batch, accumulate = recipe_module(args, system), mb * m, 1
    elif name == "ddp":
        strategy = DDPStrategy(gradient_as_bucket_view=True)
        module, batch, accumulate = recipe_module(args, system), mb, m
    else:
        strategy = ModelParallelStrategy(data_parallel_size=system["dp"], tensor_parallel_size=system["tp"],
                                         save_distributed_checkpoint=True)
        module, batch, accumulate = make_gpt(args, system, FSDPGPT), mb, m
    steps = total_steps(args)
    timer = StepTimer(accumulate, args, StepProfiler(args))
    graphed = GraphedPeak()  # with cuda_graphs, the resident peak (benchmarks/tools/graph_memory.py)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=system["world"], strategy=strategy,
                         precision="bf16-mixed", max_steps=steps, accumulate_grad_batches=accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[timer, graphed])
    data = synthetic_datamodule(args, batch, batch * system["dp"] * accumulate * (steps + 1))
    trainer.fit(module, datamodule=data)
    device = trainer.strategy.root_device
    times = torch.tensor(timer.step_s, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return _result(times.tolist(), timer.losses, device, reduce=True, graphed=graphed)


class StepProfiler:
    """``--profile``: rank 0 records two extra steps after the timed ones with torch.profiler (so the profiler's
    overhead stays out of the timings) and prints the kernel table; ``--trace``: it also writes their timeline
    (Chrome trace, gzip) beside the system's result."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.first = args.warmup + args.steps if args.profile or args.trace else -1
        self.trace = args.result.with_suffix(".trace.json.gz") if args.trace and args.result else None
        self._prof = None

    def at_step(self, step: int, rank: int) -> None:
        if rank != 0 or self.first < 0:
            return
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()
        elif step == self.first + 2:
            self.finish()

    def finish(self) -> None:
        """Close the recording (after the second profiled step, or when training ends right after it) and report."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            if self.trace is not None:
                self._prof.export_chrome_trace(str(self.trace))  # a .gz name is written compressed
            averages = self._prof.key_averages()
            print("PROFILE (2 steps, rank 0) by device time\n"
                  + averages.table(sort_by="self_device_time_total", row_limit=30)
                  + "\nPROFILE by CPU time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
            self._prof = None


def total_steps(args: argparse.Namespace) -> int:
    """Warm-up and timed steps, then the two profiled steps if asked for, else one more: the start of the step after
    the last timed one ends its timing."""
    return args.warmup + args.steps + (2 if args.profile or args.trace else 1)


def timed(args: argparse.Namespace, step: int) -> bool:
    """Whether step ``step`` (0-based) is one of the timed steps, which follow the warm-up."""
    return args.warmup <= step < args.warmup + args.steps


def _result(step_s: list[float], losses: list[float], device: torch.device, reduce: bool = False,
            graphed: GraphedPeak | None = None) -> dict:
    cuda = device.type == "cuda"
    counted = (graphed.peak(device) if graphed is not None else torch.cuda.max_memory_allocated(device)) if cuda else 0
    peak = torch.tensor([counted], dtype=torch.float64, device=device)
    if reduce:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    # Allocator retries (cudaMalloc failed, cache flushed, retried): a step near the memory limit that varies in time.
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0
    timing(False)
    return {"clocks": CLOCKS[0].result() if CLOCKS else None, "step_s": step_s, "first_loss": losses[0],
            "final_loss": losses[-1], "peak_mem_gb": peak.item() / 1e9,
            "alloc_retries": int(retries), "compile": compile_counters(), "gc": GC_TIME.result(len(step_s)),
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
