"""CommunicationMonitor: bytes on the wire per traffic kind and time spent waiting for pipeline receives, per step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_3d.callbacks.plumbing import SpanRecorder, attach, detach, log_rank_zero, pipeline_runtime, require_compressed_3d
from lightning_3d.utils.comm_stats import KINDS


class CommunicationMonitor(Callback):
    """Log, every ``log_every_n_steps`` optimizer steps, the step's communication summed over all ranks:

    - ``comm/step/{kind}/bytes_before`` and ``.../bytes_after`` for each kind of ``lightning_3d.utils.comm_stats``
      (forward_activations, backward_activation_grads, dp_gradients, embedding_sync): the payload an uncompressed
      run would send and what was sent, counted on the host from shapes (no synchronisation);
    - ``comm/step/bytes_before``, ``comm/step/bytes_after`` and ``comm/step/compression_ratio`` over all kinds;
    - ``comm/step/pipeline_wait_ms_max`` / ``_mean`` over ranks: the communication time of the step.

    "Communication time" here is the time each rank spent in the pipeline's "wait" spans, i.e. blocked on a
    point-to-point receive (activation or activation gradient) it needs next: transfer time not hidden behind
    compute plus pipeline bubbles. On GPU it is measured with CUDA events on the compute stream (read once at the
    end of a logged step), on CPU with ``time.perf_counter``. It does not cover the data-parallel all-reduces
    (they overlap the backward and are not timed), the tied-embedding all-reduce, tensor-parallel collectives inside
    layers, sends (asynchronous) or the time spent compressing.

    Bytes are taken as the difference of ``strategy.communication_stats("total")`` between the start and the end of
    each training batch (validation sends are not counted by the strategy); without gradient accumulation this is
    exactly the strategy's ``"last_step"``, which it closes at every optimizer step. ``last_step`` holds this
    rank's own numbers of the latest step. Each logged step costs one small all-gather and a host synchronisation
    (raise ``log_every_n_steps`` on large jobs); the others cost two host-side dictionary copies.
    """

    def __init__(self, log_every_n_steps: int = 1) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"CommunicationMonitor(log_every_n_steps={log_every_n_steps}) must be >= 1.")
        self.log_every_n_steps = log_every_n_steps
        self.last_step: dict[str, dict[str, int]] = {}
        self.last_wait_s: float | None = None
        self.last_metrics: dict[str, float] = {}
        self._strategy = self._runtime = None
        self._waits = None  # a timeline.SpanRecorder of the "wait" spans
        self._start: dict[str, dict[str, int]] | None = None
        self._step, self._wait = 0, 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy = require_compressed_3d(self, trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._runtime = pipeline_runtime(self._strategy)
        if self._runtime is not None:
            self._waits = SpanRecorder(self._strategy.root_device, names=("wait",))
            attach(self._runtime, self._waits)

    def _logs(self) -> bool:
        return self._step % self.log_every_n_steps == 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first batch of an optimizer step
            self._step = trainer.global_step
            self._start = self._strategy.communication_stats("total")
            self._wait = 0.0
        if self._waits is not None and self._logs():
            self._waits.arm()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._start is None:
            return
        if self._waits is not None and self._waits.finished:
            spans, _ = self._waits.result()
            self._wait += sum(end - start for *_, start, end in spans)
        if (batch_idx + 1) % trainer.accumulate_grad_batches != 0:
            return
        end = self._strategy.communication_stats("total")
        self.last_step = {kind: {k: end[kind][k] - self._start[kind][k] for k in ("bytes_before", "bytes_after")}
                          for kind in end}
        self.last_wait_s = self._wait if self._waits is not None else None
        self._start = None
        if self._logs():
            self.last_metrics = self._reduce(trainer)
            log_rank_zero(trainer, self.last_metrics, self._step)

    def _reduce(self, trainer: pl.Trainer) -> dict[str, float]:
        """Sum the bytes over ranks, max and mean the wait time (one all-gather of a small vector)."""
        kinds = [k for k in KINDS if k in self.last_step] + sorted(set(self.last_step) - set(KINDS))
        row = [float(self.last_step[k][b]) for k in kinds for b in ("bytes_before", "bytes_after")]
        row.append(self.last_wait_s or 0.0)
        mine = torch.tensor(row, dtype=torch.float64, device=self._strategy.root_device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
            table = torch.stack(rows).cpu()
        else:
            table = mine.cpu().unsqueeze(0)
        total = table.sum(0).tolist()
        metrics: dict[str, float] = {}
        for i, kind in enumerate(kinds):
            metrics[f"comm/step/{kind}/bytes_before"] = total[2 * i]
            metrics[f"comm/step/{kind}/bytes_after"] = total[2 * i + 1]
        before, after = sum(total[0 : 2 * len(kinds) : 2]), sum(total[1 : 2 * len(kinds) : 2])
        metrics.update({"comm/step/bytes_before": before, "comm/step/bytes_after": after,
                        "comm/step/compression_ratio": before / after if after else 1.0})
        if self._waits is not None:
            waits = table[:, -1] * 1e3
            metrics.update({"comm/step/pipeline_wait_ms_max": waits.max().item(),
                            "comm/step/pipeline_wait_ms_mean": waits.mean().item()})
        return metrics

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._waits is not None and self._runtime is not None:
            detach(self._runtime, self._waits)
        self._waits = None
