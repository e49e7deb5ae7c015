"""The validated options of ``Compressed3DStrategy`` that shape the pipeline and its steps (``PipelineOptions``).

``resolve_options`` checks them on every rank before any process group exists, fills in what is derived (the
number of micro-batches, the virtual stages of an interleaved schedule) and returns one frozen record that the
strategy and its ``PipelineEngine`` read. Sizes that need the world size are resolved later (``parallel_dims``);
compression options are ``compression/config.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_3d.context import ContextParallelConfig
from lightning_3d.distributed.wgrad_fusion import check_fusion_mode
from lightning_3d.pipeline.schedule_options import resolve_schedule_options
from lightning_3d.strategies.config import ParallelismConfig, PipelineConfig, RuntimeConfig
from lightning_3d.strategies.run_checks import check_bucket_size


@dataclass(frozen=True)
class PipelineOptions:
    """What the ``PipelineEngine`` reads: the user's ``PipelineConfig``/``RuntimeConfig`` fields it needs, with the
    derived values resolved (num_microbatches, virtual_stages). Defaults are the configs' (strategies/config.py)."""

    num_microbatches: int = 1
    schedule: str = PipelineConfig.schedule
    virtual_stages: int = 1
    sequence_parallel: bool = ParallelismConfig.sequence_parallel
    pipeline_layer_split: tuple[int, ...] | None = None
    stage_activation_checkpointing: tuple[bool, ...] | None = None
    bucket_size_mb: float = RuntimeConfig.bucket_size_mb
    gradient_accumulation_fusion: bool | Literal["auto"] = RuntimeConfig.gradient_accumulation_fusion
    on_nonfinite: Literal["skip", "raise", "ignore"] = RuntimeConfig.on_nonfinite
    max_consecutive_nonfinite: int = RuntimeConfig.max_consecutive_nonfinite
    context_parallel: ContextParallelConfig = ContextParallelConfig()
    shard_optimizer_state: bool = RuntimeConfig.shard_optimizer_state
    cuda_graphs: bool = RuntimeConfig.cuda_graphs


def default_microbatches(pipeline_parallel_size: Any) -> int:
    """1 without a pipeline, else pp: the smallest count every registered schedule accepts (1F1B needs at least pp
    micro-batches, interleaved 1F1B a multiple of pp, GPipe any)."""
    if isinstance(pipeline_parallel_size, int) and not isinstance(pipeline_parallel_size, bool) and pipeline_parallel_size > 1:
        return pipeline_parallel_size
    return 1  # with an invalid pp, its own error comes from the checks below


def options_from_configs(parallelism: ParallelismConfig, pipeline: PipelineConfig, runtime: RuntimeConfig,
                         checkpoint_io: Any = None) -> PipelineOptions:
    """The engine's record from the user's configs, with the checks that relate them (each config checked itself)."""
    return resolve_options(
        pipeline_parallel_size=parallelism.pipeline_parallel_size, tensor_parallel_size=parallelism.tensor_parallel_size,
        num_microbatches=pipeline.num_microbatches, schedule=pipeline.schedule, virtual_stages=pipeline.virtual_stages,
        sequence_parallel=parallelism.sequence_parallel, pipeline_layer_split=pipeline.layer_split,
        stage_activation_checkpointing=pipeline.stage_activation_checkpointing, bucket_size_mb=runtime.bucket_size_mb,
        gradient_accumulation_fusion=runtime.gradient_accumulation_fusion, on_nonfinite=runtime.on_nonfinite,
        max_consecutive_nonfinite=runtime.max_consecutive_nonfinite, checkpoint_io=checkpoint_io,
        context_parallel=parallelism.context_parallel, shard_optimizer_state=runtime.shard_optimizer_state,
        cuda_graphs=runtime.cuda_graphs,
    )


