"""All five callbacks on a compressed (2,2,1) run of 4 processes; every rank reports its side, rank 0 writes it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from lightning_3d import Compressed3DStrategy
from lightning_3d.callbacks import (
    CommunicationMonitor,
    CompressionDiagnostics,
    CompressionStateMonitor,
    PipelineTimeline,
    ThroughputMFUMonitor,
)
from tests.scenarios.common import SEQ, TestData, make_model, parse_args, trainer, write_report

STEPS = 6


class MemoryLogger(Logger):
    """Keeps what rank 0 logs."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.records.append((step, {k: float(v) for k, v in metrics.items()}))


class Bytes(Callback):
    """After each step: the monitor's numbers for it, and the strategy's "last_step" (rolled at step start)."""

    def __init__(self, monitor: CommunicationMonitor) -> None:
        self.monitor, self.monitored, self.strategy_last = monitor, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.monitored.append(self.monitor.last_step)
        self.strategy_last.append(trainer.strategy.communication_stats("last_step"))


def main() -> None:
    args = parse_args()
    out = args.report.parent
    strategy = Compressed3DStrategy(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=1,
                                    num_microbatches=4, cb_rank=4, cb_epilogue_only=False, cb_min_compression_ratio=0.0,
                                    sc_rank=4, sc_warmup=2,  # every send: the diagnostics pair consecutive micro-batches
                                    cb_lazy_error_propagation=True,
                                    # every layer (the tiny model's weights are below the "auto" threshold): the SC
                                    # buffers counted below are per gradient bucket, and fused weights have their own
                                    gradient_accumulation_fusion=True)
    state = CompressionStateMonitor(log_every_n_steps=2, reset_at_warmup_end=True)
    diagnostics = CompressionDiagnostics(every_n_steps=2)
    comm = CommunicationMonitor(log_every_n_steps=1)
    throughput = ThroughputMFUMonitor(peak_tflops=1.0, window_size=2)
    timeline = PipelineTimeline(step=3, output_dir=str(out / "timeline"))
    recorder, logger, model = Bytes(comm), MemoryLogger(), make_model()
    callbacks = [state, diagnostics, comm, throughput, timeline, recorder]
    trainer(strategy, STEPS, callbacks, logger=logger, default_root_dir=str(out), log_every_n_steps=1).fit(
        model, datamodule=TestData(16))

    codec, sc = strategy.compressed_backprop, strategy.selective_compression
    before = state.norms()
    state.reset()
    after = state.norms()
    buffers = [*codec.errors.values()] + ([*sc.state.error_dict.values()] if sc else [])
    mine = {
        "rank": dist.get_rank(), "pp": strategy.pp_rank, "dp": strategy.dp_rank,
        "monitored": recorder.monitored, "strategy_last": recorder.strategy_last,
        "total": strategy.communication_stats("total"), "wait_s": comm.last_wait_s,
        "norms_before": before, "norms_after": after, "resets": state.resets, "warmup_reset": state.warmup_reset_done,
        "buffers_zero": all(float(b.abs().max()) == 0.0 for b in buffers), "num_buffers": len(buffers),
        "memories_empty": not codec.q_memory and (sc is None or not (sc.state.p_memory_dict or sc.state.q_memory_dict)),
        "observers_detached": codec.observer is None and strategy.pipeline_runtime.observer is None
        and (sc is None or sc.observer is None),
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    write_report(args.report, {
        "ranks": ranks,
        "logged": logger.records,
        "history": diagnostics.history,
        "diagnostics_png": str(diagnostics.plot_path),
        "trace": str(timeline.trace_path),
        "timeline_png": str(timeline.plot_path),
        "throughput": throughput.last_metrics,
        "flops_per_token": model.flops_per_token(SEQ),
        "comm_metrics": comm.last_metrics,
        "state_metrics": state.last_metrics,
    })


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
