"""Training the recipe's tiny models under the strategy, timed step by step, for the overheads' measurement.

``train_tiny`` fits a model the recipe registered (``RecipeCosts.tiny``: built by the recipe, never imported by
name) under ``Compressed3DStrategy`` on one device at 1 and at several micro-batches, timing each step and its tail
(from the last backward to the step's end); ``tiny_runs`` is the set of fits ``planner.overheads.measure_overheads``
needs (the one-layer model, and its widths at the real depth without and with activation checkpointing).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping

import torch

from lightning_3d.costs import TinyModel
from lightning_3d.planner.timing import measure_optimizer

#: timed steps of each in-situ run (``tiny_runs``)
IN_SITU_STEPS = 10
#: rounds of the in-situ fits on a GPU (``measure_overheads``' default there; one on a CPU, where profiles are for tests)
IN_SITU_ROUNDS = 3


def tiny_runs(tiny: TinyModel, deep_args: dict, device: torch.device, precision: str, microbatches: int, warmup: int,
              steps: int, in_situ: bool, fuse_gradients: bool | str, adamw: dict | None = None, rounds: int = 1
              ) -> tuple[dict[int, list[float]], dict[bool, dict[int, list[float]]], dict]:
    """The tiny models' timed steps for ``measure_overheads``: the one-layer model (``tiny.model_args``) at 1 and
    ``microbatches`` micro-batches, and (``in_situ``) the tiny widths at the real depth (``deep_args``) without and
    with checkpointing; and the steps' tails (``train_tiny``'s ``tails_out``) of the one-layer model (``tail_seconds``) and of the deep ones
    (``deep_tail_seconds``), with the deep model's optimizer step (``deep_optimizer_seconds``; None without
    ``in_situ``).

    ``rounds``: the fits repeated that many times, interleaved (one-layer, deep, deep checkpointed, then again), each
    model's timed steps pooled over its fits. One fit's host seconds per micro-batch move by more between two fits of
    the same model in one process than the planner's error allows (benchmarks/RESULTS.md, 2026-12-02d), so the
    medians the overheads are read from are taken over several fits, not one."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"in-situ rounds={rounds!r}: give a positive integer (3 is the default on a GPU).")
    import logging

    # Lightning's and the strategy's start-up notes would fill the profiler's output: quiet while the tiny model trains.
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning_3d")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    # Lightning sets the rendezvous variables (MASTER_PORT, WORLD_SIZE, ...) in this process's environment: restored,
    # so that processes started after the profile (a benchmark's workers) do not inherit them.
    environ = dict(os.environ)
    step_s: dict[int, list[float]] = {}
    deep: dict[bool, dict[int, list[float]]] = {}
    deep_optimizer, tails, deep_tails = {}, {}, {}
    try:
        for r in range(rounds):
            _pool(step_s, train_tiny(tiny, tiny.model_args, tiny.data_args, device, precision, microbatches, warmup,
                                     steps, fuse_gradients, tails_out=tails))
            if in_situ:
                for rc in (False, True):
                    # Ten timed steps each: the host's seconds per step vary from step to step (the medians of five
                    # differed by tens of per cent between two profiles of the same tiny model on one machine).
                    _pool(deep.setdefault(rc, {}),
                          train_tiny(tiny, dict(deep_args, activation_checkpointing=rc), tiny.data_args, device,
                                     precision, microbatches, 3, IN_SITU_STEPS, fuse_gradients,
                                     optimizer_out=None if rc or r else deep_optimizer, tails_out=deep_tails,
                                     adamw=adamw))
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        os.environ.clear()
        os.environ.update(environ)
    return step_s, deep, {"tail_seconds": [t for m in sorted(tails) for t in tails[m]],
                          "deep_tail_seconds": [t for m in sorted(deep_tails) for t in deep_tails[m]],
                          "deep_optimizer_seconds": deep_optimizer.get("step_seconds")}




def _pool(into: dict[int, list[float]], more: dict[int, list[float]]) -> None:
    """``more``'s timed steps appended to ``into``'s, per micro-batch count."""
    for m, seconds in more.items():
        into.setdefault(m, []).extend(seconds)