def resolve_options(
    *, pipeline_parallel_size: int, tensor_parallel_size: int, num_microbatches: int | None, schedule: str,
    virtual_stages: int | None, sequence_parallel: bool, pipeline_layer_split: Sequence[int] | None,
    stage_activation_checkpointing: Sequence[bool] | None, bucket_size_mb: float, gradient_accumulation_fusion: bool | str,
    on_nonfinite: str, max_consecutive_nonfinite: int, checkpoint_io: Any,
    context_parallel: ContextParallelConfig = ContextParallelConfig(), shard_optimizer_state: bool = False,
    cuda_graphs: bool = False,
) -> PipelineOptions:
    if checkpoint_io is not None:
        raise ValueError(
            f"Compressed3DStrategy does not take checkpoint_io={type(checkpoint_io).__name__}(...): its checkpoints are"
            " sharded torch.distributed.checkpoint directories that the strategy writes itself. Leave checkpoint_io"
            " unset."
        )
    if sequence_parallel and tensor_parallel_size == 1:
        raise ValueError(
            "sequence_parallel=True shards the sequence over tensor-parallel ranks, but tensor_parallel_size=1: it"
            " would do nothing. Pass tensor_parallel_size > 1, or drop sequence_parallel."
        )
    if on_nonfinite not in ("skip", "raise", "ignore"):
        raise ValueError(f"`on_nonfinite={on_nonfinite!r}` must be 'skip', 'raise' or 'ignore'.")
    check_fusion_mode(gradient_accumulation_fusion)
    check_bucket_size(bucket_size_mb)
    if isinstance(max_consecutive_nonfinite, bool) or not isinstance(max_consecutive_nonfinite, int) or max_consecutive_nonfinite < 1:
        raise ValueError(f"`max_consecutive_nonfinite={max_consecutive_nonfinite!r}` must be a positive integer.")
    if not isinstance(shard_optimizer_state, bool):
        raise TypeError(f"`shard_optimizer_state={shard_optimizer_state!r}` must be True or False.")
    if num_microbatches is None:
        num_microbatches = default_microbatches(pipeline_parallel_size)
    virtual_stages = resolve_schedule_options(schedule, pipeline_parallel_size, virtual_stages, num_microbatches)
    check_cuda_graphs(cuda_graphs, pipeline_parallel_size, tensor_parallel_size, context_parallel.size, schedule,
                      num_microbatches, gradient_accumulation_fusion)
    checkpointing = None
    if stage_activation_checkpointing is not None:
        stages = pipeline_parallel_size * virtual_stages
        checkpointing = tuple(stage_activation_checkpointing) if isinstance(stage_activation_checkpointing, Sequence) else None
        if (checkpointing is None or len(checkpointing) != stages or isinstance(stage_activation_checkpointing, str)
                or not all(isinstance(flag, bool) for flag in checkpointing)):
            raise ValueError(
                f"`stage_activation_checkpointing={_shown(stage_activation_checkpointing)!r}` must list {stages} booleans, one per"
                f" pipeline stage (pipeline_parallel_size={pipeline_parallel_size} x virtual_stages={virtual_stages}),"
                " e.g. [True] + [False] * " + str(stages - 1) + "; or leave it unset for the model's own setting."
            )
    return PipelineOptions(
        num_microbatches, schedule, virtual_stages, sequence_parallel,
        tuple(pipeline_layer_split) if pipeline_layer_split is not None else None, checkpointing, bucket_size_mb,
        gradient_accumulation_fusion, on_nonfinite, max_consecutive_nonfinite, context_parallel, shard_optimizer_state,
        cuda_graphs,
    )


def _shown(value: Any) -> Any:
    """A value as the user wrote it: the configs keep lists as tuples."""
    return list(value) if isinstance(value, tuple) else value


def check_cuda_graphs(cuda_graphs: object, pp: int, tp: int, cp: int, schedule: str, num_microbatches: int,
                      fusion: bool | str) -> None:
    """Where ``cuda_graphs=True`` can replay every training micro-batch (pipeline/graphs.py): one micro-batch in
    flight per stage, no collective inside a stage, no host code inside the backward."""
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"`cuda_graphs={cuda_graphs!r}` must be True or False.")
    if not cuda_graphs:
        return
    for name, value, why in (
        ("pipeline_parallel_size", pp, "a pipeline keeps several micro-batches in flight on its first stages, and a"
         " graph's activations live in fixed buffers that the next replay overwrites"),
        ("tensor_parallel_size", tp, "its blocks run collectives, which these graphs do not capture"),
        ("context_parallel_size", cp, "its attention runs collectives, which these graphs do not capture"),
    ):
        if value != 1:
            raise ValueError(f"cuda_graphs=True needs {name}=1, got {value}: {why}. Use {name}=1 (data parallelism"
                             " over the GPUs), or cuda_graphs=False.")
    if schedule == "gpipe" and num_microbatches > 1:
        raise ValueError(f"cuda_graphs=True with schedule='gpipe' and num_microbatches={num_microbatches}: GPipe runs"
                         " every forward before the first backward, but a graphed stage holds one micro-batch's"
                         " activations at a time. Use schedule='1f1b' (at pipeline_parallel_size=1 each forward is"
                         " followed by its backward).")
    if fusion is True:
        raise ValueError("cuda_graphs=True with gradient_accumulation_fusion=True: the fused op hands gradients over in"
                         " host code that a replayed graph does not run. Use gradient_accumulation_fusion='auto' (which"
                         " fuses nothing under cuda_graphs) or False.")
