"""Context parallelism: a sequence sharded over the ranks of a "cp" group, attention computed by a K/V ring.

``sharding`` says which tokens a rank holds (contiguous or load-balanced zigzag), their global positions and the way
back to the full sequence; ``ring_attention`` computes exact causal or full attention over the sharded sequence.
Layer 2 (beside compression): it uses torch.distributed and ``utils.compat`` only. Design and integration with the
(dp, pp, tp) strategy: docs/context_parallel.md.
"""

from lightning_3d.context.ring_attention import check_ring_inputs, ring_attention
from lightning_3d.context.sharding import (
    LAYOUTS,
    causal_pairs,
    check_layout,
    gather_sequence,
    num_chunks,
    position_ids,
    rank_chunks,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)

__all__ = ["LAYOUTS", "causal_pairs", "check_layout", "check_ring_inputs", "gather_sequence", "num_chunks",
           "position_ids", "rank_chunks", "ring_attention", "shard_batch", "shard_sequence", "unshard_sequence"]
