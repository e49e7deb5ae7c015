"""The compression half of Compressed3DStrategy: which traffic is compressed, the link test behind SC's default,
the codec and PowerSGD state, their checkpointed per-rank state and the byte accounting users see.

A mixin rather than a separate object because Lightning and the callbacks address these as properties of the
strategy (``trainer.strategy.communication_stats()``); it reads the layout (``dims``, ``pp_rank``, ``dp_group``)
that ``Compressed3DStrategy.setup_environment`` creates, and holds no state of its own beyond the attributes named
in ``Compressed3DStrategy.__init__``.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_3d.compression.backprop import CompressedBackprop, CompressedBackpropConfig
from lightning_3d.compression.link import allreduce_bus_gbps
from lightning_3d.compression.selective import DataParallelPowerSGD


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
        cfg = self.compression
        if self._dp_link_gbps is not None or not cfg.enabled or self.dims.dp == 1 or cfg.compressed_stages is not None:
            return
        measured = torch.tensor([allreduce_bus_gbps(self.dp_group, self.root_device)], device=self.root_device)
        dist.all_reduce(measured, op=dist.ReduceOp.MIN)
        self._dp_link_gbps = float(measured)
        verdict = ("on: slower than" if cfg.compresses_on_link(self._dp_link_gbps) else
                   "off: PowerSGD's compute would cost more than it saves at or above")
        rank_zero_info(
            f"Compressed3DStrategy: the data-parallel all-reduce runs at {self._dp_link_gbps:.1f} GB/s (bus bandwidth);"
            f" selective stage compression is {verdict} sc_max_link_gbps={cfg.sc_max_link_gbps:g}. Pass"
            f" compressed_stages=[...] to choose the compressed stages yourself."
        )

    def _setup_selective_compression(self, trainer: pl.Trainer) -> None:
        if not self._compresses_dp() or self._sc is not None:
            return
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self._sc = DataParallelPowerSGD(
            self.dp_group, self.compression.sc_rank, self.compression.warmup_steps(int(total)),
            self.compression.sc_min_compression_ratio, self.compression.seed, self.comm_stats,
            self.compression.sc_matmul_precision,
        )
        self._grad_sync.attach_compressor(self._sc)

    def _check_optimizers_for_compression(self) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        sharded = [o for o in self.optimizers if isinstance(getattr(o, "_optimizer", o), ZeroRedundancyOptimizer)]
        if sharded and self._compresses_dp():
            raise TypeError(
                "Selective stage compression averages full gradients with PowerSGD, which a sharded optimizer"
                " (ZeroRedundancyOptimizer) cannot consume. Use a regular optimizer, or pass compression=False"
                " (or compressed_stages=[] to keep compressed backpropagation only)."
            )

    def _log_communication(self) -> None:
        """Log the byte counters of the previous optimizer step (host-side numbers, no synchronisation)."""
        last = self.comm_stats.as_dict("last_step")
        before = sum(v["bytes_before"] for v in last.values())
        after = sum(v["bytes_after"] for v in last.values())
        if before:
            self.lightning_module.log_dict(
                {"comm/bytes_sent": float(after), "comm/compression_ratio": before / max(after, 1)},
                on_step=True, on_epoch=False, sync_dist=False,
            )

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
