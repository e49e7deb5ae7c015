"""CompressionState: which traffic of a run is compressed, and the compression state that lives across its steps.

It owns the validated ``CompressionConfig``, the data-parallel link measurement behind SC's default (taken once at
setup, logged, recorded in checkpoints as ``checkpoint["compressed_3d"]`` and restored from them so that a resumed
run keeps the decision), the PowerSGD state of SC, the CB + LEP codec it builds for the pipeline runtime, and the
per-rank compression state written into each rank's checkpoint file. It holds no process group of its own: the
layout (``ParallelDims``, this rank's pipeline rank) and the data-parallel group are passed to the methods that
need them. FE (fused embedding sync) is a flag of the config read by the pipeline engine. See
docs/architecture.md (Compression).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_3d.compression.backprop import CompressedBackprop, CompressedBackpropConfig
from lightning_3d.compression.config import CompressionConfig
from lightning_3d.compression.link import allreduce_bus_gbps
from lightning_3d.compression.selective import DataParallelPowerSGD, compression_sizes
from lightning_3d.distributed.parallel_dims import ParallelDims
from lightning_3d.strategies.cb_link import cb_record, compresses_backprop
from lightning_3d.utils.comm_stats import CommunicationStats
from lightning_3d.utils.tensors import local


class CompressionState:
    """CB/SC/FE decisions and state of one strategy (see the module docstring).

    ``link_probe(group, device)`` measures the data-parallel link in GB/s at setup (a collective over ``group``);
    tests replace it. ``link_gbps`` is the measurement the run decides by (None where nothing was measured).
    ``pipeline_link_probe`` and ``pipeline_link_gbps`` are the same for the pipeline link, which decides CB under
    ``compressed_backprop="auto"`` (``cb_link.py``).
    """

    def __init__(
        self, config: CompressionConfig, stats: CommunicationStats, guard_nonfinite: bool,
        link_probe: Callable[[dist.ProcessGroup, torch.device], float] = allreduce_bus_gbps,
    ) -> None:
        self.config = config
        self.stats = stats
        self.guard_nonfinite = guard_nonfinite
        self.link_probe = link_probe
        self.link_gbps: float | None = None
        self.pipeline_link_probe = link_probe
        self.pipeline_link_gbps: float | None = None
        self.sc: DataParallelPowerSGD | None = None
        self._warned_unused = False

    # ----- SC's state around a step a hook may poison ---------------------------------------------------------
    # SC compresses inside the backward, before Lightning's on_before_optimizer_step hooks, so a NaN a hook writes
    # reaches the guard after SC's error feedback and warm start already took this step's (finite) gradients. Where
    # such a hook exists (``keep_sc_state``, set at setup), SC's state is copied before each step and put back when the
    # guard skips it: one copy of the error buffers per step, paid only by runs with such a hook.
    keep_sc_state = False
    _sc_saved: Any = None

    @property
    def sc_state_saved(self) -> bool:
        return self.keep_sc_state and self.sc is not None

    def watch_gradient_hooks(self, trainer: Any) -> None:
        """``keep_sc_state`` where the module or a callback overrides ``on_before_optimizer_step``."""
        import lightning.pytorch as pl

        base = pl.Callback.on_before_optimizer_step
        module = type(trainer.lightning_module).on_before_optimizer_step
        self.keep_sc_state = (module is not pl.LightningModule.on_before_optimizer_step
                              or any(type(c).on_before_optimizer_step is not base for c in trainer.callbacks))

    def save_sc_state(self) -> None:
        s = self.sc.state if self.sc_state_saved else None
        self._sc_saved = None if s is None else (
            s.iter, *({k: v.clone() for k, v in d.items()} for d in (s.error_dict, s.p_memory_dict, s.q_memory_dict)),
            s.rng.get_state(), self.sc.nonfinite_buckets)

    def restore_sc_state(self) -> None:
        saved, self._sc_saved = self._sc_saved, None
        if saved is None or self.sc is None:
            return
        s = self.sc.state
        s.iter, errors, ps, qs, rng, self.sc.nonfinite_buckets = saved
        for now, then in ((s.error_dict, errors), (s.p_memory_dict, ps), (s.q_memory_dict, qs)):
            for key in [k for k in now if k not in then]:  # buffers this step created: as if it never ran
                del now[key]
            for key, value in then.items():
                if key in now:
                    now[key].copy_(value)
                else:
                    now[key] = value
        s.rng.set_state(rng)

    def start_over(self, stats: CommunicationStats) -> None:
        """A new module: fresh counters, link measurement and notes, as on a fresh strategy."""
        self.stats = stats
        self.link_gbps = self.pipeline_link_gbps = None
        self.sc = None
        self._warned_unused = False

    # ----- what is compressed ---------------------------------------------------------------------------------
    def compresses_anywhere(self, dims: ParallelDims) -> bool:
        """Whether SC runs on some pipeline rank of this job (the same answer on every rank, once set up)."""
        cfg = self.config
        return (cfg.enabled and dims.replicas > 1 and bool(cfg.stages_to_compress(dims.pp))
                and cfg.compresses_on_link(self.link_gbps))

    def compresses_rank(self, dims: ParallelDims, pp_rank: int) -> bool:
        """Whether SC compresses the data-parallel gradients of pipeline rank ``pp_rank``."""
        return self.compresses_anywhere(dims) and pp_rank in self.config.stages_to_compress(dims.pp)

    def build_codec(self, dims: ParallelDims, tp_group: dist.ProcessGroup | None, sequence_parallel: bool
                    ) -> CompressedBackprop | None:
        """The activation-gradient codec (CB + LEP) of this rank's pipeline; None leaves the runtime's exact codec."""
        cfg = self.config
        if not compresses_backprop(self, dims):
            return None
        return CompressedBackprop(
            CompressedBackpropConfig(cfg.cb_rank, cfg.cb_epilogue_only, cfg.cb_min_compression_ratio,
                                     cfg.cb_lazy_error_propagation, cfg.seed),
            tp_group=tp_group if dims.tp > 1 else None,
            split_over_tp=dims.tp > 1 and not sequence_parallel,
        )

    def warn_unused(self, dims: ParallelDims, tied: bool) -> None:
        notes = self.config.unused_options(dims.replicas, dims.pp, tied)
        if notes and not self._warned_unused:
            rank_zero_warn("Compressed3DStrategy: " + "; ".join(notes) + ".")
        self._warned_unused = True

    # ----- the link decision ----------------------------------------------------------------------------------
    def decides_by_link(self, dims: ParallelDims) -> bool:
        cfg = self.config
        return cfg.enabled and dims.replicas > 1 and cfg.compressed_stages is None

    def measure_link(self, dims: ParallelDims, dp_group: dist.ProcessGroup, device: torch.device) -> None:
        """Time one all-reduce on every data-parallel group at once, once; the slowest decides for every rank, so all
        replicas agree. Only where the answer matters: SC's default stages with dp > 1."""
        if self.link_gbps is not None or not self.decides_by_link(dims):
            return
        measured = torch.tensor([self.link_probe(dp_group, device)], device=device)
        dist.all_reduce(measured, op=dist.ReduceOp.MIN)
        self.link_gbps = float(measured)
        self._report_link_decision(dims, "measured at setup")

    def _report_link_decision(self, dims: ParallelDims, source: str) -> None:
        # A warning, not info: the same configuration trains differently on another (or a busier) host.
        cfg = self.config
        stages = sorted(cfg.stages_to_compress(dims.pp)) if self.compresses_anywhere(dims) else []
        verdict = ("on: slower than" if stages else
                   "off: PowerSGD's compute would cost more than it saves at or above")
        rank_zero_warn(
            f"Compressed3DStrategy: the data-parallel all-reduce runs at {self.link_gbps:.1f} GB/s (bus bandwidth,"
            f" {source}); selective stage compression is {verdict} sc_max_link_gbps={cfg.sc_max_link_gbps:g}"
            f" (compressed pipeline ranks: {stages}). Checkpoints record this measurement and a resumed run keeps it."
            " Pass compressed_stages=[...] to choose the compressed stages yourself."
        )

    def record(self, dims: ParallelDims) -> dict[str, Any]:
        """What decided SC in this run, as plain Python values for the checkpoint (``checkpoint["compressed_3d"]``)."""
        return {
            "dp_link_gbps": self.link_gbps,
            "sc_max_link_gbps": float(self.config.sc_max_link_gbps),
            "sc_pipeline_ranks": sorted(self.config.stages_to_compress(dims.pp)) if self.compresses_anywhere(dims) else [],
            **cb_record(self, dims),
        }

    def restore_record(self, dims: ParallelDims, record: dict[str, Any] | None) -> bool:
        """Take the link measurement the checkpointed run decided by, not this run's own. Returns whether that
        changes whether SC runs (then SC's state is dropped and the caller rebuilds the gradient synchronizer). Where
        this run does not decide by the link (``compressed_stages`` given, dp = 1, compression off) the
        configuration decides, as it says."""
        if not record or record.get("dp_link_gbps") is None or not self.decides_by_link(dims):
            return False
        recorded = float(record["dp_link_gbps"])
        if recorded == self.link_gbps:
            return False
        before = self.compresses_anywhere(dims)
        self.link_gbps = recorded
        self._report_link_decision(dims, "recorded in the checkpoint; the resumed run keeps it")
        if self.compresses_anywhere(dims) == before:
            return False
        self.sc = None
        return True

    # ----- SC ---------------------------------------------------------------------------------------------------
    def setup_selective(
        self, dims: ParallelDims, pp_rank: int, dp_group: dist.ProcessGroup, total_steps: Callable[[], int],
        stage_params: Iterable[nn.Parameter], warn_shapes: bool,
    ) -> DataParallelPowerSGD | None:
        """Create SC's PowerSGD state where this rank compresses and none exists yet; returns the new state (for
        the gradient synchronizer) or None. ``total_steps`` is asked only then (Lightning's estimate may iterate the
        data); ``warn_shapes``: this rank says which matrices sc_rank leaves exact."""
        if not self.compresses_rank(dims, pp_rank) or self.sc is not None:
            return None
        cfg = self.config
        self.sc = DataParallelPowerSGD(
            dp_group, cfg.sc_rank, cfg.warmup_steps(int(total_steps())), cfg.sc_min_compression_ratio, cfg.seed,
            self.stats, cfg.sc_matmul_precision, guard_nonfinite=self.guard_nonfinite,
        )
        if warn_shapes:
            self._warn_uncompressible_sc_rank(pp_rank, stage_params)
        return self.sc

    def _warn_uncompressible_sc_rank(self, pp_rank: int, params: Iterable[nn.Parameter]) -> None:
        """PowerSGD sends a matrix exactly where its factors would not be sc_min_compression_ratio times smaller; a
        large sc_rank can make that every matrix, silently. Say so, with the largest rank that compresses them."""
        cfg = self.config
        shapes = {tuple(local(p).shape) for p in params if p.requires_grad and p.dim() >= 2}
        missed = {}
        for shape in shapes:
            size = torch.Size(shape)
            if compression_sizes(size, cfg.sc_rank, cfg.sc_min_compression_ratio)[0]:
                continue
            limit = next((r for r in range(cfg.sc_rank - 1, 0, -1)
                          if compression_sizes(size, r, cfg.sc_min_compression_ratio)[0]), 0)
            if limit:  # else no rank compresses it (vectors-like shapes): sent exactly by design
                missed[f"{size[0]}x{size.numel() // size[0]}"] = limit
        if missed:
            worst = ", ".join(f"{shape} (compresses at sc_rank <= {limit})" for shape, limit in sorted(missed.items()))
            warnings.warn(
                f"Compressed3DStrategy: sc_rank={cfg.sc_rank} is too large for the gradients of pipeline rank"
                f" {pp_rank}: matrices of shape {worst} travel uncompressed, because their rank-{cfg.sc_rank} factors"
                f" would not be sc_min_compression_ratio={cfg.sc_min_compression_ratio:g} times smaller. Lower sc_rank.",
                stacklevel=2,
            )

    # ----- per-rank state in checkpoints ------------------------------------------------------------------------
    def rank_states(self, codec: CompressedBackprop | None) -> dict[str, Any]:
        """This rank's stateful compression objects (``state_dict``/``load_state_dict``), by name."""
        states: dict[str, Any] = {"communication": self.stats}
        if codec is not None:
            states["compressed_backprop"] = codec
        if self.sc is not None:
            states["selective_compression"] = self.sc
        return states

    def rank_state_dict(self, codec: CompressedBackprop | None) -> dict[str, Any]:
        """The compression state of this rank (LEP errors, warm-start factors, PowerSGD memories, counters)."""
        states = self.rank_states(codec)
        if len(states) == 1:  # counters only: nothing that changes training
            return {}
        return {name: obj.state_dict() for name, obj in states.items()}

    def load_rank_state_dict(self, state: dict[str, Any], codec: CompressedBackprop | None) -> None:
        states = self.rank_states(codec)
        if "selective_compression" in state and "selective_compression" not in states:
            link = self.link_gbps
            why = (f"its data-parallel link measured {link:.1f} GB/s, at or above sc_max_link_gbps" if link is not None
                   else "compression is off or compressed_stages leaves this stage out")
            rank_zero_warn(
                "Compressed3DStrategy: the checkpoint holds selective-compression state (PowerSGD error feedback) but"
                f" this run does not compress data-parallel gradients on this rank ({why}); that state is dropped."
                " Pass compressed_stages=[...] to keep compressing."
            )
        for name, obj in states.items():
            if name in state:
                obj.load_state_dict(state[name])
