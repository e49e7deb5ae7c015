"""The compression half of Compressed3DStrategy: which traffic is compressed, the link test behind SC's default,
the codec and PowerSGD state, their checkpointed per-rank state and the byte accounting users see.

A mixin rather than a separate object because Lightning and the callbacks address these as properties of the
strategy (``trainer.strategy.communication_stats()``); it reads the layout (``dims``, ``pp_rank``, ``dp_group``)
that ``Compressed3DStrategy.setup_environment`` creates, and holds no state of its own beyond the attributes named
in ``Compressed3DStrategy.__init__``.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_3d.compression.backprop import CompressedBackprop, CompressedBackpropConfig
from lightning_3d.compression.selective import DataParallelPowerSGD, compression_sizes
from lightning_3d.strategies.grad_sync import local


class CompressionMixin:
    """CB + LEP, SC and FE set-up and state for ``Compressed3DStrategy`` (see the module docstring)."""

    def _build_codec(self) -> CompressedBackprop | None:
        """The activation-gradient codec (CB + LEP) of this rank's pipeline; None leaves the runtime's exact codec."""
        cfg, dims = self.compression, self.dims
        if not (cfg.enabled and cfg.compressed_backprop and dims.pp > 1):
            return None
        return CompressedBackprop(
            CompressedBackpropConfig(cfg.cb_rank, cfg.cb_epilogue_only, cfg.cb_min_compression_ratio,
                                     cfg.cb_lazy_error_propagation, cfg.seed),
            tp_group=self.tp_mesh.get_group() if dims.tp > 1 else None,
            split_over_tp=dims.tp > 1 and not self.sequence_parallel,
        )

    def _warn_unused(self, tied: bool) -> None:
        notes = self.compression.unused_options(self.dims.dp, self.dims.pp, tied)
        if notes and not self._warned_unused:
            rank_zero_warn("Compressed3DStrategy: " + "; ".join(notes) + ".")
        self._warned_unused = True

    @property
    def compressed_backprop(self) -> CompressedBackprop | None:
        """The activation-gradient codec (CB + LEP) of this rank, if compressed backpropagation is active."""
        codec = self._runtime.codec if self._runtime is not None else None
        return codec if isinstance(codec, CompressedBackprop) else None

    @property
    def selective_compression(self) -> DataParallelPowerSGD | None:
        """The PowerSGD state of this rank's data-parallel gradients (SC), if it compresses them."""
        return self._sc

    def communication_stats(self, which: Literal["total", "last_step"] = "total") -> dict[str, dict[str, int]]:
        """Bytes this rank put on the wire per kind, before and after compression (see ``lightning_3d.utils.comm_stats``)."""
        return self.comm_stats.as_dict(which)

    @property
    def data_parallel_link_gbps(self) -> float | None:
        """Bus bandwidth (GB/s) of the data-parallel all-reduce measured at setup, the slowest replica group's, which
        turned SC on or off by default (``sc_max_link_gbps``); None where nothing was measured (dp = 1, compression
        off, or ``compressed_stages`` given)."""
        return self._dp_link_gbps

    @property
    def compresses_data_parallel_anywhere(self) -> bool:
        """Whether SC runs on some pipeline rank of this job (the same answer on every rank, once set up)."""
        cfg = self.compression
        return (cfg.enabled and self.dims.dp > 1 and bool(cfg.stages_to_compress(self.dims.pp))
                and cfg.compresses_on_link(self._dp_link_gbps))

    def _compresses_dp(self) -> bool:
        return self.compresses_data_parallel_anywhere and self.pp_rank in self.compression.stages_to_compress(self.dims.pp)

    def _measure_data_parallel_link(self) -> None:
        """Time one all-reduce on every data-parallel group at once, once; the slowest decides for every rank, so all
        replicas agree. Only where the answer matters: SC's default stages with dp > 1."""
        if self._dp_link_gbps is not None or not self._decides_by_link():
            return
        measured = torch.tensor([self._link_probe(self.dp_group, self.root_device)], device=self.root_device)
        dist.all_reduce(measured, op=dist.ReduceOp.MIN)
        self._dp_link_gbps = float(measured)
        self._report_link_decision("measured at setup")

    def _decides_by_link(self) -> bool:
        cfg = self.compression
        return cfg.enabled and self.dims.dp > 1 and cfg.compressed_stages is None

    def _report_link_decision(self, source: str) -> None:
        # A warning, not info: the same configuration trains differently on another (or a busier) host.
        cfg = self.compression
        stages = sorted(cfg.stages_to_compress(self.dims.pp)) if self.compresses_data_parallel_anywhere else []
        verdict = ("on: slower than" if stages else
                   "off: PowerSGD's compute would cost more than it saves at or above")
        rank_zero_warn(
            f"Compressed3DStrategy: the data-parallel all-reduce runs at {self._dp_link_gbps:.1f} GB/s (bus bandwidth,"
            f" {source}); selective stage compression is {verdict} sc_max_link_gbps={cfg.sc_max_link_gbps:g}"
            f" (compressed pipeline ranks: {stages}). Checkpoints record this measurement and a resumed run keeps it."
            " Pass compressed_stages=[...] to choose the compressed stages yourself."
        )

    def compression_record(self) -> dict[str, Any]:
        """What decided SC in this run, as plain Python values for the checkpoint (``checkpoint["compressed_3d"]``)."""
        return {
            "dp_link_gbps": self._dp_link_gbps,
            "sc_max_link_gbps": float(self.compression.sc_max_link_gbps),
            "sc_pipeline_ranks": sorted(self.compression.stages_to_compress(self.dims.pp))
            if self.compresses_data_parallel_anywhere else [],
        }

    def restore_compression_record(self, record: dict[str, Any] | None) -> None:
        """Resume with the link measurement the checkpointed run decided by, not this run's own (load happens after
        setup, so the gradient synchronizer and SC built from this run's measurement are rebuilt if it differs).
        Where this run does not decide by the link (``compressed_stages`` given, dp = 1, compression off) the
        configuration decides, as it says."""
        if not record or record.get("dp_link_gbps") is None or not self._decides_by_link():
            return
        recorded = float(record["dp_link_gbps"])
        if recorded == self._dp_link_gbps:
            return
        before = self.compresses_data_parallel_anywhere
        self._dp_link_gbps = recorded
        self._report_link_decision("recorded in the checkpoint; the resumed run keeps it")
        if self.compresses_data_parallel_anywhere == before:
            return
        self._sc = None
        self._grad_sync.remove_hooks()
        self._build_grad_sync()
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_selective_compression(trainer)

    def _setup_selective_compression(self, trainer: pl.Trainer) -> None:
        if not self._compresses_dp() or self._sc is not None:
            return
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self._sc = DataParallelPowerSGD(
            self.dp_group, self.compression.sc_rank, self.compression.warmup_steps(int(total)),
            self.compression.sc_min_compression_ratio, self.compression.seed, self.comm_stats,
            self.compression.sc_matmul_precision, guard_nonfinite=self.on_nonfinite != "ignore",
        )
        self._grad_sync.attach_compressor(self._sc)
        self._warn_uncompressible_sc_rank()

    def _warn_uncompressible_sc_rank(self) -> None:
        """PowerSGD sends a matrix exactly where its factors would not be sc_min_compression_ratio times smaller; a
        large sc_rank can make that every matrix, silently. Say so, with the largest rank that compresses them."""
        cfg = self.compression
        if self.dp_rank != 0 or self.tp_rank != 0:
            return
        shapes = {tuple(local(p).shape)
                  for params in self._stage_params.values() for p in params if p.requires_grad and p.dim() >= 2}
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
                f" {self.pp_rank}: matrices of shape {worst} travel uncompressed, because their rank-{cfg.sc_rank} factors"
                f" would not be sc_min_compression_ratio={cfg.sc_min_compression_ratio:g} times smaller. Lower sc_rank.",
                stacklevel=2,
            )

    def _check_optimizers(self) -> None:
        # The strategy already averages every gradient over its replicas and steps each pipeline/tensor rank's own
        # parameters; torch.distributed.optim's wrappers shard or synchronise optimizer work over the default group,
        # which spans pipeline and tensor ranks holding different parameters.
        wrapped = [type(o).__name__ for o in (getattr(o, "_optimizer", o) for o in self.optimizers)
                   if type(o).__module__.startswith("torch.distributed.optim")]
        if wrapped:
            raise TypeError(
                f"Compressed3DStrategy does not support {', '.join(wrapped)} (torch.distributed.optim) yet: it would"
                " shard or synchronise optimizer state across ranks that hold different parameters. Use a regular"
                " torch.optim optimizer (sharded optimizer state is not supported yet)."
            )

    def _log_communication(self) -> None:
        """Log the job's byte counters of the previous optimizer step: this rank's, summed over all ranks (all-reduces
        of two numbers on the device per training batch, which every rank runs at the same point; no host
        synchronisation: the logged values stay tensors until a logger reads them)."""
        last = self.comm_stats.as_dict("last_step")
        before = sum(v["bytes_before"] for v in last.values())
        after = sum(v["bytes_after"] for v in last.values())
        if self.world_size == 1 or not dist.is_initialized():
            if before:
                self.lightning_module.log_dict(
                    {"comm/bytes_sent": float(after), "comm/compression_ratio": before / max(after, 1)},
                    on_step=True, on_epoch=False, sync_dist=False,
                )
            return
        totals = torch.tensor([before, after], dtype=torch.float64, device=self.root_device)
        # Over the strategy's own groups, which carry its timeout (a frozen peer fails the job in time): a replica's
        # pipeline and tensor ranks, then the replicas.
        for group in (self.model_parallel_group, self.dp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(totals, group=group)
        ratio = torch.where(totals[1] > 0, totals[0] / totals[1].clamp(min=1), torch.ones_like(totals[0]))
        self.lightning_module.log_dict({"comm/bytes_sent": totals[1], "comm/compression_ratio": ratio},
                                       on_step=True, on_epoch=False, sync_dist=False)

    def rank_states(self) -> dict[str, Any]:
        """This rank's stateful compression objects (``state_dict``/``load_state_dict``), by name."""
        states = {"communication": self.comm_stats}
        if self.compressed_backprop is not None:
            states["compressed_backprop"] = self.compressed_backprop
        if self._sc is not None:
            states["selective_compression"] = self._sc
        return states

    def rank_state_dict(self) -> dict[str, Any]:
        """The compression state of this rank (LEP errors, warm-start factors, PowerSGD memories, counters)."""
        states = self.rank_states()
        if len(states) == 1:  # counters only: nothing that changes training
            return {}
        return {name: obj.state_dict() for name, obj in states.items()}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        states = self.rank_states()
        if "selective_compression" in state and "selective_compression" not in states:
            link = self._dp_link_gbps
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
