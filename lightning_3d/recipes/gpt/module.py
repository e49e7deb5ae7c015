"""The GPT recipe as a LightningModule implementing the ``Parallel3DModule`` protocol."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_3d.context import check_ulysses_heads
from lightning_3d.recipes.gpt.config import GPTConfig, preset
from lightning_3d.recipes.gpt.model import (
    Attention,
    GPTModel,
    check_flex_trains,
    check_packed_attention,
    check_packed_batch,
    copy_full_into,
)
from lightning_3d.recipes.gpt.parallelize import GPTStage, parallelize_gpt
from lightning_3d.recipes.kernels import linear_cross_entropy
from lightning_3d.recipes.training import (
    adamw_warmup_cosine,
    check_speed_options,
    check_token_batch,
    compile_blocks,
    count_target_tokens,
    sdpa_backends_for_run,
    summed_token_cross_entropy,
)
from lightning_3d.strategies.compressed_3d import Compressed3DStrategy
from lightning_3d.strategies.protocol import StageLayout
from lightning_3d.utils.tensors import materialize_


class GPT(pl.LightningModule):
    """GPT-2-style causal language model; any preset from tiny to 8.3B, trainable in any (dp, pp, tp) layout.

    Batches are ``{"input_ids": LongTensor[b, s], "labels": LongTensor[b, s]}`` (labels already shifted;
    ``-100`` is ignored). The model is built on the meta device and initialised deterministically by
    parameter name, so every parallel layout starts from the same weights as a single-device run.
    ``fused_head_loss``: the head and the loss computed chunk by chunk (``recipes.kernels.linear_cross_entropy``),
    never holding a micro-batch's full-vocabulary logits; tensor-parallel size 1 only. ``compile_scope="stage"``: with
    ``compile``, one graph per pipeline stage (or the whole model outside our strategy) instead of one per block;
    tensor-parallel size 1 only. ``packed_attention``: how packed rows (micro-batches with ``document_ids``) attend:
    ``"flex"`` (FlexAttention with a causal same-document block mask: skips the blocks across documents; CUDA for
    training, no attention dropout), ``"sdpa"`` (SDPA with a dense block-diagonal causal mask: every block of the
    row computed) or ``"auto"`` (flex on CUDA without dropout and with heads of at least 16, sdpa otherwise). Plain rows
    ignore it. ``sdpa_backends``: ``"auto"`` (the default: ``"no_cudnn"`` when the training data declares changing
    micro-batch shapes, else ``"torch"``, chosen once in ``configure_model``), ``"no_cudnn"`` (SDPA never picks cuDNN,
    whose per-shape plans changing shapes pay again and again) or ``"torch"`` (torch's own choice, the faster on static
    shapes); see ``recipes/attention.py``.
    """

    def __init__(
        self,
        preset_name: str = "tiny",
        vocab_size: int | None = None,
        seq_length: int | None = None,
        num_layers: int | None = None,
        hidden_size: int | None = None,
        num_heads: int | None = None,
        ffn_hidden_size: int | None = None,
        dropout: float | None = None,
        tie_embeddings: bool | None = None,
        key_bias: bool | None = None,
        fp32_residual: bool | None = None,
        sdpa_backends: str | None = None,
        activation_checkpointing: bool = False,
        compile: bool | str = False,
        fused_head_loss: bool = False,
        compile_scope: str = "block",
        packed_attention: str = "auto",
        learning_rate: float = 3e-4,
        min_learning_rate: float = 3e-5,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        optimizer_foreach: bool | None = None,
        optimizer_fused: bool | None = None,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        init_seed: int = 1234,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config: GPTConfig = preset(
            preset_name, vocab_size=vocab_size, seq_length=seq_length, num_layers=num_layers, hidden_size=hidden_size,
            num_heads=num_heads, ffn_hidden_size=ffn_hidden_size, dropout=dropout, tie_embeddings=tie_embeddings,
            key_bias=key_bias, fp32_residual=fp32_residual, sdpa_backends=sdpa_backends,
        )
        if self.config.hidden_size % self.config.num_heads != 0:
            raise ValueError(
                f"hidden_size={self.config.hidden_size} is not divisible by num_heads={self.config.num_heads}."
            )
        check_speed_options(compile, optimizer_foreach, optimizer_fused, compile_scope)
        check_packed_attention(packed_attention, self.config.dropout)
        self.model: GPTModel | None = None

    # ----- building -----------------------------------------------------------------------------------------
    def _tensor_parallel_size(self) -> int:
        dims = getattr(getattr(self._trainer, "strategy", None), "dims", None) if self._trainer else None
        return dims.tp if dims is not None else 1

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # "auto" becomes a value for the whole run here, before the model exists (recipes/attention.py); the model's
        # config holds it, the module's keeps what was asked for.
        config = replace(self.config, sdpa_backends=sdpa_backends_for_run(self._trainer, self.config.sdpa_backends))
        padded = self.config.padded_vocab_size(self._tensor_parallel_size())
        with torch.device("meta"):
            self.model = GPTModel(config, padded, self.hparams.activation_checkpointing,
                                  self.hparams.packed_attention)
        if self.hparams.fused_head_loss:
            if self._tensor_parallel_size() > 1:
                raise ValueError(f"fused_head_loss=True needs tensor_parallel_size 1 (got {self._tensor_parallel_size()}):"
                                 " with tp > 1 the vocabulary-parallel loss already splits the logits; turn it off.")
            self.model.head.fused_with_loss = True
        if self.hparams.compile_scope == "stage" and self._tensor_parallel_size() > 1:
            raise ValueError(f"compile_scope='stage' needs tensor_parallel_size 1 (got {self._tensor_parallel_size()}):"
                             " tensor-parallel stages are compiled per block (compile_scope='block').")
        if not (self._trainer and isinstance(self.trainer.strategy, Compressed3DStrategy)):
            # Other strategies (single device, DDP, benchmarks' peers) get a materialised model right away.
            device = self._trainer.strategy.root_device if self._trainer else torch.device("cpu")
            materialize_(self.model, device)
            self.init_weights()
            compile_blocks([self.model] if self.hparams.compile_scope == "stage" else self.model.layers.values(),
                           self.hparams.compile)

    def init_weights(self) -> None:
        self.model.init_weights(self.hparams.init_seed)
        head = self.model.head
        if head is not None and head.padding_mask is not None:
            mask = torch.zeros(head.out_features, device=head.weight.device)
            mask[self.config.vocab_size :] = float("-inf")
            copy_full_into(head.padding_mask, mask)

    # ----- single-device / data-parallel path ----------------------------------------------------------------
    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None) -> Tensor:
        """Logits; ``document_ids`` / ``position_ids`` describe packed rows (see ``recipes/gpt/model.py``)."""
        out, head = self.model(input_ids, position_ids, document_ids), self.model.head
        return head(out) if head is not None and head.fused_with_loss else out

    def _logits(self, batch: dict[str, Tensor]) -> Tensor:
        """What the loss takes: the logits, or the final norm's output with ``fused_head_loss``."""
        return self.model(batch["input_ids"], batch.get("position_ids"), batch.get("document_ids"))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self._logits(batch), batch) / self.pipeline_loss_terms(batch)
        self.log_pipeline_loss(loss, "train")
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self._logits(batch), batch) / self.pipeline_loss_terms(batch)
        self.log_pipeline_loss(loss, "val")
        return loss

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self._logits(batch), batch) / self.pipeline_loss_terms(batch)
        self.log_pipeline_loss(loss, "test")
        return loss

    def log_pipeline_loss(self, loss: Tensor, stage: str) -> None:
        self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=stage != "train")
        if stage != "train":
            self.log(f"{stage}_ppl", torch.exp(loss), sync_dist=True)

    # ----- Parallel3DModule protocol -------------------------------------------------------------------------
    def num_pipeline_layers(self) -> int:
        return self.config.num_layers

    def build_pipeline_stages(self, layouts: Sequence[StageLayout]) -> list[nn.Module]:
        keep = [i for layout in layouts for i in layout.layers]
        self.model.prune(keep, any(l.is_first for l in layouts), any(l.is_last for l in layouts))
        # lazy: traced at the first call, after tensor parallelism has sharded the blocks
        per_block = self.hparams.compile_scope == "block"
        compile_blocks(self.model.layers.values(), self.hparams.compile if per_block else False)
        stages = [GPTStage(self.model, l.layers, l.is_first, l.is_last, l.activation_checkpointing) for l in layouts]
        if not per_block:
            compile_blocks(stages, self.hparams.compile)  # each stage one graph
        return stages

    def parallelize_stage(self, stage: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        if sequence_parallel and self.config.seq_length % tp_mesh.size() != 0:
            raise ValueError(
                f"Sequence parallelism needs seq_length={self.config.seq_length} divisible by"
                f" tensor_parallel_size={tp_mesh.size()}."
            )
        parallelize_gpt(stage, tp_mesh, sequence_parallel)

    def enable_context_parallel(self, stage: nn.Module, group: Any, layout: str, attention: str) -> None:
        """Context parallelism (``ParallelismConfig(context_parallel_size=...)``): every block of ``stage`` attends
        over the slices of the cp ``group`` (its micro-batches carry this rank's tokens and their global
        ``position_ids``). Refuses what the ring cannot do, on every rank before any collective."""
        cp = torch.distributed.get_world_size(group)
        if self.config.dropout > 0:
            raise ValueError(
                f"dropout={self.config.dropout} with context_parallel_size={cp}: attention dropout needs one mask"
                " consistent around the ring, which context-parallel attention does not draw. Use dropout=0.0, or"
                " context_parallel_size=1."
            )
        if attention == "ulysses":
            check_ulysses_heads(self.config.num_heads // self._tensor_parallel_size(), cp)
        for sub in stage.modules():
            if isinstance(sub, Attention):
                sub.context = (group, layout, attention)

    def pipeline_loss(self, output: Tensor, microbatch: dict[str, Tensor]) -> Tensor:
        if self.hparams.fused_head_loss:  # the stage's output is the final norm's: project and score chunk by chunk
            return linear_cross_entropy(output, self.model.head.weight, microbatch["labels"], self.config.vocab_size,
                                        compiled=bool(self.hparams.compile))
        return summed_token_cross_entropy(output, microbatch["labels"], compiled=bool(self.hparams.compile))

    def pipeline_loss_terms(self, microbatch: dict[str, Tensor]) -> Tensor:
        return count_target_tokens(microbatch["labels"])

    def check_pipeline_batch(self, microbatch: dict[str, Tensor]) -> None:
        check_token_batch(microbatch, self.config.vocab_size, ["input_ids"], "input_ids", max_length=self.config.seq_length)
        check_packed_batch(microbatch, self.config.seq_length)
        ids = microbatch.get("document_ids")
        if ids is not None and torch.is_grad_enabled():
            # Here, on every rank before the step, rather than at the first forward of the stage that reads the packed
            # rows (a pipeline's other stages would be left waiting on it).
            check_flex_trains(self.hparams.packed_attention, ids.device, self.config.dropout,
                              self.config.hidden_size // self.config.num_heads)

    def padded_parameters(self) -> list[str]:
        """Parameters whose first dimension is the padded vocabulary (it changes with the tensor-parallel size)."""
        return ["model.embed.wte.weight", "model.head.weight"]

    def pipeline_tied_parameters(self) -> dict[str, str]:
        return {"model.embed.wte.weight": "model.head.weight"} if self.config.tie_embeddings else {}

    # ----- optimisation --------------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW without decay on biases, norms and position embeddings; warmup then cosine decay."""
        return adamw_warmup_cosine(self, lambda name, p: p.ndim >= 2 and "wpe" not in name)

    def flops_per_token(self, seq_length: int | None = None) -> float:
        return self.config.flops_per_token(seq_length)
