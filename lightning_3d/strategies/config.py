"""The strategy's options as four frozen, keyword-only records: what a user writes, in Python or YAML.

``Compressed3DStrategy(parallelism=ParallelismConfig(...), pipeline=PipelineConfig(...),
compression=CompressionConfig(...), runtime=RuntimeConfig(...))``; Lightning's CLI nests them under
``trainer.strategy.init_args`` (``compression: {cb_rank: 8}``, ``--trainer.strategy.init_args.compression.cb_rank=8``).
Every default is written here (``CompressionConfig``'s in ``compression/config.py``) and nowhere else: internal records
and helpers that need one read it from these classes. Each record checks its own fields when it is built; checks that
relate two records (a schedule's micro-batch count against the pipeline size, CUDA graphs against the layout) are the
strategy's, in ``options.resolve_options``, still before any process group exists.

The flat keywords of earlier releases (``Compressed3DStrategy(pipeline_parallel_size=2, cb_rank=8)``, and the same
keys directly under ``init_args`` in YAML) map onto fields through ``FLAT_OPTIONS``; they keep working for one release
with a ``FutureWarning`` (``group_flat_options``). docs/architecture.md, "Configuration".
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_3d.compression.config import CompressionConfig
from lightning_3d.context import context_parallel_config
from lightning_3d.distributed.grad_sync import DEFAULT_BUCKET_SIZE_MB
from lightning_3d.distributed.wgrad_fusion import check_fusion_mode
from lightning_3d.strategies.gc_control import check_gc_options
from lightning_3d.strategies.run_checks import check_bucket_size


def _positive_int(name: str, value: Any, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}={value!r}` must be a positive integer{hint}.")


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    """How the devices are shared out: the mesh ("dp", "pp", "cp", "tp"), tp innermost (docs/architecture.md)."""

    data_parallel_size: int | Literal["auto"] = "auto"
    """Replicas; "auto" takes what the other sizes leave of the world (devices x nodes)."""
    pipeline_parallel_size: int = 1
    """Pipeline ranks; the model is cut into pipeline_parallel_size x virtual_stages stages."""
    tensor_parallel_size: int = 1
    """Megatron-style sharding of every layer (DTensor) over this many ranks of one node."""
    context_parallel_size: int = 1
    """Ranks sharing every sequence, each holding a slice of it (a module with ``enable_context_parallel``, e.g. the
    GPT recipe; docs/context_parallel.md)."""
    context_parallel_layout: Literal["zigzag", "contiguous"] = "zigzag"
    """How a sequence is sliced over the context-parallel ranks ("zigzag" balances causal attention's work)."""
    context_parallel_attention: Literal["ring", "ulysses"] = "ring"
    """"ring": keys and values passed around the cp ranks; "ulysses": all-to-alls over heads (heads divisible by cp)."""
    sequence_parallel: bool = False
    """Shard the residual stream over the sequence between tensor-parallel regions (needs tensor_parallel_size > 1)."""

    def __post_init__(self) -> None:
        if self.data_parallel_size != "auto":
            _positive_int("data_parallel_size", self.data_parallel_size, " or 'auto'")
        _positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        context_parallel_config(self.context_parallel_size, self.context_parallel_layout, self.context_parallel_attention)
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"`sequence_parallel={self.sequence_parallel!r}` must be True or False.")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=True shards the sequence over tensor-parallel ranks, but tensor_parallel_size=1: it"
                " would do nothing. Pass tensor_parallel_size > 1, or drop sequence_parallel."
            )

    @property
    def context_parallel(self):
        """The context-parallel part as ``context.ContextParallelConfig`` (what the context package reads)."""
        return context_parallel_config(self.context_parallel_size, self.context_parallel_layout,
                                       self.context_parallel_attention)


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How the model is cut into stages and how each step runs them (docs/architecture.md, docs/extending.md)."""

    num_microbatches: int | None = None
    """Micro-batches each per-replica batch is split into (a ``MicroBatches`` batch overrides it for one step). None
    derives it: 1 with pipeline_parallel_size=1, else pipeline_parallel_size, the smallest count every registered
    schedule accepts (1F1B needs at least pp, interleaved 1F1B a multiple of pp). The strategy's ``num_microbatches``
    is the resolved value."""
    schedule: str = "1f1b"
    """A registered schedule name: "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_interleaved", or one added with
    ``lightning_3d.pipeline.register_schedule`` (docs/extending.md)."""
    virtual_stages: int | None = None
    """Stages per pipeline rank for interleaved schedules (at least 2 there, default 2; else 1)."""
    layer_split: tuple[int, ...] | None = None
    """Layers per stage (pipeline_parallel_size x virtual_stages entries), overriding the even split."""
    stage_activation_checkpointing: tuple[bool, ...] | None = None
    """One bool per pipeline stage, in stage order: whether that stage recomputes its blocks' activations in the
    backward instead of keeping them (handed to the model in each ``StageLayout``); None leaves the model's own
    setting."""

    def __post_init__(self) -> None:
        if self.num_microbatches is not None:
            _positive_int("num_microbatches", self.num_microbatches, " (or None to derive it)")
        if not isinstance(self.schedule, str):
            raise ValueError(f"`schedule={self.schedule!r}` must be a registered schedule name, e.g. '1f1b'.")
        if self.virtual_stages is not None:
            _positive_int("virtual_stages", self.virtual_stages)
        # Lists become tuples (the record is immutable); anything else is refused by ``options.resolve_options``,
        # which knows how many stages there are and says so.
        for name in ("layer_split", "stage_activation_checkpointing"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """How each step runs on a rank: gradient buckets and fusion, optimizer sharding, graphs, failure handling,
    process groups and the host's garbage collector (docs/speed.md)."""

    bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB
    """Size of the data-parallel all-reduce buckets of uncompressed stages (a stage under SC is synchronised as one
    bucket: its cost is per matrix shape, not per byte)."""
    gradient_accumulation_fusion: bool | Literal["auto"] = "auto"
    """Accumulate the weight gradients of ``nn.Linear`` layers inside the backward's GEMM, in fp32 buffers that double
    as the all-reduce buckets (Megatron-LM's option of the same name), for modules with the pipeline protocol, at
    tensor_parallel_size=1, for plain fp32 weights used once per forward and not tied. True: every such layer; False:
    none; "auto": those whose weight has at least ``wgrad_fusion.FUSION_MIN_ELEMENTS`` elements, below which the op's
    host time exceeds the memory traffic it saves (docs/speed.md)."""
    shard_optimizer_state: bool = False
    """ZeRO-1: each data-parallel replica keeps and updates only its 1/dp of the optimizer state (and of the fp32
    master weights under bf16-true); gradients are reduce-scattered and parameters all-gathered after the step. For
    one element-wise torch optimizer (AdamW, Adam, SGD); nothing at data_parallel_size=1. docs/sharded_optimizer.md."""
    cuda_graphs: bool = False
    """Capture each stage's training forward and backward as CUDA graphs on its first micro-batch and replay them for
    later micro-batches of the same shapes. Needs CUDA, pipeline, tensor and context parallel sizes of 1 and fixed
    micro-batch shapes (others run eagerly, with a warning). docs/speed.md, "CUDA graphs"."""
    on_nonfinite: Literal["skip", "raise", "ignore"] = "skip"
    """A step whose loss or gradients hold NaN or inf: "skip" leaves parameters, optimizer and compression state as
    they were on every rank and warns; "raise" stops with an error on every rank; "ignore" applies it (no check, no
    host synchronisation). A skipped step still counts for ``global_step`` and LR schedulers. With torch's fused
    optimizers the verdict reaches the host a step later (docs/speed.md)."""
    max_consecutive_nonfinite: int = 10
    """With "skip", one more non-finite step in a row than this raises (the run is diverging)."""
    timeout: timedelta | None = default_pg_timeout
    """Of every process group the strategy creates: a rank that stops answering fails the others after this long."""
    process_group_backend: str | None = None
    """torch.distributed backend; None: NCCL on CUDA devices, gloo on the CPU."""
    memory_check: Literal["error", "warn", "off"] = "error"
    """Before any collective of a fit, compare the layout's estimated peak memory per GPU (models the memory model
    knows: the GPT and T5 recipes) with the card: "error" stops with the estimate and the changes that would fit,
    "warn" only warns, "off" skips it. ``$LIGHTNING_3D_DEVICE_MEMORY_GIB`` replaces the card's memory.
    docs/context_parallel.md, "Will it fit?"."""
    gc_interval: int | None = 50
    """Automatic garbage collection off from setup to teardown; every rank collects before every gc_interval-th
    optimizer step, all at the same step (Megatron-LM's --manual-gc). None leaves Python's collector alone.
    docs/speed.md, "Garbage collection"."""
    gc_freeze: bool = True
    """After the first of those collections in a fit (and after each validation), move what survived to Python's
    permanent generation (``gc.freeze()``), so later collections walk only what was allocated since."""

    def __post_init__(self) -> None:
        check_bucket_size(self.bucket_size_mb)
        check_fusion_mode(self.gradient_accumulation_fusion)
        check_gc_options(self.gc_interval, self.gc_freeze)
        for name in ("shard_optimizer_state", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}={getattr(self, name)!r}` must be True or False.")
        if self.on_nonfinite not in ("skip", "raise", "ignore"):
            raise ValueError(f"`on_nonfinite={self.on_nonfinite!r}` must be 'skip', 'raise' or 'ignore'.")
        _positive_int("max_consecutive_nonfinite", self.max_consecutive_nonfinite)
        if self.timeout is not None and (not isinstance(self.timeout, timedelta) or self.timeout <= timedelta(0)):
            raise ValueError(f"`timeout={self.timeout!r}` must be a positive datetime.timedelta, e.g."
                             " timedelta(minutes=10), or None for torch's default.")
        if self.process_group_backend is not None and not isinstance(self.process_group_backend, str):
            raise ValueError(f"`process_group_backend={self.process_group_backend!r}` must be a backend name such as"
                             " 'nccl' or 'gloo', or None.")
        if self.memory_check not in ("error", "warn", "off"):
            raise ValueError(f"`memory_check={self.memory_check!r}` must be one of 'error', 'warn', 'off': 'error' stops"
                             " a configuration that cannot fit before it starts, 'warn' only warns, 'off' skips the"
                             " estimate.")


GROUPS = {"parallelism": ParallelismConfig, "pipeline": PipelineConfig, "compression": CompressionConfig,
          "runtime": RuntimeConfig}

# The flat keywords of earlier releases: name -> (group, field). Fields keep their flat names except these three.
_RENAMED = {"pipeline_layer_split": ("pipeline", "layer_split"), "compression_seed": ("compression", "seed")}
FLAT_OPTIONS: dict[str, tuple[str, str]] = {
    **{f.name: (group, f.name) for group, cls in GROUPS.items() for f in fields(cls) if f.name not in ("enabled", "seed")},
    **_RENAMED,
}
# ``compression=<bool>`` was the flat switch; it is now ``compression.enabled`` (group_flat_options handles it).


def _place(name: str, value: Any) -> tuple[str, str]:
    if name == "compression" and isinstance(value, bool):
        return "compression", "enabled"
    if name in FLAT_OPTIONS:
        return FLAT_OPTIONS[name]
    import difflib

    close = difflib.get_close_matches(name, [*FLAT_OPTIONS, *GROUPS], n=2, cutoff=0.75)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise TypeError(f"Compressed3DStrategy got an unexpected keyword argument {name!r}{hint}")


def nest_options(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{group: {field: value}}`` of flat option names (``compression=<bool>`` is ``compression.enabled``)."""
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        group, field = _place(name, value)
        grouped.setdefault(group, {})[field] = value
    return grouped


def flatten_options(init_args: Mapping[str, Any]) -> dict[str, Any]:
    """The strategy's ``init_args`` of a config, grouped or flat, as ``{flat name: value}`` (what tools that read a
    config, e.g. the planner, look values up by)."""
    back = {place: name for name, place in FLAT_OPTIONS.items()}
    back["compression", "enabled"] = "compression"
    flat: dict[str, Any] = {}
    for key, value in init_args.items():
        if key in GROUPS and isinstance(value, Mapping):
            flat.update({back.get((key, field), field): v for field, v in value.items()})
        elif not (key in GROUPS and value is None):
            flat[key] = value
    return flat


def group_flat_options(flat: Mapping[str, Any], where: str = "Compressed3DStrategy",
                       category: type[Warning] = FutureWarning) -> dict[str, dict[str, Any]]:
    """``nest_options`` of the flat keywords of earlier releases, with one warning naming each and its new place (a
    FutureWarning: Python shows it by default, where it hides a DeprecationWarning raised outside ``__main__``)."""
    grouped = nest_options(flat)
    if grouped:
        moved = [f"{name} -> {'.'.join(_place(name, value))}" for name, value in flat.items()]
        warnings.warn(
            f"{where}: flat options are deprecated and will be removed in the next release; use the grouped"
            f" configs ({', '.join(moved)}), e.g. Compressed3DStrategy(parallelism=ParallelismConfig(...)) or, in"
            " YAML, trainer.strategy.init_args.parallelism.pipeline_parallel_size.",
            category, stacklevel=3,
        )
    return grouped


def build_config(group: str, given: Any, flat: Mapping[str, Any] | None = None) -> Any:
    """The ``group`` record from what the user passed (a record, a mapping of its fields, or None for the defaults),
    with deprecated flat keywords (already grouped) applied on top."""
    cls = GROUPS[group]
    flat = dict(flat or {})
    if given is None:
        return cls(**flat)
    if isinstance(given, Mapping):
        return cls(**{**given, **flat})
    if not isinstance(given, cls):
        raise ValueError(f"`{group}={given!r}` must be a {cls.__name__} (lightning_3d.{cls.__name__}), a dict of its"
                         f" fields, or None for the defaults.")
    if not flat:
        return given
    current = {f.name: getattr(given, f.name) for f in fields(cls)}
    return cls(**{**current, **flat})
