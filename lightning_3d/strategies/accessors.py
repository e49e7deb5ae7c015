"""What callbacks and users read from ``Compressed3DStrategy`` (a mixin of the strategy class): the resolved options
and the public accessors. Each resolved option has one source, the user's configs (strategies/config.py) or, for
derived values, the engine's ``PipelineOptions``; the accessors read the components the strategy builds (``engine``,
``compression_state``, ``comm_stats``, ``dims``). docs/architecture.md lists them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from lightning_3d.compression.backprop import CompressedBackprop
from lightning_3d.compression.selective import DataParallelPowerSGD
from lightning_3d.pipeline.runtime import PipelineRuntime


class StrategyAccessors:
    """Read-only views for a strategy with ``options``, ``parallelism``, ``runtime``, ``engine``,
    ``compression_state``, ``comm_stats`` and ``dims``."""

    # ----- resolved options (one place each: the configs, or ``options`` for derived values) --------------------
    @property
    def num_microbatches(self) -> int:
        """Micro-batches per per-replica batch, resolved (``PipelineConfig.num_microbatches`` or its derived value)."""
        return self.options.num_microbatches

    @num_microbatches.setter
    def num_microbatches(self, value: int) -> None:
        """A new count for the next steps, e.g. an evaluation split differently: the pipeline config, the resolved
        options and the engine change together. Evaluation runs forward-only and takes any count; a training step
        checks it against the schedule when it builds its order (the runtime's error names the fix)."""
        self.pipeline = replace(self.pipeline, num_microbatches=value)  # PipelineConfig checks it is a positive int
        self.options = replace(self.options, num_microbatches=value)
        self.engine.options, self.engine.num_microbatches = self.options, value

    @property
    def schedule(self) -> str:
        return self.options.schedule

    @property
    def virtual_stages(self) -> int:
        """Stages per pipeline rank, resolved (2 for an interleaved schedule unless set)."""
        return self.options.virtual_stages

    @property
    def pipeline_layer_split(self) -> list[int] | None:
        split = self.options.pipeline_layer_split
        return list(split) if split is not None else None

    @property
    def stage_activation_checkpointing(self) -> tuple[bool, ...] | None:
        return self.options.stage_activation_checkpointing

    @property
    def sequence_parallel(self) -> bool:
        return self.parallelism.sequence_parallel

    @property
    def on_nonfinite(self) -> str:
        return self.runtime.on_nonfinite

    @property
    def memory_check(self) -> str:
        return self.runtime.memory_check

    # ----- public accessors (what callbacks read) --------------------------------------------------------------
    @property
    def pipeline_runtime(self) -> PipelineRuntime | None:
        """This rank's pipeline executor (None for plain data parallelism); callbacks attach observers to it."""
        return self.engine.runtime

    @property
    def compressed_backprop(self) -> CompressedBackprop | None:
        """The activation-gradient codec (CB + LEP) of this rank, if compressed backpropagation is active."""
        codec = self.engine.runtime.codec if self.engine.runtime is not None else None
        return codec if isinstance(codec, CompressedBackprop) else None

    @property
    def selective_compression(self) -> DataParallelPowerSGD | None:
        """The PowerSGD state of this rank's data-parallel gradients (SC), if it compresses them."""
        return self.compression_state.sc

    def communication_stats(self, which: Literal["total", "last_step"] = "total") -> dict[str, dict[str, int]]:
        """Bytes this rank put on the wire per kind, before and after compression (see ``lightning_3d.utils.comm_stats``)."""
        return self.comm_stats.as_dict(which)

    @property
    def data_parallel_link_gbps(self) -> float | None:
        """Bus bandwidth (GB/s) of the data-parallel all-reduce measured at setup, the slowest replica group's, which
        turned SC on or off by default (``sc_max_link_gbps``); None where nothing was measured (dp = 1, compression
        off, or ``compressed_stages`` given)."""
        return self.compression_state.link_gbps

    @property
    def compresses_data_parallel_anywhere(self) -> bool:
        """Whether SC runs on some pipeline rank of this job (the same answer on every rank, once set up)."""
        return self.compression_state.compresses_anywhere(self.dims)
