"""The fit check: before any collective, every rank estimates the peak memory per GPU of the configured layout and
stops with an error that names the estimate per component, the card's memory and the changes that would fit.

The estimate is the planner's memory model (``costs/memory.py``: weights, gradients, optimizer state, stored
activations × the micro-batches the schedule keeps in flight, the largest transient), for models a recipe registered
with ``lightning_3d.costs.register_recipe`` (GPT, T5); any other module is not checked (a debug log says so), since
a guess about a model one cannot read would give false errors. Every rank computes the same numbers for every
pipeline rank and compares the largest with its own card, so a job on equal GPUs fails on every rank alike without
communicating.

Measured against real peaks, this estimate errs both ways, over-predicting most at long sequences with checkpointing
(benchmarks/RESULTS.md#2026-11-27-long-sequence, docs/context_parallel.md), so ``memory_check="error"`` raises only
when the estimate exceeds the usable memory by more than ``MARGIN`` (then even the largest measured over-prediction
still does not fit) and warns between the two. docs/context_parallel.md ("Will it fit?").
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from lightning_3d.costs import AnalyticCostModel, ModelShape, model_shape, recipe_costs
from lightning_3d.costs.memory import GIB, MemoryLayout, RankMemory, layout_memory
from lightning_3d.strategies.protocol import split_layers

log = logging.getLogger(__name__)

MEMORY_CHECKS = ("error", "warn", "off")
#: What the estimate may exceed the usable memory by before "error" raises: above the estimate's largest measured
#: over-prediction (docs/context_parallel.md, "The margin"), with a few percent for what was not measured.
MARGIN = 0.30
#: CUDA context, allocator fragmentation and communication buffers (the planner's ``Workload.memory_reserve``).
RESERVE = 1.5 * GIB
#: Device memory in GiB to check against instead of the card's (tests on CPU, or planning for a smaller card).
CAPACITY_ENV = "LIGHTNING_3D_DEVICE_MEMORY_GIB"
BYTES = {"32-true": 4, "bf16-mixed": 2, "bf16-true": 2}


def size(nbytes: float) -> str:
    """Bytes as GiB (one decimal), or MiB below one GiB (tiny models, tests)."""
    return f"{nbytes / GIB:.1f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.1f} MiB"


def device_capacity(device: torch.device) -> float | None:
    """Bytes of memory of ``device``: ``$LIGHTNING_3D_DEVICE_MEMORY_GIB`` if set, the CUDA card's total, else None."""
    value = os.environ.get(CAPACITY_ENV)
    if value:
        try:
            gib = float(value)
        except ValueError:
            gib = math.nan
        if not gib > 0:
            raise ValueError(f"{CAPACITY_ENV}={value!r} must be a positive number of GiB (the device memory to check"
                             " against); unset it to use the card's.")
        return gib * GIB
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return None


class DoesNotFitError(ValueError):
    """The configuration's estimated peak memory exceeds the card's (by more than the margin)."""


@dataclass(frozen=True)
class Workload:
    """A recognised model's shape and lengths, and the layout it trains in."""

    name: str
    shape: ModelShape
    seq_len: int
    target_len: int | None
    layout: MemoryLayout

    def estimate(self) -> list[RankMemory]:
        # Analytic: at setup there is no profile to read; its "not measured" warning is for planners, here the
        # margin accounts for the error.
        cost = AnalyticCostModel(self.shape, warn=False)
        return layout_memory(cost, self.shape, self.seq_len, self.layout, self.target_len)

    def describe(self) -> str:
        lay = self.layout
        ckpt = lay.stage_checkpointing
        checkpointing = "on" if all(ckpt) else "off" if not any(ckpt) else f"stages {[i for i, c in enumerate(ckpt) if c]}"
        length = f"sequence {self.seq_len}" + (f", target {self.target_len}" if self.target_len else "")
        return (f"{self.name}, {length}, micro-batch {lay.microbatch_size} x {lay.num_microbatches}, dp {lay.dp} x"
                f" pp {lay.pp} x cp {lay.cp} x tp {lay.tp}, {lay.schedule}, {lay.precision}, activation checkpointing"
                f" {checkpointing}, chunked loss {'on' if lay.chunked_loss else 'off'}, optimizer state"
                f" {'sharded' if lay.shard_optimizer_state and lay.dp * lay.cp > 1 else 'replicated'}")


