"""The Optimus-CC options of Compressed3DStrategy, validated before any process group exists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Which communication is compressed, and how (``Compressed3DStrategy(compression=CompressionConfig(...))``; in
    YAML ``trainer.strategy.init_args.compression``).

    ``enabled=False`` is the one switch for exact, uncompressed 3D training (fused embedding synchronisation stays on:
    it is exact). Each technique applies only where the topology has its traffic: CB between pipeline stages
    (pp > 1), SC over data-parallel replicas (dp > 1), FE where a tied embedding is split across stages.
    """

    enabled: bool = True
    """False: no CB, no SC (exact training); FE stays (it is exact)."""
    compressed_backprop: bool | Literal["auto"] = "auto"
    """CB + LEP: compress activation gradients sent between pipeline stages (needs pipeline_parallel_size > 1).
    "auto": only where the pipeline link, measured at setup, is slower than ``cb_max_link_gbps``; True / False: always
    / never (no measurement)."""
    cb_rank: int = 16
    """Rank of CB's low-rank factors."""
    cb_epilogue_only: bool = True
    """Compress only the schedule's cool-down sends (the backwards after a rank's last forward, on the critical path):
    compressing every send costs far more validation loss than the cool-down sends alone
    (benchmarks/RESULTS.md#2026-11-22b-convergence)."""
    cb_min_compression_ratio: float = 2.0
    """A tensor is compressed only if its factors are at least this many times smaller than it."""
    cb_lazy_error_propagation: bool = False
    """LEP, Optimus-CC's error feedback for CB. Off by default: in the runs that compared it, it widened CB's
    validation-loss gap instead of closing it (benchmarks/RESULTS.md#2026-11-22f-convergence); a likely reason (not
    isolated) is that the error left by one sample's gradient is added to a different sample's."""
    sc_rank: int = 128
    """Rank of SC's PowerSGD factors (SC: data-parallel gradients of the chosen pipeline ranks, needs dp > 1)."""
    sc_warmup: int | float = 0.1
    """Optimizer steps of plain all-reduce before SC starts: an int, or a float in [0, 1) as a fraction of the run."""
    sc_min_compression_ratio: float = 2.0
    """A gradient matrix is compressed only if its factors are at least this many times smaller than it."""
    sc_matmul_precision: Literal["tf32", "fp32"] = "tf32"
    """SC's products M·Q, Mᵀ·P and P·Qᵀ on TF32 tensor cores ("tf32", CUDA) or in full IEEE fp32 ("fp32"); the
    orthonormalisation is IEEE fp32 either way. TF32 is the default because those products are most of SC's compute."""
    sc_max_link_gbps: float = 50.0
    """With the default ``compressed_stages``, SC runs only if the data-parallel all-reduce is slower than this bus
    bandwidth (GB/s), measured once at setup: on NVLink-class links SC's compute costs more than the exact all-reduce;
    on InfiniBand- or Ethernet-class links it saves more than it costs (benchmarks/RESULTS.md#2026-11-22f-defaults).
    ``float("inf")``: always."""
    compressed_stages: tuple[int, ...] | None = None
    """Pipeline ranks whose data-parallel gradients SC compresses; None: all but the last (the only one if pp = 1), as
    Optimus-CC, because the last stage's all-reduce overlaps the other stages' cool-down. On links slow enough that
    this all-reduce outlasts the cool-down (Ethernet-like, benchmarks/RESULTS.md#2026-11-22e-cc-gpt-1b), list every
    stage. Naming stages skips the link measurement."""
    fused_embedding_sync: bool = True
    """FE: tied embedding gradients in one all-reduce over {first, last stage} x replicas (needs pp > 1)."""
    seed: int = 0
    """Seed of the compressors' random initial factors (the same on every rank)."""
    cb_max_link_gbps: float = 100.0
    """With ``compressed_backprop="auto"``, CB runs only if the pipeline link (bus bandwidth of an all-reduce over a
    pipeline's ranks, GB/s, measured once at setup) is slower than this. On NVLink (hundreds of GB/s) an activation
    gradient's send is short next to a stage's backward, so compressing it saves no time and costs validation loss
    (benchmarks/RESULTS.md); on InfiniBand- or Ethernet-class links (tens of GB/s or less) the exposed cool-down sends
    are long enough for CB to pay. ``float("inf")``: compress on any link."""

    def __post_init__(self) -> None:
        if self.compressed_stages is not None and not isinstance(self.compressed_stages, tuple):
            if isinstance(self.compressed_stages, (str, bytes)) or not isinstance(self.compressed_stages, Sequence):
                raise ValueError(f"`compressed_stages={self.compressed_stages!r}` must list pipeline ranks, e.g. [0, 1].")
            object.__setattr__(self, "compressed_stages", tuple(self.compressed_stages))
        self.validate(None)

    def validate(self, pipeline_parallel_size: int | None) -> None:
        """Each field on its own (at construction), and the stages against ``pipeline_parallel_size`` when given."""
        for name in ("enabled", "cb_epilogue_only", "cb_lazy_error_propagation", "fused_embedding_sync"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}={getattr(self, name)!r}` must be True or False.")
        for name in ("cb_rank", "sc_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{name}={value!r}` must be a positive integer (the rank of the low-rank factors).")
        for name in ("cb_min_compression_ratio", "sc_min_compression_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"`{name}={getattr(self, name)!r}` must be >= 0.")
        if self.sc_matmul_precision not in ("tf32", "fp32"):
            raise ValueError(
                f"`sc_matmul_precision={self.sc_matmul_precision!r}` must be 'tf32' (tensor cores, the default) or"
                f" 'fp32' (full IEEE fp32 products)."
            )
        for name in ("sc_max_link_gbps", "cb_max_link_gbps"):
            gbps = getattr(self, name)
            if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not gbps > 0:
                raise ValueError(
                    f"`{name}={gbps!r}` must be a bandwidth in GB/s > 0 (float('inf') compresses on any link)."
                )
        if not (isinstance(self.compressed_backprop, bool) or self.compressed_backprop == "auto"):
            raise ValueError(
                f"`compressed_backprop={self.compressed_backprop!r}` must be 'auto' (compress activation gradients where"
                " the pipeline link is slower than cb_max_link_gbps, the default), True (always) or False (never)."
            )
        warmup = self.sc_warmup
        if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or warmup < 0 or (isinstance(warmup, float) and warmup >= 1):
            raise ValueError(
                f"`sc_warmup={warmup!r}` must be a number of steps (int >= 0) or a fraction of the run in [0, 1)."
            )
        if self.compressed_stages is not None:
            bad = [s for s in self.compressed_stages if isinstance(s, bool) or not isinstance(s, int)]
            if bad:
                raise ValueError(f"`compressed_stages={list(self.compressed_stages)}` has {bad}: name pipeline ranks,"
                                 " integers 0 .. pipeline_parallel_size - 1.")
            # The range needs the pipeline's size: checked by the strategy, which knows it.
            bad = [s for s in self.compressed_stages if not 0 <= s < (pipeline_parallel_size or 0)]
            if bad and pipeline_parallel_size is not None:
                raise ValueError(
                    f"`compressed_stages={list(self.compressed_stages)}` has {bad} outside [0, {pipeline_parallel_size}):"
                    f" name pipeline ranks 0 .. pipeline_parallel_size - 1."
                )

    def compresses_on_link(self, measured_gbps: float | None) -> bool:
        """Whether SC runs, given the data-parallel link's measured bus bandwidth (None: not measured)."""
        if self.compressed_stages is not None:
            return True
        return measured_gbps is not None and measured_gbps < self.sc_max_link_gbps

    def cb_on_link(self, measured_gbps: float | None) -> bool:
        """Whether CB runs (pp > 1, compression on), given the pipeline link's measured bus bandwidth (None: not
        measured; only True forces CB then)."""
        if isinstance(self.compressed_backprop, bool):
            return self.compressed_backprop
        return measured_gbps is not None and measured_gbps < self.cb_max_link_gbps

    def stages_to_compress(self, pipeline_parallel_size: int) -> set[int]:
        if self.compressed_stages is not None:
            return set(self.compressed_stages)
        # The last stage finishes its backward first and has slack for its all-reduce; with one stage there
        # is no slack anywhere, so that stage is compressed.
        return set(range(pipeline_parallel_size - 1)) if pipeline_parallel_size > 1 else {0}

    def warmup_steps(self, total_steps: int) -> int:
        return int(self.sc_warmup * total_steps) if isinstance(self.sc_warmup, float) else int(self.sc_warmup)

    def explicitly_set(self) -> set[str]:
        defaults = CompressionConfig()
        return {f.name for f in fields(self) if getattr(self, f.name) != getattr(defaults, f.name)}

    def unused_options(self, dp: int, pp: int, tied: bool) -> list[str]:
        """Options the user set that change nothing in this configuration and topology (reported once, not an error)."""
        asked = self.explicitly_set()
        cb = sorted(asked & {"compressed_backprop", "cb_rank", "cb_epilogue_only", "cb_min_compression_ratio",
                             "cb_lazy_error_propagation", "cb_max_link_gbps"})
        sc = sorted(asked & {"sc_rank", "sc_warmup", "sc_min_compression_ratio", "sc_matmul_precision", "sc_max_link_gbps",
                             "compressed_stages"})
        notes = []
        if not self.enabled:
            if cb or sc:
                notes.append(_no_effect(cb + sc, "compression=False turns compression off"))
        else:
            cb_tuning = [name for name in cb if name != "compressed_backprop"]
            if pp == 1 and cb:
                notes.append(_no_effect(cb, "compressed backpropagation needs pipeline_parallel_size > 1"))
            elif not self.compressed_backprop and cb_tuning:
                notes.append(_no_effect(cb_tuning, "compressed_backprop=False"))
            elif self.compressed_backprop is True and "cb_max_link_gbps" in asked:
                notes.append("cb_max_link_gbps has no effect: compressed_backprop=True compresses on any link")
            if dp == 1 and sc:
                notes.append(_no_effect(sc, "selective stage compression needs data_parallel_size > 1"))
            elif self.compressed_stages is not None and not self.compressed_stages and len(sc) > 1:
                notes.append(_no_effect([n for n in sc if n != 'compressed_stages'], "compressed_stages=[]"))
            elif self.compressed_stages is not None and "sc_max_link_gbps" in asked:
                notes.append("sc_max_link_gbps has no effect: compressed_stages names the stages, so no link is measured")
        if (pp == 1 or not tied) and "fused_embedding_sync" in asked:
            notes.append("fused_embedding_sync has no effect: no tied embedding is split across pipeline stages")
        return notes


def _no_effect(names: list[str], why: str) -> str:
    return f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} no effect: {why}"
