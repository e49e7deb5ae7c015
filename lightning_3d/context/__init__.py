"""Context parallelism: a sequence sharded over the ranks of a "cp" group, attention computed by a K/V ring.

``sharding`` says which tokens a rank holds (contiguous or load-balanced zigzag), their global positions and the way
back to the full sequence; ``ring_attention`` computes exact causal or full attention over the sharded sequence by
passing K/V around the cp ranks, ``ulysses`` by all-to-alls over heads (where the heads divide by cp).
Layer 2 (beside compression): it uses torch.distributed and ``utils.compat`` only. Design and integration with the
(dp, pp, tp) strategy: docs/context_parallel.md.
"""

from lightning_3d.context.config import ATTENTIONS, ContextParallelConfig, context_parallel_config
from lightning_3d.context.ring_attention import check_attention_shapes, check_ring_inputs, ring_attention
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
from lightning_3d.context.ulysses import check_ulysses_heads, ulysses_attention

__all__ = ["ATTENTIONS", "ContextParallelConfig", "LAYOUTS", "context_parallel_config", "causal_pairs",
           "check_attention_shapes", "check_layout", "check_ring_inputs",
           "check_ulysses_heads", "gather_sequence", "num_chunks", "position_ids", "rank_chunks", "ring_attention",
           "shard_batch", "shard_sequence", "ulysses_attention", "unshard_sequence"]
