"""Pipeline stages and the tensor-parallel plan for the T5 recipe."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_3d.dynamic import with_microbatch_checkpointing
from lightning_3d.recipes.t5.model import T5Model, run_stage


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


def parallelize_t5(module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Megatron sharding of attention (by head) and feed-forward, vocab-parallel embedding and head.

    The relative-attention-bias tables are sharded by head (column ``Shard(1)`` of buckets x heads), so each rank
    computes the bias of exactly the heads its q/k/v columns hold; a table crosses pipeline boundaries as that
    local slice. The LM head keeps its logits a vocabulary-sharded DTensor for ``loss_parallel``. With
    ``sequence_parallel`` the residual streams (encoder, decoder and the encoder output that every decoder stage
    reads) are sharded over the sequence between blocks and across pipeline boundaries.
    """
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
    # Residual dropout (blocks, embeddings, final norms) sees this rank's tokens only under sequence parallelism.
    for stack in ("encoder", "decoder"):
        for block in getattr(module, stack).values():
            block.drop.sharded = sequence_parallel
    if getattr(module, "drop", None) is not None:
        module.drop.sharded = sequence_parallel
    shared = getattr(module, "shared", None)
    tied = shared is not None and head is not None and head.weight is shared.weight
    parallelize_module(module, tp_mesh, plan)
    if head is not None and isinstance(head.padding_mask, DTensor):
        # distribute_module replicated the buffer; shard it like the logits so the mask add stays local.
        head.padding_mask = head.padding_mask.redistribute(tp_mesh, [Shard(0)])
    if tied:
        head.weight = shared.weight  # parallelize_module gave each module its own DTensor parameter; tie again
    if hasattr(module, "sequence_parallel_size"):
        module.sequence_parallel_size = tp_mesh.size() if sequence_parallel else 1
