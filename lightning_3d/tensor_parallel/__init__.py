"""Tensor parallelism on local tensors: Megatron's f/g communication operators (``mappings``) and the layers that use
them (``layers``, and the recipes' vocabulary-parallel ``head``), with DTensor parameters for checkpoints and resharding.
See docs/tensor_parallel.md."""

from lightning_3d.tensor_parallel.head import VocabParallelHead, tensor_parallel_implementation, vocab_parallel_head
from lightning_3d.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedEmbedding,
    ReplicatedLayerNorm,
    ReplicatedNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel,
    compile_on_local_tensors,
    distribute_parameters,
    fused_column_parallel,
    local_view,
    replicated,
    row_parallel,
    vocab_parallel_embedding,
)
from lightning_3d.tensor_parallel.mappings import (
    TensorParallel,
    column_parallel_linear,
    copy_to_region,
    gather_sequence,
    reduce_from_region,
    reduce_scatter_sequence,
    split_sequence,
)

__all__ = [
    "ColumnParallelLinear", "ReplicatedEmbedding", "ReplicatedLayerNorm", "ReplicatedNorm", "RowParallelLinear", "TensorParallel",
    "VocabParallelEmbedding", "column_parallel", "column_parallel_linear", "compile_on_local_tensors", "copy_to_region",
    "distribute_parameters", "fused_column_parallel",
    "gather_sequence", "local_view", "reduce_from_region", "reduce_scatter_sequence", "replicated", "row_parallel",
    "split_sequence", "vocab_parallel_embedding",
    "VocabParallelHead", "tensor_parallel_implementation", "vocab_parallel_head",
]
