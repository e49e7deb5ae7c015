"""The interface every cost model implements (profiled or analytic), shared by dynamic micro-batching and the
planner.

A model is a chain of layers of a few kinds; a pipeline stage's cost is the sum of its layers' costs. All methods
are vectorised: ``microbatch_size``, ``seq_len`` and ``target_len`` are NumPy arrays (or scalars) that broadcast
against each other, and every result has their broadcast shape. Shapes the model cannot run (out of memory when
profiled, outside the profiled grid) cost ``inf``, so a search never picks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike

# "embedding": token (and position) embedding; "block": a GPT decoder block; "encoder_block"/"decoder_block": T5's
# (the decoder block's cost depends on both lengths through cross-attention); "head": final norm, output projection
# and the loss.
LayerKind = Literal["embedding", "block", "encoder_block", "decoder_block", "head"]


@runtime_checkable
class CostModel(Protocol):
    """Per-layer time and activation memory of one micro-batch on one GPU.

    ``tp``: tensor-parallel degree (the layer's shard on one GPU, its collectives included where the model knows the
    link). ``recompute``: activation checkpointing of the layer (stored memory drops to the layer's input, the
    backward includes a second forward). ``target_len``: T5's decoder length (ignored by decoder-only kinds).
    """

    #: where the numbers come from, for logs and plan files: "analytic" or "profile:<path>#<hash>"
    source: str

    def layer_time(
        self, kind: LayerKind, microbatch_size: ArrayLike, seq_len: ArrayLike, *, target_len: ArrayLike | None = None,
        recompute: bool = False, tp: int = 1,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(forward seconds, backward seconds) of one layer of ``kind``."""
        ...

    def layer_memory(
        self, kind: LayerKind, microbatch_size: ArrayLike, seq_len: ArrayLike, *, target_len: ArrayLike | None = None,
        recompute: bool = False, tp: int = 1,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(stored bytes, peak bytes): activation memory the layer keeps from its forward until its backward, and
        the transient memory above that while it runs (the larger of its forward and backward working sets)."""
        ...


@dataclass(frozen=True)
class ModelShape:
    """What a cost model needs to know about a transformer, independent of the recipe classes (this layer cannot
    import them; ``GPT``/``T5`` modules convert their config with ``model_shape()``).

    ``family``: "gpt" (decoder-only: embedding, ``num_layers`` × "block", head) or "t5" (embedding,
    ``num_layers`` × "encoder_block", ``num_decoder_layers`` × "decoder_block", head). ``head_dim`` defaults to
    hidden_size / num_heads; ``gated_ffn``: two input projections in the feed-forward layer (T5 v1.1, SwiGLU).
    ``bytes_per_element``: of activations and weights in the compute dtype (2 for bf16, 4 for fp32).
    ``tied_embeddings``: the head's weight is the embedding's (GPT and T5 v1.0 by default): a rank holding both (one
    pipeline stage) holds it once. Not part of the shape's equality: a profile's layers are the same either way, and
    profiles written before the field have it False.
    """

    family: Literal["gpt", "t5"]
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_decoder_layers: int = 0
    head_dim: int | None = None
    gated_ffn: bool = False
    bytes_per_element: int = 2
    tied_embeddings: bool = field(default=False, compare=False)

    def layer_kinds(self) -> list[LayerKind]:
        """The model's layers in pipeline order (what ``pipeline_layer_split`` cuts, plus embedding and head)."""
        if self.family == "gpt":
            return ["embedding", *["block"] * self.num_layers, "head"]
        return ["embedding", *["encoder_block"] * self.num_layers, *["decoder_block"] * self.num_decoder_layers, "head"]


@dataclass(frozen=True)
class DeviceSpec:
    """The GPU an analytic model assumes: dense peak FLOP/s in the compute dtype, memory bandwidth (bytes/s),
    memory capacity (bytes) and the fraction of peak that large GEMMs reach (the analytic model's one calibration)."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    gemm_efficiency: float = 0.7
