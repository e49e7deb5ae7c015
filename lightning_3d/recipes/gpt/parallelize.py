"""Pipeline stages and the tensor-parallel plan for the GPT recipe (torchtitan's "parallelize per model").

Tensor parallelism runs Megatron-style on local tensors with explicit collectives (lightning_3d.tensor_parallel,
docs/tensor_parallel.md); the parameters stay DTensors. The DTensor-module plan (torch's ``parallelize_module``)
is kept as ``parallelize_gpt(..., implementation="dtensor")`` for the host-time comparison in
benchmarks/parallel/tp_host_time.py.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_3d.dynamic import with_microbatch_checkpointing
from lightning_3d.recipes.gpt.model import Embedding, GPTModel, LMHead, packing_inputs, run_layers
from lightning_3d.tensor_parallel import (
    TensorParallel,
    column_parallel,
    replicated,
    row_parallel,
    split_sequence,
    tensor_parallel_implementation,
    vocab_parallel_embedding,
    vocab_parallel_head,
)


class GPTStage(nn.Module):
    """One pipeline stage: a contiguous range of blocks, plus the embedding (first) or norm and head (last).

    It holds references to the pruned ``GPTModel``'s own submodules under the same attribute names, so the
    tensor-parallel plan below applies to a stage exactly as to the whole model.
    """

    def __init__(
        self, model: GPTModel, layer_ids: range, first: bool, last: bool, activation_checkpointing: bool | None = None
    ) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        # The stage layout's per-stage setting where given (the strategy's stage_activation_checkpointing), else the
        # model's own.
        self.activation_checkpointing = (
            model.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
        )
        self.packed_attention, self.dropout, self.head_dim = (model.packed_attention, model.config.dropout,
                                                               model.config.head_dim)

    def forward(self, *received: Tensor, microbatch: dict[str, Tensor]) -> Tensor:
        # A dynamic plan may switch recomputation per micro-batch (lightning_3d.dynamic.RECOMPUTE_KEY, docs/dynamic.md).
        return with_microbatch_checkpointing(self, microbatch, lambda: self._forward(received, microbatch))

    def _forward(self, received: tuple[Tensor, ...], microbatch: dict[str, Tensor]) -> Tensor:
        # None, None for plain rows; packed documents: see model.py
        positions, mask = packing_inputs(microbatch, self.packed_attention, self.dropout, self.head_dim)
        x = self.embed(microbatch["input_ids"], positions) if self.embed is not None else received[0]
        return run_layers(self, x, self.layers.values(), mask)  # type: ignore[arg-type]


class _SequenceParallelEmbedding(Embedding):
    """The embeddings (and their dropout) on the full sequence, then this rank's chunk of it."""

    tensor_parallel: TensorParallel

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        return split_sequence(super().forward(input_ids, position_ids), self.tensor_parallel.group)


def parallelize_gpt(
    module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, implementation: str | None = None
) -> None:
    """Megatron column/row sharding of attention and MLP, vocab-parallel embedding and output projection, on local
    tensors with explicit collectives; q, k and v run as one GEMM. ``implementation="dtensor"``: torch's DTensor
    modules instead (same sharding, same results; slower on the host, kept for benchmarks/parallel/tp_host_time.py); None:
    the environment variable ``L3D_TP_IMPLEMENTATION`` if set (to compare both in a GPU benchmark run), else "local".

    The output projection hands its logits on as a DTensor sharded over the vocabulary, consumed by torch's
    ``loss_parallel`` cross-entropy: no rank ever holds the full vocabulary of logits. With ``sequence_parallel`` the
    residual stream between blocks (and the pipeline boundary) is sharded over the sequence: LayerNorms run on 1/tp
    of the tokens and the all-reduces become all-gathers and reduce-scatters.
    """
    if tensor_parallel_implementation(implementation) == "dtensor":
        _parallelize_gpt_dtensor(module, tp_mesh, sequence_parallel)
        return
    tp = TensorParallel(tp_mesh, sequence_parallel)
    memo: dict[int, nn.Parameter] = {}  # keeps a tied embedding and head one parameter
    embed = getattr(module, "embed", None)
    if embed is not None:
        vocab_parallel_embedding(embed.wte, tp, memo)
        replicated(embed.wpe, tp, memo)
        if sequence_parallel:
            embed.__class__ = _SequenceParallelEmbedding
            embed.tensor_parallel = tp
    for block in module.layers.values():
        for proj in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):
            column_parallel(proj, tp, memo)
        row_parallel(block.attn.proj, tp, memo)
        row_parallel(block.mlp.proj, tp, memo)
        block.attn.tensor_parallel = tp
        replicated(block.ln1, tp, memo)
        replicated(block.ln2, tp, memo)
        # Under sequence parallelism the residual dropout sees this rank's tokens only: its own masks.
        block.drop.sharded = sequence_parallel
    head = getattr(module, "head", None)
    if head is not None:
        replicated(module.norm, tp, memo)
        vocab_parallel_head(head, tp, memo, LMHead)


def _parallelize_gpt_dtensor(module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """torch's DTensor modules (``parallelize_module``) with the sharding of :func:`parallelize_gpt`.

    The output projection keeps its logits as a DTensor sharded over the vocabulary, consumed by torch's
    ``loss_parallel`` cross-entropy: no rank ever holds the full vocabulary of logits. With
    ``sequence_parallel`` the residual stream between blocks (and the pipeline boundary) is sharded over
    the sequence: LayerNorms run on 1/tp of the tokens and the all-reduces become reduce-scatters.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {}
    embed = getattr(module, "embed", None)
    if embed is not None:
        plan["embed.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sequence_parallel:
            plan["embed"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
            )
    for name in module.layers:
        prefix = f"layers.{name}"
        plan.update({
            f"{prefix}.attn.q": ColwiseParallel(),
            f"{prefix}.attn.k": ColwiseParallel(),
            f"{prefix}.attn.v": ColwiseParallel(),
            f"{prefix}.attn.proj": RowwiseParallel(output_layouts=seq),
            f"{prefix}.mlp.fc": ColwiseParallel(),
            f"{prefix}.mlp.proj": RowwiseParallel(output_layouts=seq),
        })
        # q, k and v (and the MLP's one input) share one replicated DTensor input, so the backward sums their
        # input gradients as one partial tensor and all-reduces it once (Megatron's "f"), not once per projection.
        plan.update({
            f"{prefix}.attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            f"{prefix}.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        })
        # Under sequence parallelism the residual dropout sees this rank's tokens only: its own masks.
        module.layers[name].drop.sharded = sequence_parallel
        if sequence_parallel:
            plan.update({
                f"{prefix}.ln1": SequenceParallel(use_local_output=True),
                f"{prefix}.ln2": SequenceParallel(use_local_output=True),
            })
    head = getattr(module, "head", None)
    if head is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel(use_local_output=True)
        plan["head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    tied = embed is not None and head is not None and head.weight is embed.wte.weight
    parallelize_module(module, tp_mesh, plan)
    if head is not None and isinstance(head.padding_mask, DTensor):
        # distribute_module replicated the buffer; shard it like the logits so the mask (the head's GEMM bias) stays
        # local.
        head.padding_mask = head.padding_mask.redistribute(tp_mesh, [Shard(0)])
    if tied:
        # parallelize_module gives each module its own new DTensor parameter; tie them again.
        head.weight = embed.wte.weight