def read_workload(module: Any, datamodule: Any, *, dp: int, pp: int, tp: int, cp: int, precision: str, options: Any
                  ) -> Workload | None:
    """The workload of ``module`` if a recipe registered its class (None otherwise): shape from its ``config``, lengths
    and the batch from the registered reader and the data module's ``hparams``, checkpointing and the chunked loss
    from the module's ``hparams`` (``activation_checkpointing``, ``fused_head_loss``) unless the strategy's
    ``stage_activation_checkpointing`` says otherwise."""
    cls = type(module)
    try:
        costs = recipe_costs(f"{cls.__module__}.{cls.__qualname__}")
    except ValueError:
        log.debug("fit check skipped: %s is not a model the memory model knows (no registered recipe)", cls.__qualname__)
        return None
    hparams = dict(getattr(module, "hparams", None) or {})
    data = dict(getattr(datamodule, "hparams", None) or {})
    element = BYTES.get(precision, 2)
    try:
        shape = model_shape(module.config, bytes_per_element=element, tensor_parallel_size=tp)
        _, seq_len, target_len = costs.workload(hparams, data, element)
        layers = int(module.num_pipeline_layers())
    except (AttributeError, TypeError, ValueError) as err:
        log.debug("fit check skipped: %s", err)
        return None
    stages = pp * options.virtual_stages
    blocks = len(shape.layer_kinds()) - 2
    if layers != blocks or stages > layers:
        return None  # the model's own split check reports it, with its own words
    try:
        split = tuple(len(r) for r in split_layers(layers, stages, options.pipeline_layer_split))
    except ValueError:
        return None
    checkpointing = options.stage_activation_checkpointing
    if checkpointing is None:
        checkpointing = (bool(hparams.get("activation_checkpointing", False)),) * stages
    batch = data.get("batch_size")
    m = options.num_microbatches
    # An unknown batch (loaders passed directly, or a data module that forms its own micro-batches) counts as one
    # sequence per micro-batch: the estimate may then only be low, never high.
    microbatch = max(1, math.ceil(int(batch) / m)) if isinstance(batch, int) and not isinstance(batch, bool) else 1
    config = module.config
    positions = config.seq_length * config.hidden_size if shape.family == "gpt" and hasattr(config, "seq_length") else 0
    layout = MemoryLayout(split, tuple(checkpointing), microbatch, m, options.schedule, options.virtual_stages, dp, pp,
                          tp, cp, options.sequence_parallel, precision, options.shard_optimizer_state,
                          bool(hparams.get("fused_head_loss", False)), positions,
                          bool(getattr(config, "tie_embeddings", False)), options.cuda_graphs)
    return Workload(cls.__name__, shape, seq_len, target_len, layout)


