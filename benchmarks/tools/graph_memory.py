"""The resident peak memory of a fit with ``Compressed3DStrategy(cuda_graphs=True)``, for the benchmarks' tables.

A replay allocates nothing, so the activations a graphed micro-batch keeps between its forward and backward graph
live in pool blocks that the caching allocator counts as free, and ``torch.cuda.max_memory_allocated`` leaves them
out (docs/speed.md, "CUDA graphs"). The captures happen in the first step, each counted while it runs; from then on
the pool's uncounted bytes (``StageGraphs.memory``) are constant. So the resident peak is the larger of the first
step's counted peak and the later steps' counted peak plus those bytes."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


def stage_graphs(trainer: pl.Trainer) -> Any:
    """The strategy's CUDA graphs (``StageGraphs``), or None (not ours, or graphs off)."""
    runtime = getattr(trainer.strategy, "pipeline_runtime", None)
    return getattr(runtime, "graphs", None)


class GraphedPeak(pl.Callback):
    """Add to a fit's callbacks; after the fit, ``peak(device)`` is the resident peak in bytes (with graphs off:
    ``max_memory_allocated``), ``pool_bytes`` the graphs' pool."""

    def __init__(self) -> None:
        self.capture_peak: int | None = None  # the first step's counted peak; None: no graphs seen
        self.pool = {"reserved": 0, "allocated": 0}

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == 1 and self.capture_peak is None and stage_graphs(trainer) is not None:
            device = trainer.strategy.root_device
            self.capture_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:  # before the strategy's teardown frees them
        graphs = stage_graphs(trainer)
        if graphs is not None:
            self.pool = graphs.memory()

    @property
    def pool_bytes(self) -> int:
        return self.pool["reserved"]

    def peak(self, device: torch.device) -> int:
        counted = torch.cuda.max_memory_allocated(device)
        if self.capture_peak is None:
            return counted
        return max(self.capture_peak, counted + self.pool["reserved"] - self.pool["allocated"])
