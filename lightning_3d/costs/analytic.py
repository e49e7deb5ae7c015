"""The analytic cost model: layer times from FLOPs and bytes, activation memory from tensor sizes.

It stands in where no profile exists (CPU, tests, planning for a GPU one is not on) and says so
(``source == "analytic"``, one warning per process, on global rank 0). GEMMs run at ``device.peak_flops × gemm_efficiency``;
attention's quadratic term at a lower efficiency (fused attention kernels reach less of the peak than large GEMMs);
norms, activations, residual adds and the loss's softmax are memory-bound (bytes / bandwidth). Stored activations
follow Korthikanti et al. (2022) with a fused attention kernel (no s² scores kept); docs/planner.md derives them.
Tensor parallelism (Megatron) shards attention heads, the feed-forward width and the vocabulary over ``tp``; its
all-reduces (two per block forward, two backward) are added only when ``tp_link_bandwidth`` is given, so a planner
that prices communication itself does not count them twice.
"""

from __future__ import annotations

import numpy as np
from lightning_utilities.core.rank_zero import rank_zero_warn
from numpy.typing import ArrayLike

from lightning_3d.costs.model import DeviceSpec, LayerKind, ModelShape
from lightning_3d.utils.peak_flops import dense_peak_flops

_WARNED = False

#: used when no device is given: an H100 SXM (dense bf16), the most common target of these recipes
DEFAULT_DEVICE = DeviceSpec("h100", dense_peak_flops("h100"), 3.35e12, 80 * 2**30, 0.7)
ATTENTION_EFFICIENCY = 0.75  # of the GEMM efficiency: fused attention reaches less of the peak
BACKWARD_ATTENTION = 2.5  # a fused attention backward recomputes the scores: 2.5x its forward, not 2x
# Eager PyTorch launches each kernel from Python: a layer cannot run faster than its launches. Per kernel, and the
# kernels of one layer's forward and backward (norms, projections, attention, activation, residuals, autocast's
# weight casts, their gradients); the GPU time is floored by this host time (docs/planner.md).
LAUNCH_S = 10e-6
KERNELS = {"block": (40, 80), "encoder_block": (40, 80), "decoder_block": (60, 120), "embedding": (4, 6), "head": (8, 12)}


def _warn_once() -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        message = ("AnalyticCostModel: costs are estimated from FLOPs and bytes, not measured; run `lightning-3d profile`"
                   " on the target GPU for a profile (docs/planner.md).")
        # One channel (a warning, not also a log line) and rank 0 only: every rank and every data loader worker of a
        # dynamic micro-batching run builds this model, and each printed the same sentence.
        rank_zero_warn(message, stacklevel=6)  # the caller of AnalyticCostModel(...)