@dataclass(frozen=True)
class FitReport:
    """The estimate of every pipeline rank against one card."""

    workload: Workload
    ranks: list[RankMemory]
    capacity: float

    @property
    def usable(self) -> float:
        return self.capacity - RESERVE

    @property
    def worst(self) -> int:
        return max(range(len(self.ranks)), key=lambda r: self.ranks[r].total)

    @property
    def peak(self) -> float:
        return self.ranks[self.worst].total

    def verdict(self) -> Literal["fits", "may not fit", "does not fit"]:
        if self.peak <= self.usable:
            return "fits"
        return "may not fit" if self.peak <= self.usable * (1 + MARGIN) else "does not fit"

    def fixes(self) -> list[tuple[str, float]]:
        """Changes to the configuration, each with the peak (bytes) it would have: those on the same GPUs first, then
        those that take more (context and tensor parallelism, up to the first degree that fits)."""
        lay, w = self.workload.layout, self.workload
        out: list[tuple[str, MemoryLayout]] = []
        if not all(lay.stage_checkpointing):
            out.append(("activation checkpointing on every stage (the model's activation_checkpointing=True, or the"
                        " strategy's stage_activation_checkpointing)",
                        replace(lay, stage_checkpointing=(True,) * len(lay.stage_checkpointing))))
        if not lay.chunked_loss and lay.tp == 1 and w.shape.family == "gpt":
            out.append(("the chunked loss (the model's fused_head_loss=True)", replace(lay, chunked_loss=True)))
        if lay.shard_optimizer_state is False and lay.dp * lay.cp > 1:
            out.append(("shard_optimizer_state=True", replace(lay, shard_optimizer_state=True)))
        mbs = lay.microbatch_size // 2
        while mbs >= 1:
            smaller = replace(lay, microbatch_size=mbs, num_microbatches=lay.num_microbatches * lay.microbatch_size // mbs)
            out.append((f"micro-batches of {mbs} (num_microbatches={smaller.num_microbatches}, the same batch)", smaller))
            if self._peak(smaller) <= self.usable or mbs == 1:
                break
            mbs //= 2
        for size in (2, 4, 8):
            cp = lay.cp * size
            # Context parallelism is the GPT recipe's (T5 has none), on sequences that split into 2·cp zigzag chunks.
            if w.shape.family != "gpt" or w.seq_len % (2 * cp):
                break
            fewer = f", or data_parallel_size={lay.dp // size}" if lay.dp % size == 0 else ""
            out.append((f"context_parallel_size={cp} ({size}x the GPUs{fewer})", replace(lay, cp=cp)))
            if self._peak(out[-1][1]) <= self.usable:
                break
        heads = w.shape.num_heads
        for size in (2, 4, 8):
            tp = lay.tp * size
            if heads % tp or w.shape.hidden_size % tp:
                break
            note = "; without the chunked loss, which needs tp 1" if lay.chunked_loss else ""
            out.append((f"tensor_parallel_size={tp} ({size}x the GPUs{note})", replace(lay, tp=tp, chunked_loss=False)))
            if self._peak(out[-1][1]) <= self.usable:
                break
        same_gpus = [(n, lay_) for n, lay_ in out if "GPUs" not in n and "micro-batches" not in n]
        if len(same_gpus) > 1:
            both = replace(lay, stage_checkpointing=(True,) * len(lay.stage_checkpointing),
                           chunked_loss=lay.chunked_loss or (lay.tp == 1 and w.shape.family == "gpt"),
                           shard_optimizer_state=lay.shard_optimizer_state or lay.dp * lay.cp > 1, microbatch_size=1,
                           num_microbatches=lay.num_microbatches * lay.microbatch_size)
            smaller = ", with micro-batches of 1" if lay.microbatch_size > 1 else ""
            out.append((f"all of the above on the same GPUs{smaller}", both))
        return [(name, self._peak(layout)) for name, layout in out]

    def _peak(self, layout: MemoryLayout) -> float:
        return max(r.total for r in replace(self.workload, layout=layout).estimate())

    def message(self) -> str:
        r = self.ranks[self.worst]
        parts = ", ".join(f"{k} {size(v)}" for k, v in r.components().items())
        where = f" (pipeline rank {self.worst}, the largest)" if len(self.ranks) > 1 else ""
        lines = [
            f"Compressed3DStrategy: this configuration {self.verdict()} in GPU memory: the estimate is"
            f" {size(self.peak)} per GPU{where}, the card has {size(self.capacity)}"
            f" ({size(self.usable)} usable after {size(RESERVE)} for the CUDA context and buffers).",
            f"  Configuration: {self.workload.describe()}.",
            f"  Estimate: {parts} ({r.in_flight} micro-batch(es) in flight).",
            "  Changes and their estimates (fits: at most the usable memory):",
        ]
        for name, peak in self.fixes():
            lines.append(f"    {'fits' if peak <= self.usable else 'over':>4}  {size(peak):>10}  {name}")
        lines.append(f"  The estimate errs both ways, so this stops only above {1 + MARGIN:.2f}x the usable memory."
                     " memory_check='warn' (or 'off') lets it start anyway; docs/context_parallel.md, 'Will it fit?'.")
        return "\n".join(lines)


def check_fit(mode: str, read: Callable[[], Workload | None], device: torch.device,
              warn: Callable[[str], None]) -> FitReport | None:
    """Estimate and act on ``mode``: raise (``"error"``, beyond the margin), warn, or nothing. None when skipped (no
    capacity to compare with, a model the memory model does not know, or ``"off"``)."""
    if mode == "off":
        return None
    capacity = device_capacity(device)
    if capacity is None:
        return None
    workload = read()
    if workload is None:
        return None
    report = FitReport(workload, workload.estimate(), capacity)
    verdict = report.verdict()
    if verdict == "does not fit" and mode == "error":
        raise DoesNotFitError(report.message())
    if verdict != "fits":
        warn(report.message())
    return report
