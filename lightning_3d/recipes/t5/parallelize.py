"""Pipeline stages and the tensor-parallel plan for the T5 recipe.

Tensor parallelism runs Megatron-style on local tensors with explicit collectives (lightning_3d.tensor_parallel,
docs/tensor_parallel.md), as the GPT recipe's; the parameters stay DTensors with the placements of torch's plan. The
DTensor-module plan (torch's ``parallelize_module``) is kept as ``parallelize_t5(..., implementation="dtensor")``
for comparison (``L3D_TP_IMPLEMENTATION``, as for GPT).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module

from lightning_3d.dynamic import with_microbatch_checkpointing
from lightning_3d.recipes.gpt.model import LMHead
from lightning_3d.recipes.t5.model import RMSNorm, T5Model, rms_norm, run_stage
from lightning_3d.tensor_parallel import (
    ReplicatedNorm,
    TensorParallel,
    VocabParallelEmbedding,
    column_parallel,
    distribute_parameters,
    local_view,
    row_parallel,
    tensor_parallel_implementation,
    vocab_parallel_embedding,
    vocab_parallel_head,
)


class T5Stage(nn.Module):
    """One pipeline stage: a contiguous range of the (encoder blocks, decoder blocks) sequence.

    The first stage also holds the shared embedding and both relative-bias tables; the stage holding the last
    encoder block the encoder's final norm; the last stage the decoder's final norm and the LM head. Attribute
    names are the pruned ``T5Model``'s own, so the tensor-parallel plan and :func:`run_stage` apply to both.
    """

    def __init__(
        self, model: T5Model, layer_ids: range, first: bool, last: bool, activation_checkpointing: bool | None = None
    ) -> None:
        super().__init__()
        n_enc = model.config.num_layers
        self.config = model.config
        self.shared = model.shared if first else None
        self.encoder_relative_bias = model.encoder_relative_bias if first else None
        self.decoder_relative_bias = model.decoder_relative_bias if first else None
        self.encoder = nn.ModuleDict({str(i): model.encoder[str(i)] for i in layer_ids if i < n_enc})
        self.encoder_norm = model.encoder_norm if n_enc - 1 in layer_ids else None
        self.decoder = nn.ModuleDict({str(i - n_enc): model.decoder[str(i - n_enc)] for i in layer_ids if i >= n_enc})
        self.decoder_norm = model.decoder_norm if last else None
        self.lm_head = model.lm_head if last else None
        self.drop = model.drop
        # The stage layout's per-stage setting where given (the strategy's stage_activation_checkpointing), else the
        # model's own.
        self.activation_checkpointing = (
            model.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
        )
        self.sequence_parallel_size = 1

    def forward(self, *received: Tensor, microbatch: Mapping[str, Tensor]) -> Tensor | tuple[Tensor, ...]:
        # A dynamic plan may switch recomputation per micro-batch (lightning_3d.dynamic.RECOMPUTE_KEY, docs/dynamic.md).
        return with_microbatch_checkpointing(self, microbatch, lambda: run_stage(self, received, microbatch))


class _SharedEmbedding(VocabParallelEmbedding):
    """The shared embedding: each rank looks up the ids in its vocabulary rows (zeros elsewhere), then the sum over
    the ranks (g), or under sequence parallelism the sum scattered over the sequence in one reduce-scatter (the
    residual streams start sharded), as torch's plan's ``RowwiseParallel(output_layouts=Shard(1))``."""

    def forward(self, ids: Tensor) -> Tensor:
        weight = local_view(self.weight)
        shifted = ids - self.tensor_parallel.rank * weight.shape[0]
        outside = (shifted < 0) | (shifted >= weight.shape[0])
        out = F.embedding(torch.where(outside, 0, shifted), weight)
        return self.tensor_parallel.exit(out.masked_fill(outside.unsqueeze(-1), 0.0))


class _ReplicatedRMSNorm(ReplicatedNorm, RMSNorm):
    """T5's RMS norm with a replicated weight, on local activations (this rank's tokens under sequence parallelism)."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.local_parameter("weight"), self.eps)


def _replicated_rms_norm(norm: nn.Module, tp: TensorParallel, memo: dict[int, nn.Parameter]) -> None:
    if type(norm) is not RMSNorm:
        raise TypeError(f"{type(norm).__name__} cannot become a replicated tensor-parallel norm: only T5's RMSNorm can.")
    distribute_parameters(norm, {"weight": Replicate()}, tp, memo)
    norm.__class__ = _ReplicatedRMSNorm
    norm.tensor_parallel = tp


def _check_divisible(module: nn.Module, size: int) -> None:
    """Heads (q/k/v columns and the bias tables) and the feed-forward width must split evenly: an uneven shard would
    cut a head in two, and the bias tables' columns would no longer match the heads of the q/k/v columns."""
    config = getattr(module, "config", None)
    if config is None:
        return
    for name, value in (("num_heads", config.num_heads), ("ffn_hidden_size", config.ffn_size)):
        if value % size:
            raise ValueError(f"T5 tensor parallelism needs {name}={value} divisible by tensor_parallel_size={size}:"
                             f" choose a tensor_parallel_size that divides it.")


