"""A small deterministic cost model for the dynamic micro-batching tests (the partitioner is generic in its cost
model; the planner's analytic and profiled models are tested on their own).

Time of a layer: a per-call overhead plus work linear in the tokens (projections, MLP) plus quadratic in the length
(attention); backward twice the forward, plus the forward again under recomputation. Memory: a fixed number of
bytes per token per layer kept for the backward (just the input under recomputation) and twice that while it runs.
"""

from __future__ import annotations

import numpy as np

from lightning_3d.costs.model import ModelShape

TINY = ModelShape("gpt", num_layers=4, hidden_size=48, num_heads=4, ffn_hidden_size=192, vocab_size=300)
T5_TINY = ModelShape("t5", num_layers=2, num_decoder_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64,
                     vocab_size=300)


class ToyCostModel:
    source = "toy"

    def __init__(self, overhead: float = 2e-5, per_token: float = 1e-6, per_pair: float = 2e-9,
                 bytes_per_token: float = 1000.0) -> None:
        self.overhead, self.per_token, self.per_pair, self.bytes_per_token = overhead, per_token, per_pair, bytes_per_token

    def _lengths(self, kind, s, target_len):
        s = np.asarray(s, dtype=np.float64)
        if kind == "decoder_block" or (kind == "head" and target_len is not None):
            t = np.asarray(target_len, dtype=np.float64)
            return t, t * (t + s)  # self- and cross-attention pairs
        return s, s * s

    def layer_time(self, kind, microbatch_size, seq_len, *, target_len=None, recompute=False, tp=1):
        b = np.asarray(microbatch_size, dtype=np.float64)
        tokens, pairs = self._lengths(kind, seq_len, target_len)
        scale = 3.0 if kind == "head" else (0.3 if kind == "embedding" else 1.0)
        fwd = (self.overhead + scale * (self.per_token * b * tokens + self.per_pair * b * pairs)) / tp
        bwd = 2 * fwd + (fwd if recompute else 0)
        return fwd, bwd

    def layer_memory(self, kind, microbatch_size, seq_len, *, target_len=None, recompute=False, tp=1):
        b = np.asarray(microbatch_size, dtype=np.float64)
        tokens, _ = self._lengths(kind, seq_len, target_len)
        stored = b * tokens * self.bytes_per_token * (0.1 if recompute else 1.0) / tp
        return stored, 2 * b * tokens * self.bytes_per_token / tp
