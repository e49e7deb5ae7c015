"""ThroughputMFUMonitor: tokens/s, samples/s, TFLOP/s per device and MFU of a 3D-parallel run."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_3d.strategies.compressed_3d import Compressed3DStrategy
from lightning_3d.utils.compat import logger_connector
from lightning_3d.utils.peak_flops import dense_peak_flops

# H200s take their dense peaks from the library's table (lightning_3d/utils/peak_flops.py). Lightning's table
# (``get_available_flops``), used for every other GPU, does not know the name an H200 reports ("NVIDIA H200"), and its
# "h200 sxm1" entry is the sparse figure, which would halve MFU; MFU here is against the dense peak, as in the
# benchmarks (benchmarks/CONVENTIONS.md).


def compute_dtype(precision: str) -> torch.dtype | str:
    """The dtype GEMMs run in under a Lightning precision setting ("tf32" for fp32 with TF32 matmuls allowed)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else torch.float32


def peak_tflops_of(device: torch.device, precision: str) -> float | None:
    """Dense peak TFLOP/s of ``device`` for ``precision``'s compute dtype; None off CUDA or for an unknown GPU."""
    if device.type != "cuda":
        return None  # MFU is not meaningful on CPU
    dtype = compute_dtype(precision)
    if "h200" in torch.cuda.get_device_name(device).lower():
        return dense_peak_flops("h200", dtype) / 1e12
    flops = get_available_flops(device, dtype)
    return flops / 1e12 if flops else None


def token_shapes(batch: Any) -> list[tuple[int, int]]:
    """(samples, sequence length) of each micro-batch: its ``input_ids`` or first integer tensor; [] if none."""
    microbatches = batch if isinstance(batch, list) and batch and isinstance(batch[0], Mapping) else [batch]
    shapes = []
    for mb in microbatches:
        ids = mb.get("input_ids") if isinstance(mb, Mapping) else None
        ids = ids if isinstance(ids, Tensor) else _first(mb, integer=True)
        if ids is None:
            return []
        shapes.append((ids.shape[0], ids.shape[1]) if ids.dim() >= 2 else (ids.shape[0], 1))
    return shapes


def seq2seq_shapes(batch: Any) -> list[tuple[int, int, int]]:
    """(samples, input length, target length) of each micro-batch: ``input_ids`` and ``labels``; [] if any lacks one."""
    microbatches = batch if isinstance(batch, list) and batch and isinstance(batch[0], Mapping) else [batch]
    shapes = []
    for mb in microbatches:
        ids, labels = (mb.get(k) if isinstance(mb, Mapping) else None for k in ("input_ids", "labels"))
        if not (isinstance(ids, Tensor) and isinstance(labels, Tensor) and ids.dim() == labels.dim() == 2):
            return []
        shapes.append((ids.shape[0], ids.shape[1], labels.shape[1]))
    return shapes


def _first(obj: Any, integer: bool) -> Tensor | None:
    if isinstance(obj, Tensor):
        return obj if obj.dim() > 0 and (not integer or not obj.is_floating_point()) else None
    items = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, Sequence) and not isinstance(obj, str) else ()
    return next((t for t in (_first(item, integer) for item in items) if t is not None), None)


def batch_samples(batch: Any) -> int:
    shapes = token_shapes(batch)
    if shapes:
        return sum(b for b, _ in shapes)
    first = _first(batch, integer=False)
    return int(first.shape[0]) if first is not None else 1