def parallelize_t5(module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                   implementation: str | None = None) -> None:
    """Megatron sharding of attention (by head) and feed-forward, vocab-parallel embedding and head, on local tensors
    with explicit collectives: self-attention's q, k and v run as one GEMM, cross-attention's q on the decoder stream
    and its k and v (one GEMM) on the encoder output, the gated feed-forward's two input projections as one GEMM.
    ``implementation="dtensor"``: torch's DTensor modules instead (same sharding and results; slower on the host);
    None: the environment variable ``L3D_TP_IMPLEMENTATION`` if set, else "local".

    The relative-attention-bias tables are sharded by head (column ``Shard(1)`` of buckets x heads), so each rank
    computes the bias of exactly the heads its q/k/v columns hold, with no collective; a table crosses pipeline
    boundaries as that local slice. The LM head hands its logits on as a vocabulary-sharded DTensor for
    ``loss_parallel``. With ``sequence_parallel`` the residual streams (encoder, decoder and the encoder output that
    every decoder stage reads) are sharded over the sequence between blocks and across pipeline boundaries.
    """
    implementation = tensor_parallel_implementation(implementation)
    _check_divisible(module, tp_mesh.size())
    if implementation == "dtensor":
        _parallelize_t5_dtensor(module, tp_mesh, sequence_parallel)
    else:
        _parallelize_t5_local(module, tp_mesh, sequence_parallel)
    # Residual dropout (blocks, embeddings, final norms) sees this rank's tokens only under sequence parallelism.
    for stack in ("encoder", "decoder"):
        for block in getattr(module, stack).values():
            block.drop.sharded = sequence_parallel
    if getattr(module, "drop", None) is not None:
        module.drop.sharded = sequence_parallel
    if hasattr(module, "sequence_parallel_size"):
        module.sequence_parallel_size = tp_mesh.size() if sequence_parallel else 1


def _parallelize_t5_local(module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    tp = TensorParallel(tp_mesh, sequence_parallel)
    memo: dict[int, nn.Parameter] = {}  # keeps a tied embedding and head one parameter
    shared = getattr(module, "shared", None)
    if shared is not None:
        vocab_parallel_embedding(shared, tp, memo)
        shared.__class__ = _SharedEmbedding
        for table in (module.encoder_relative_bias, module.decoder_relative_bias):
            distribute_parameters(table, {"weight": Shard(1)}, tp, memo)  # read by run_stage, never called
    for stack in ("encoder", "decoder"):
        for block in getattr(module, stack).values():
            for attn in [block.self_attn] + ([block.cross_attn] if stack == "decoder" else []):
                for proj in (attn.q, attn.k, attn.v):
                    column_parallel(proj, tp, memo)
                row_parallel(attn.o, tp, memo)
                attn.tensor_parallel = tp
            ff = block.ff
            for proj in (ff.wi_0, ff.wi_1) if ff.gated else (ff.wi,):
                column_parallel(proj, tp, memo)
            row_parallel(ff.wo, tp, memo)
            ff.tensor_parallel = tp
            for name in ("self_attn_norm", "cross_attn_norm", "ff_norm"):
                if hasattr(block, name):
                    _replicated_rms_norm(getattr(block, name), tp, memo)
    for name in ("encoder_norm", "decoder_norm"):
        if getattr(module, name, None) is not None:
            _replicated_rms_norm(getattr(module, name), tp, memo)
    head = getattr(module, "lm_head", None)
    if head is not None:
        vocab_parallel_head(head, tp, memo, LMHead)


def _parallelize_t5_dtensor(module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """torch's DTensor modules (``parallelize_module``) with the sharding of :func:`parallelize_t5`."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {}
    if getattr(module, "shared", None) is not None:
        plan["shared"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        plan["encoder_relative_bias"] = ColwiseParallel()
        plan["decoder_relative_bias"] = ColwiseParallel()
    norms = []
    for stack in ("encoder", "decoder"):
        for name in getattr(module, stack):
            prefix = f"{stack}.{name}"
            attentions = ["self_attn"] + (["cross_attn"] if stack == "decoder" else [])
            for attn in attentions:
                plan.update({f"{prefix}.{attn}.{p}": ColwiseParallel() for p in "qkv"})
                plan[f"{prefix}.{attn}.o"] = RowwiseParallel(output_layouts=seq)
                norms.append(f"{prefix}.{attn}_norm")
            # One replicated DTensor input shared by q, k and v: their input gradients are all-reduced once.
            plan[f"{prefix}.self_attn"] = PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None))
            if stack == "decoder":
                plan[f"{prefix}.cross_attn"] = PrepareModuleInput(
                    input_layouts=(seq, None, seq), desired_input_layouts=(Replicate(), None, Replicate())
                )
            ff = getattr(module, stack)[name].ff
            plan.update({f"{prefix}.ff.{p}": ColwiseParallel() for p in (("wi_0", "wi_1") if ff.gated else ("wi",))})
            plan[f"{prefix}.ff.wo"] = RowwiseParallel(output_layouts=seq)
            plan[f"{prefix}.ff"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            norms.append(f"{prefix}.ff_norm")
    norms += [n for n in ("encoder_norm", "decoder_norm") if getattr(module, n, None) is not None]
    head = getattr(module, "lm_head", None)
    if head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if sequence_parallel:
        plan.update({n: SequenceParallel(use_local_output=True) for n in norms})
    shared = getattr(module, "shared", None)
    tied = shared is not None and head is not None and head.weight is shared.weight
    parallelize_module(module, tp_mesh, plan)
    if head is not None and isinstance(head.padding_mask, DTensor):
        # distribute_module replicated the buffer; shard it like the logits so the mask (the head's GEMM bias) stays
        # local.
        head.padding_mask = head.padding_mask.redistribute(tp_mesh, [Shard(0)])
    if tied:
        head.weight = shared.weight  # parallelize_module gave each module its own DTensor parameter; tie again