class AnalyticCostModel:
    """``CostModel`` from FLOPs and bytes (see the module docstring)."""

    source = "analytic"

    def __init__(self, shape: ModelShape, device: DeviceSpec | None = None, *, tp_link_bandwidth: float | None = None,
                 tp_latency: float = 10e-6, warn: bool = True) -> None:
        self.shape = shape
        self.device = device if device is not None else DEFAULT_DEVICE
        self.tp_link_bandwidth = tp_link_bandwidth
        self.tp_latency = tp_latency
        if warn:  # False where the caller accounts for the error itself (the strategy's fit check: a margin)
            _warn_once()

    # ----- the CostModel interface ------------------------------------------------------------------------
    def layer_time(self, kind: LayerKind, microbatch_size: ArrayLike, seq_len: ArrayLike, *,
                   target_len: ArrayLike | None = None, recompute: bool = False, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        gemm, attn, moved, comm_bytes, n_comm = self._work(kind, microbatch_size, seq_len, target_len, tp)
        d = self.device
        gemm_rate = d.peak_flops * d.gemm_efficiency
        fwd = gemm / gemm_rate + attn / (gemm_rate * ATTENTION_EFFICIENCY) + moved / d.memory_bandwidth
        bwd = 2 * gemm / gemm_rate + BACKWARD_ATTENTION * attn / (gemm_rate * ATTENTION_EFFICIENCY) + 2 * moved / d.memory_bandwidth
        launches = KERNELS.get(kind, (0, 0))
        fwd, bwd = np.maximum(fwd, launches[0] * LAUNCH_S), np.maximum(bwd, launches[1] * LAUNCH_S)
        if tp > 1 and self.tp_link_bandwidth:
            comm = n_comm * (2 * (tp - 1) / tp * comm_bytes / self.tp_link_bandwidth + self.tp_latency)
            fwd, bwd = fwd + comm, bwd + comm
        if recompute and kind not in ("embedding", "head"):
            bwd = bwd + fwd
        return np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)

    def layer_memory(self, kind: LayerKind, microbatch_size: ArrayLike, seq_len: ArrayLike, *,
                     target_len: ArrayLike | None = None, recompute: bool = False, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        full, layer_input, work = self._activations(kind, microbatch_size, seq_len, target_len, tp)
        if recompute and kind not in ("embedding", "head"):
            # Only the input is kept; the backward rebuilds the layer's activations on top (its peak).
            return np.asarray(layer_input, dtype=float), np.asarray(full + work, dtype=float)
        return np.asarray(full, dtype=float), np.asarray(work, dtype=float)

    # ----- the counts ---------------------------------------------------------------------------------------
    def _dims(self):
        s = self.shape
        heads_dim = s.num_heads * (s.head_dim or s.hidden_size // s.num_heads)
        ffn_in = 2 if s.gated_ffn else 1
        return s.hidden_size, heads_dim, s.ffn_hidden_size, ffn_in, s.vocab_size, s.bytes_per_element

    def _lengths(self, kind, microbatch_size, seq_len, target_len):
        b = np.asarray(microbatch_size, dtype=float)
        s = np.asarray(seq_len, dtype=float)
        t = np.asarray(target_len if target_len is not None else seq_len, dtype=float)
        return b, s, t

    def _work(self, kind, microbatch_size, seq_len, target_len, tp):
        """(GEMM FLOPs, attention FLOPs, bytes moved by memory-bound ops, bytes per tp all-reduce, all-reduces)."""
        h, ad, f, ffn_in, vocab, e = self._dims()
        b, s, t = self._lengths(kind, microbatch_size, seq_len, target_len)
        t5 = self.shape.family == "t5"
        if kind in ("block", "encoder_block"):
            n = b * s
            gemm = 2 * n * h * 4 * ad + 2 * n * h * f * (ffn_in + 1)
            causal = 0.5 if kind == "block" else 1.0
            attn = 4 * b * s * s * ad * causal
            moved = e * n * (12 * h + 2 * (ffn_in + 1) * f / tp)
            return gemm / tp, attn / tp, moved, e * n * h, 2
        if kind == "decoder_block":
            n, n_enc = b * t, b * s
            gemm = 2 * n * h * 4 * ad + 2 * n * h * 2 * ad + 2 * n_enc * h * 2 * ad + 2 * n * h * f * (ffn_in + 1)
            attn = 4 * b * t * t * ad * 0.5 + 4 * b * t * s * ad
            moved = e * n * (18 * h + 2 * (ffn_in + 1) * f / tp)
            return gemm / tp, attn / tp, moved, e * n * h, 3
        if kind == "embedding":
            n = b * (s + t) if t5 else b * s
            return 0 * n, 0 * n, e * n * h * 3, e * n * h, 1
        if kind == "head":
            n = b * t if t5 else b * s
            gemm = 2 * n * h * vocab
            moved = e * n * h * 4 + 4 * n * vocab / tp * 3  # final norm; fp32 logits through softmax/loss
            return gemm / tp, 0 * n, moved, 4 * n, 1
        raise ValueError(f"Unknown layer kind {kind!r}; choose one of embedding, block, encoder_block, decoder_block, head.")

    def _activations(self, kind, microbatch_size, seq_len, target_len, tp):
        """(bytes kept for the backward, bytes of the layer's input, transient working bytes)."""
        h, ad, f, ffn_in, vocab, e = self._dims()
        b, s, t = self._lengths(kind, microbatch_size, seq_len, target_len)
        t5 = self.shape.family == "t5"
        if kind in ("block", "encoder_block"):
            n = b * s
            # LN inputs/outputs (4h), q, k, v and attention output (4·ad), FFN hidden pre/post activation
            # ((ffn_in + 1)·f), fp32 log-sum-exp per head.
            full = e * n * (4 * h + (4 * ad + (ffn_in + 1) * f) / tp) + 4 * n * self.shape.num_heads / tp
            return full, e * n * h, e * n * 2 * (ffn_in + 1) * f / tp
        if kind == "decoder_block":
            n, n_enc = b * t, b * s
            full = (e * n * (6 * h + (6 * ad + (ffn_in + 1) * f) / tp) + e * n_enc * 2 * ad / tp
                    + 8 * n * self.shape.num_heads / tp)
            return full, e * n * h, e * n * 2 * (ffn_in + 1) * f / tp + e * n_enc * 2 * ad / tp
        if kind == "embedding":
            n = b * (s + t) if t5 else b * s
            return 0 * n, 0 * n, e * n * h
        if kind == "head":
            n = b * t if t5 else b * s
            logits = n * vocab / tp
            return e * n * h * 2 + e * logits, e * n * h, 4 * logits * 2
        raise ValueError(f"Unknown layer kind {kind!r}; choose one of embedding, block, encoder_block, decoder_block, head.")

    # ----- parameters (weights, gradients, optimizer state) --------------------------------------------------------
    def layer_parameters(self, kind: LayerKind, tp: int = 1) -> float:
        """Parameters of one layer of ``kind`` held by one tensor-parallel rank."""
        return layer_parameters(self.shape, kind, tp)


def layer_parameters(shape: ModelShape, kind: LayerKind, tp: int = 1) -> float:
    """Parameters of one layer of ``kind`` on one tensor-parallel rank (norms and biases replicated)."""
    h = shape.hidden_size
    ad = shape.num_heads * (shape.head_dim or h // shape.num_heads)
    ffn_mats = 3 if shape.gated_ffn else 2
    if kind == "block":
        return (4 * h * ad + ffn_mats * h * shape.ffn_hidden_size) / tp + 9 * h
    if kind == "encoder_block":
        return (4 * h * ad + ffn_mats * h * shape.ffn_hidden_size) / tp + 2 * h
    if kind == "decoder_block":
        return (8 * h * ad + ffn_mats * h * shape.ffn_hidden_size) / tp + 3 * h
    if kind == "embedding":
        return shape.vocab_size * h / tp
    if kind == "head":
        return shape.vocab_size * h / tp + 2 * h  # the (tied) output projection's copy on the last stage, final norm
    raise ValueError(f"Unknown layer kind {kind!r}.")


def weight_matrices(shape: ModelShape, kind: LayerKind, tp: int = 1) -> list[tuple[int, int]]:
    """The 2-D weight shapes of one layer on one tp rank (what low-rank gradient compression factorises)."""
    h = shape.hidden_size
    ad = shape.num_heads * (shape.head_dim or h // shape.num_heads)
    f = shape.ffn_hidden_size // tp
    ffn = [(h, f)] * (2 if shape.gated_ffn else 1) + [(f, h)]
    if kind in ("block", "encoder_block"):
        return [(h, 3 * ad // tp), (ad // tp, h), *ffn]
    if kind == "decoder_block":
        return [(h, 3 * ad // tp), (ad // tp, h), (h, ad // tp), (h, 2 * ad // tp), (ad // tp, h), *ffn]
    return []