class ThroughputMFUMonitor(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` for 3D parallelism, with the model FLOPs the recipes report.

    Logged (rank 0, at the trainer's ``log_every_n_steps``, once ``window_size`` batches have been seen), per running
    stage (``train/…``, ``validate/…``): ``samples_per_sec``, ``tokens_per_sec`` and ``tflops_per_sec`` of the whole
    job, the same divided by the number of devices under ``device/``, and ``device/mfu`` = device TFLOP/s divided by
    ``peak_tflops``. FLOPs are model FLOPs: ``pl_module.flops_per_token(seq_len)`` × tokens for each micro-batch (a
    ``MicroBatches`` batch may mix shapes), one third of that for evaluation (forward only), recomputation not counted;
    a module without ``flops_per_token`` may provide ``flops_per_batch`` (per replica batch) instead.

    Encoder-decoder modules (``is_encoder_decoder = True``, e.g. T5) see ``input_ids`` and ``labels`` of different
    lengths: a micro-batch of b pairs counts b × (input + target length) tokens and
    ``flops_per_token(input_length, target_length)`` × those tokens FLOPs (the recipe's FLOPs per input+target token).

    Only pipeline/tensor ranks of one replica share a batch: rank 0's batch is multiplied by the data-parallel size
    (replicas are assumed to process equally many tokens, as the recipes' data modules do).

    Args:
        peak_tflops: peak TFLOP/s of one device for the compute dtype. ``None``: the GPU's dense peak for the
            precision's compute dtype (Lightning's table; H200s from ``lightning_3d.utils.peak_flops``), and no MFU
            on CPU or an unknown GPU (TFLOP/s are still logged).
        window_size: batches in the rolling average.
    """

    def __init__(self, peak_tflops: float | None = None, window_size: int = 10) -> None:
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"ThroughputMFUMonitor(peak_tflops={peak_tflops}) must be positive (TFLOP/s of one device).")
        if window_size < 2:
            raise ValueError(f"ThroughputMFUMonitor(window_size={window_size}) must be >= 2.")
        super().__init__(batch_size_fn=batch_samples, window_size=window_size)
        self.peak_tflops, self.window_size = peak_tflops, window_size
        self.last_metrics: dict[str, float] = {}
        self._dp, self._world, self._peak = 1, 1, None
        self._warned_flops = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, Compressed3DStrategy):
            self._dp = strategy.dims.dp
        else:
            rank_zero_warn(f"ThroughputMFUMonitor: the strategy is {type(strategy).__name__}, not Compressed3DStrategy;"
                           " counting every rank as a data-parallel replica.")
            self._dp = trainer.world_size
        self._world = trainer.world_size
        precision = str(getattr(strategy.precision_plugin, "precision", "32-true"))
        self._peak = self.peak_tflops if self.peak_tflops is not None else peak_tflops_of(strategy.root_device, precision)
        self.available_flops = self._peak * 1e12 if self._peak else None
        # Fed with whole-job counts (world_size=1): per-device values are derived in `metrics_from`.
        if stage == TrainerFn.FITTING and trainer.enable_validation:
            self._throughputs[RunningStage.VALIDATING] = Throughput(world_size=1, window_size=self.window_size)
        self._throughputs[trainer.state.stage] = Throughput(world_size=1, window_size=self.window_size)

    def count(self, pl_module: pl.LightningModule, batch: Any) -> tuple[int, int | None, float | None]:
        """(samples, tokens, model training FLOPs) of one replica's batch."""
        samples = batch_samples(batch)
        # Per micro-batch: (samples, tokens per sample, the arguments of flops_per_token).
        if getattr(pl_module, "is_encoder_decoder", False):  # tokens are inputs plus targets
            parts = [(b, s + t, (s, t)) for b, s, t in seq2seq_shapes(batch)]
            needed = "2-d `input_ids` and `labels` (an encoder-decoder)"
        else:
            parts = [(b, s, (s,)) for b, s in token_shapes(batch)]
            needed = "token ids"
        tokens = sum(b * n for b, n, _ in parts) if parts else None
        per_token = getattr(pl_module, "flops_per_token", None)
        if callable(per_token) and parts:
            return samples, tokens, float(sum(per_token(*args) * b * n for b, n, args in parts))
        if getattr(pl_module, "flops_per_batch", None) is not None:
            return samples, tokens, float(pl_module.flops_per_batch)
        if not self._warned_flops:
            rank_zero_warn(f"ThroughputMFUMonitor: {type(pl_module).__name__} has no `flops_per_token` (or"
                           f" `flops_per_batch`), or its batches lack {needed}; logging samples/s only.")
            self._warned_flops = True
        return samples, tokens, None

    @torch.inference_mode()
    def _update(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, iter_num: int) -> None:
        stage = trainer.state.stage
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # as ThroughputMonitor: perf_counter must see the device's work done
        elapsed = time.perf_counter() - self._t0s[stage]
        samples, tokens, flops = self.count(pl_module, batch)
        if flops is not None and stage != RunningStage.TRAINING:
            flops /= 3.0  # forward only: training counts forward + backward (2x)
        self._samples[stage] += samples * self._dp
        self._batches[stage] += 1
        if tokens is not None:
            self._lengths[stage] += tokens * self._dp
        self._throughputs[stage].update(
            time=elapsed, batches=self._batches[stage], samples=self._samples[stage],
            lengths=self._lengths[stage] if tokens is not None else None,
            flops=flops * self._dp if flops is not None else None,
        )

    def _compute(self, trainer: pl.Trainer, iter_num: int | None = None) -> None:
        # The same gate and sink as ThroughputMonitor._compute (Lightning's own logger connector).
        if not logger_connector(trainer).should_update_logs:
            return
        stage = trainer.state.stage
        self.last_metrics = self.metrics_from(self._throughputs[stage].compute(), stage.value)
        logger_connector(trainer).log_metrics(self.last_metrics, step=iter_num)

    def metrics_from(self, raw: dict[str, float], prefix: str) -> dict[str, float]:
        """Whole-job ``Throughput.compute()`` values -> job and per-device metrics (TFLOP/s, MFU)."""
        out = {f"{prefix}/time": raw["time"], f"{prefix}/samples": raw["samples"]}
        if "lengths" in raw:
            out[f"{prefix}/tokens"] = raw["lengths"]
        for name, key in (("samples_per_sec", "device/samples_per_sec"), ("tokens_per_sec", "device/items_per_sec")):
            if key in raw:
                out[f"{prefix}/{name}"] = raw[key]
                out[f"{prefix}/device/{name}"] = raw[key] / self._world
        if "device/flops_per_sec" in raw:
            tflops = raw["device/flops_per_sec"] / 1e12
            out[f"{prefix}/tflops_per_sec"] = tflops
            out[f"{prefix}/device/tflops_per_sec"] = tflops / self._world
            if self._peak:
                out[f"{prefix}/device/mfu"] = tflops / self._world / self._peak
        return out
