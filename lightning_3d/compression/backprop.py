"""CB: compressed backpropagation between pipeline stages, with LEP (lazy error propagation).

The activation gradient a stage sends back, viewed as M (tokens x hidden), travels as a rank-r PowerSGD
factorisation: one power step from the previous call's Q (warm start), P = M Q orthonormalised in fp32,
Q = Mᵀ P; P and Q are sent and the receiver rebuilds P Qᵀ. With LEP the sender keeps e = M' - P Qᵀ (fp32)
and adds it to the next gradient it compresses at that boundary, across steps too (M' = M + e).

By default (``epilogue_only=True``) only the schedule's cool-down sends are compressed (``BoundaryKey.epilogue``:
the backwards after a rank's last forward, the ones on the critical path); the others travel exact. Compressing
every send costs far more validation loss than compressing only the cool-down sends
(benchmarks/RESULTS.md#2026-11-22b-convergence).

Micro-batch shapes may change (dynamic micro-batching). The error buffer of a boundary is a grid of the
largest shape seen so far, indexed by position (sample, token, ...): a micro-batch of shape S adds and then
replaces the error in the region [0:S) of the grid; error outside that region is kept for a later, larger
micro-batch. With equal shapes this is exactly Optimus-CC's LEP; nothing is ever dropped.

With tensor parallelism and no sequence parallelism every tensor rank holds the same gradient; each one
compresses only its 1/tp of the sequence and the receiving ranks all-gather the rebuilt pieces, so the
slow link carries no duplicates. When the sequence does not split evenly the whole tensor is sent by each.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_3d.compression.lowrank import orthonormalize
from lightning_3d.pipeline.codec import BoundaryKey
from lightning_3d.pipeline.p2p import TensorMeta
from lightning_3d.utils.comm_stats import nbytes


def compression_ratio(rows: int, cols: int, rank: int) -> float:
    return rows * cols / ((rows + cols) * rank)


class CodecObserver(Protocol):
    """Sees the tensors of a compressed send (diagnostics); asked first so unsampled sends cost nothing."""

    def wants(self, key: BoundaryKey) -> bool: ...

    def __call__(self, key: BoundaryKey, tensors: dict[str, Tensor]) -> None:
        """``tensors``: "grad" (this rank's piece, fp32), "error_in" (LEP error added, or absent),
        "rebuilt" (P·Qᵀ as the receiver rebuilds it) and "error_out" (the error kept for the next send)."""


@dataclass
class CompressedBackpropConfig:
    rank: int = 16
    epilogue_only: bool = True  # as CompressionConfig.cb_epilogue_only: only the schedule's cool-down sends
    min_compression_ratio: float = 2.0
    lazy_error_propagation: bool = False  # as CompressionConfig.cb_lazy_error_propagation
    seed: int = 0


class CompressedBackprop:
    """A ``GradientCodec`` for ``PipelineRuntime``: both ends call it with the same key and shape."""

    def __init__(
        self,
        config: CompressedBackpropConfig,
        tp_group: dist.ProcessGroup | None = None,
        split_over_tp: bool = False,
    ) -> None:
        self.config = config
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if split_over_tp and tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if self.tp_size > 1 else 0
        self.q_memory: dict[tuple[int, int], Tensor] = {}  # (sender stage, boundary tensor) -> Q (hidden x rank), fp32
        self.errors: dict[tuple[int, int], Tensor] = {}  # (sender stage, boundary tensor) -> LEP error grid, fp32
        self.compressed_sends: dict[int, int] = {}  # sender stage -> number of compressed sends
        self.observer: CodecObserver | None = None

    # ----- decisions both ends make alike ----------------------------------------------------------------
    def piece_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The part of the gradient this rank sends: its 1/tp of the sequence (dim 1) when that splits."""
        if self.tp_size > 1 and len(shape) >= 3 and shape[1] % self.tp_size == 0:
            return (shape[0], shape[1] // self.tp_size, *shape[2:])
        return shape

    def _plan(self, meta: TensorMeta, key: BoundaryKey) -> tuple[tuple[int, ...], int] | None:
        """(piece shape, effective rank) if this gradient is compressed, else None."""
        shape, dtype = meta
        if not dtype.is_floating_point or len(shape) < 2 or (self.config.epilogue_only and not key.epilogue):
            return None
        piece = self.piece_shape(shape)
        cols = piece[-1]
        rows = max(1, nbytes(piece, 1) // cols)
        rank = min(self.config.rank, rows, cols)
        if compression_ratio(rows, cols, rank) < self.config.min_compression_ratio:
            limit = next((r for r in range(rank - 1, 0, -1)
                          if compression_ratio(rows, cols, r) >= self.config.min_compression_ratio), 0)
            if limit:  # a smaller rank would compress it: the configured one is too large for these tensors
                warnings.warn(
                    f"cb_rank={self.config.rank} is too large for activation gradients of {rows}x{cols} (tokens x"
                    f" hidden): they compress only at cb_rank <= {limit} with cb_min_compression_ratio="
                    f"{self.config.min_compression_ratio:g}, so they travel uncompressed. Lower cb_rank.",
                    stacklevel=2,
                )
            return None
        return piece, rank

    def message_metas(self, meta: TensorMeta, key: BoundaryKey) -> list[TensorMeta]:
        plan = self._plan(meta, key)
        if plan is None:
            return [meta]
        piece, rank = plan
        rows = nbytes(piece, 1) // piece[-1]
        return [((rows, rank), meta[1]), ((piece[-1], rank), meta[1])]

    # ----- sender -------------------------------------------------------------------------------------
    def encode(self, grad: Tensor, key: BoundaryKey) -> list[Tensor]:
        meta = (tuple(grad.shape), grad.dtype)
        plan = self._plan(meta, key)
        if plan is None:
            return [grad]
        piece_shape, rank = plan
        piece = grad if piece_shape == meta[0] else grad.chunk(self.tp_size, dim=1)[self.tp_rank]
        m = piece.float().reshape(-1, piece_shape[-1])
        slot = (key.stage, key.tensor)
        error = self._error_region(slot, piece_shape, m.device) if self.config.lazy_error_propagation else None
        watch = self.observer is not None and self.observer.wants(key)
        seen = {"grad": m.clone()} if watch else {}
        if error is not None:
            if watch:
                seen["error_in"] = error.reshape(m.shape).clone()
            m = m + error.reshape(m.shape)
        q = self.q_memory.get(slot)
        if q is None or q.shape != (m.shape[1], rank):
            q = self._initial_q(slot, m.shape[1], rank, m.device)
        p = orthonormalize(m @ q)
        q_new = m.t() @ p
        # A gradient holding NaN or inf still travels (the receiver's gradients turn non-finite and the strategy skips
        # the step), but leaves the warm start and the LEP error as they were: chosen on the device, no host sync.
        finite = torch.isfinite(m).all()
        self.q_memory[slot] = torch.where(finite, q_new, q)
        q = q_new
        p_sent, q_sent = p.to(grad.dtype), q.to(grad.dtype)
        if error is not None or watch:
            rebuilt = p_sent.float() @ q_sent.float().t()
        if error is not None:  # what the receiver cannot rebuild, from the factors exactly as sent
            error.copy_(torch.where(finite, (m - rebuilt).reshape(error.shape), error))
        if watch:
            seen["rebuilt"] = rebuilt
            if error is not None:
                seen["error_out"] = error.reshape(m.shape).clone()
            self.observer(key, seen)
        self.compressed_sends[key.stage] = self.compressed_sends.get(key.stage, 0) + 1
        return [p_sent.contiguous(), q_sent.contiguous()]

    def _initial_q(self, slot: tuple[int, int], cols: int, rank: int, device: torch.device) -> Tensor:
        generator = torch.Generator(device="cpu").manual_seed(self.config.seed * 1_000_003 + slot[0] * 101 + slot[1])
        return orthonormalize(torch.randn(cols, rank, generator=generator)).to(device)

    def _error_region(self, slot: tuple[int, int], shape: tuple[int, ...], device: torch.device) -> Tensor:
        """A view of the LEP grid covering ``shape``, growing the grid (zero-filled) when needed."""
        grid = self.errors.get(slot)
        if grid is None or grid.dim() != len(shape) or any(s > g for s, g in zip(shape, grid.shape)):
            same_rank = grid is not None and grid.dim() == len(shape)
            bigger = tuple(max(a, b) for a, b in zip(shape, grid.shape)) if same_rank else shape
            new = torch.zeros(bigger, dtype=torch.float32, device=device)
            if same_rank:
                new[tuple(slice(0, d) for d in grid.shape)] = grid
            self.errors[slot] = grid = new
        return grid[tuple(slice(0, d) for d in shape)]

    # ----- receiver -----------------------------------------------------------------------------------
    def decode(self, parts: list[Tensor], meta: TensorMeta, key: BoundaryKey) -> Tensor:
        plan = self._plan(meta, key)
        if plan is None:
            return parts[0]
        piece_shape, _ = plan
        p, q = parts
        piece = (p.float() @ q.float().t()).to(meta[1]).reshape(piece_shape)
        if piece_shape == meta[0]:
            return piece
        gathered = [torch.empty_like(piece) for _ in range(self.tp_size)]
        dist.all_gather(gathered, piece.contiguous(), group=self.tp_group)
        return torch.cat(gathered, dim=1)

    # ----- state (checkpointed with the compression state) ----------------------------------------------
    def state_dict(self) -> dict:
        return {"q_memory": dict(self.q_memory), "errors": dict(self.errors), "compressed_sends": dict(self.compressed_sends)}

    def load_state_dict(self, state: dict) -> None:
        self.q_memory = dict(state["q_memory"])
        self.errors = dict(state["errors"])
        self.compressed_sends = dict(state.get("compressed_sends", {}))
