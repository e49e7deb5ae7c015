"""The interface every cost model implements (profiled or analytic), shared by dynamic micro-batching and the
planner.

A model is a chain of layers of a few kinds; a pipeline stage's cost is the sum of its layers' costs. All methods
are vectorised: ``microbatch_size``, ``seq_len`` and ``target_len`` are NumPy arrays (or scalars) that broadcast
against each other, and every result has their broadcast shape. Shapes the model cannot run (out of memory when
profiled, outside the profiled grid) cost ``inf``, so a search never picks them.
"""

from __future__ import annotations

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