def train_tiny(tiny: TinyModel, model_args: Mapping, data_args: Mapping, device: torch.device, precision: str,
               microbatches: int, warmup: int, steps: int, fuse_gradients: bool | str = "auto", samples: int = 1,
               optimizer_out: dict | None = None, tails_out: dict | None = None,
               adamw: dict | None = None) -> dict[int, list[float]]:
    """Seconds of each timed step (GPU-synchronised batch start to end) of a model of the recipe ``tiny`` belongs to
    (``tiny.build(model_args, data_args, ...)``: the tiny model's own arguments, or others), per micro-batch count
    (1 and ``microbatches``, each of ``samples`` sequences). ``optimizer_out``: filled with ``measure_optimizer``'s
    timing of the trained model's parameters (the recipes' AdamW implementation on ``device``). ``tails_out``: per
    micro-batch count, each timed step's tail, from the host's return from its last backward (Lightning's
    ``on_after_backward``, which the strategy calls once, after the engine has run every micro-batch) to the step's
    GPU-synchronised end: the non-finite check, the optimizer step, the loop's and the strategy's per-step work (and
    whatever backward work the GPU still had queued, little at tiny widths, whose steps are host-bound)."""
    import lightning.pytorch as pl

    step_s: dict[int, list[float]] = {}

    class Timer(pl.Callback):
        def __init__(self, m: int) -> None:
            self.m, self.t0 = m, 0.0

        def on_train_batch_start(self, trainer, module, batch, idx) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.t0 = time.perf_counter()
            self.backward_done = None

        def on_after_backward(self, trainer, module) -> None:
            self.backward_done = time.perf_counter()

        def on_train_batch_end(self, trainer, module, out, batch, idx) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if trainer.global_step > warmup:
                end = time.perf_counter()
                step_s.setdefault(self.m, []).append(end - self.t0)
                if tails_out is not None and self.backward_done is not None:
                    tails_out.setdefault(self.m, []).append(end - self.backward_done)

    accelerator = "gpu" if device.type == "cuda" else "cpu"
    # On a CPU the tiny model's values turn subnormal within a few steps, and subnormal arithmetic is many times
    # slower there (not on GPUs): flushed to zero while it trains, so the steps time the overheads, not that.
    flushed = device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        _fit_tiny(tiny, model_args, data_args, device, accelerator, precision, microbatches, warmup, steps, Timer,
                  fuse_gradients, samples, optimizer_out, adamw)
    finally:
        if flushed:
            torch.set_flush_denormal(False)
    return step_s


def _fit_tiny(tiny, model_args, data_args, device, accelerator, precision, microbatches, warmup, steps, Timer,
              fuse_gradients="auto", samples=1, optimizer_out=None, adamw=None) -> None:
    import lightning.pytorch as pl

    from lightning_3d.compression.config import CompressionConfig
    from lightning_3d.strategies.compressed_3d import Compressed3DStrategy
    from lightning_3d.strategies.config import PipelineConfig, RuntimeConfig

    with tempfile.TemporaryDirectory() as tmp:
        for m in (1, microbatches):
            torch.manual_seed(0)
            model, data = tiny.build(dict(model_args), dict(data_args), m * samples, m * samples * (warmup + steps + 1))
            trainer = pl.Trainer(accelerator=accelerator, devices=[device.index or 0] if accelerator == "gpu" else 1,
                                 strategy=Compressed3DStrategy(
                                     pipeline=PipelineConfig(num_microbatches=m), compression=CompressionConfig(enabled=False),
                                     runtime=RuntimeConfig(gradient_accumulation_fusion=fuse_gradients)),
                                 precision=precision if accelerator == "gpu" else "32-true", max_steps=warmup + steps,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                                 default_root_dir=tmp, callbacks=[Timer(m)])
            trainer.fit(model, datamodule=data)
            if optimizer_out is not None and m == microbatches:
                optimizer_out.update(measure_optimizer(model, device, 2, 5, adamw))
            del trainer, model, data
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


