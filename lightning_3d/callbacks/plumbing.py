"""What the callbacks share: the strategy check, the one place that reaches the pipeline runtime, the fan-out of its
single observer slot, the span clock, gathering to rank 0, rank-0 logging and the output directory.

Callbacks read the strategy only through its public accessors (``pipeline_runtime``, ``communication_stats``,
``compressed_backprop``, ``selective_compression``, ...); docs/architecture.md lists them.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_3d.strategies.compressed_3d import Compressed3DStrategy


def require_compressed_3d(callback: Callback, trainer: pl.Trainer) -> Compressed3DStrategy:
    strategy = trainer.strategy
    if not isinstance(strategy, Compressed3DStrategy):
        name = type(callback).__name__
        raise TypeError(
            f"{name} reads the state of lightning_3d.Compressed3DStrategy, but this Trainer uses"
            f" {type(strategy).__name__}. Pass `strategy=Compressed3DStrategy(...)` (or strategy='compressed_3d')"
            f" to the Trainer, or remove {name} from its callbacks."
        )
    return strategy


def pipeline_runtime(strategy: Compressed3DStrategy) -> Any:
    return strategy.pipeline_runtime


class RuntimeListener:
    """One callback's share of ``RuntimeObserver``; ``span`` returns None for spans it does not time."""

    def on_step(self, phase: str, train: bool, num_microbatches: int) -> None:
        pass

    def span(self, name: str, stage: int, microbatch: int) -> contextlib.AbstractContextManager | None:
        return None

    def on_received(self, stage: int, microbatch: int, tensors: list[torch.Tensor]) -> None:
        pass


class ObserverFanout:
    """Shares ``PipelineRuntime.observer`` (one slot) between several listeners (a foreign observer included)."""

    def __init__(self, listeners: list[Any]) -> None:
        self.listeners = listeners

    def on_step(self, phase: str, train: bool, num_microbatches: int) -> None:
        for listener in self.listeners:
            listener.on_step(phase, train, num_microbatches)

    def span(self, name: str, stage: int, microbatch: int) -> contextlib.AbstractContextManager:
        active = [cm for cm in (l.span(name, stage, microbatch) for l in self.listeners) if cm is not None]
        return active[0] if len(active) == 1 else _Nested(active)

    def on_received(self, stage: int, microbatch: int, tensors: list[torch.Tensor]) -> None:
        for listener in self.listeners:
            listener.on_received(stage, microbatch, tensors)


class _Nested(contextlib.ExitStack):
    def __init__(self, managers: list[contextlib.AbstractContextManager]) -> None:
        super().__init__()
        self.managers = managers

    def __enter__(self) -> None:
        for cm in self.managers:
            self.enter_context(cm)


def attach(runtime: Any, listener: Any) -> None:
    if not isinstance(runtime.observer, ObserverFanout):
        runtime.observer = ObserverFanout([runtime.observer] if runtime.observer is not None else [])
    if listener not in runtime.observer.listeners:
        runtime.observer.listeners.append(listener)


def detach(runtime: Any, listener: Any) -> None:
    fanout = runtime.observer
    if isinstance(fanout, ObserverFanout) and listener in fanout.listeners:
        fanout.listeners.remove(listener)
        if len(fanout.listeners) <= 1 and not isinstance(next(iter(fanout.listeners), None), RuntimeListener):
            runtime.observer = fanout.listeners[0] if fanout.listeners else None  # give a foreign observer its slot back


def log_rank_zero(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    if trainer.is_global_zero and metrics:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a collective: call it on all ranks at the same point)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def output_dir(trainer: pl.Trainer, given: str | None) -> Path:
    """``given``, else the trainer's log dir, else its root dir (``trainer.log_dir`` is a collective)."""
    return Path(given or trainer.log_dir or trainer.default_root_dir)


class _Span:
    __slots__ = ("clock", "key", "start")

    def __init__(self, clock: SpanRecorder, key: tuple[str, int, int]) -> None:
        self.clock, self.key = clock, key

    def __enter__(self) -> None:
        self.start = self.clock.now()

    def __exit__(self, *exc: Any) -> None:
        self.clock.spans.append((*self.key, self.start, self.clock.now()))


class SpanRecorder(RuntimeListener):
    """Times the spans (``names``, or all) of the next training pipeline step after ``arm()``.

    GPU: CUDA events recorded on the current stream around each span, read once in ``result()`` (one host
    synchronisation); CPU: ``time.perf_counter``. Times are seconds from the step's start.
    """

    def __init__(self, device: torch.device, names: tuple[str, ...] | None = None) -> None:
        self.cuda, self.names = device.type == "cuda", names
        self.armed = self.recording = self.finished = False
        self.spans: list[tuple] = []
        self.wall_start, self.start, self.end = 0.0, None, None

    def arm(self) -> None:
        self.armed, self.finished, self.spans = True, False, []

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def on_step(self, phase: str, train: bool, num_microbatches: int) -> None:
        if not (train and self.armed):
            return
        if phase == "begin" and not self.recording:
            self.recording, self.wall_start, self.start = True, time.time(), self.now()
        elif phase == "end" and self.recording:
            self.recording, self.armed, self.finished, self.end = False, False, True, self.now()

    def span(self, name: str, stage: int, microbatch: int) -> contextlib.AbstractContextManager | None:
        if not self.recording or (self.names is not None and name not in self.names):
            return None
        return _Span(self, (name, stage, microbatch))

    def result(self) -> tuple[list[tuple[str, int, int, float, float]], float]:
        """(spans as (name, stage, micro-batch, start s, end s), step duration s); resets ``finished``."""
        self.finished = False
        if self.cuda:
            self.end.synchronize()
            since = lambda ev: self.start.elapsed_time(ev) / 1e3  # noqa: E731
        else:
            since = lambda t: t - self.start  # noqa: E731
        return [(n, s, m, since(a), since(b)) for n, s, m, a, b in self.spans], since(self.end)
