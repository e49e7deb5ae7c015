"""The T5 recipe as a LightningModule implementing the ``Parallel3DModule`` protocol."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics.aggregation import MeanMetric

from lightning_3d.recipes.gpt.model import copy_full_into
from lightning_3d.recipes.t5.config import T5Config, preset
from lightning_3d.recipes.t5.model import T5Model, check_attention
from lightning_3d.recipes.t5.parallelize import T5Stage, parallelize_t5
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


class Perplexity(MeanMetric):
    """exp of the mean loss: a ``MeanMetric`` whose states sync (and reset) exactly like the loss's."""

    def compute(self) -> Tensor:
        return torch.exp(super().compute())


class T5(pl.LightningModule):
    """T5 (v1.0 or v1.1) encoder-decoder; presets tiny to 11B, trainable in any (dp, pp, tp) layout.

    Batches are ``{"input_ids", "attention_mask" (optional), "decoder_input_ids" (optional: else the labels
    shifted right), "labels"}`` (``-100`` labels are ignored), as :class:`~lightning_3d.recipes.data.Seq2SeqDataModule`
    makes them. The pipeline cuts the encoder blocks followed by the decoder blocks; the model is built on the
    meta device and initialised by parameter name, so every layout starts from the single-device weights.
    Validation and test log ``{val,test}_loss`` and ``{val,test}_ppl`` (torchmetrics, averaged over the epoch).
    ``attention="explicit"`` (default) runs each attention as scores, fp32 softmax and value mix; ``"sdpa"`` as one
    ``scaled_dot_product_attention`` call with the relative position bias as its additive mask (the same function;
    with dropout > 0 training always takes the explicit path, whose dropout draws from the tensor-parallel stream).
    ``sdpa_backends`` (with ``attention="sdpa"``): ``"auto"`` (the default: ``"no_cudnn"`` when the training data
    declares changing micro-batch shapes, else ``"torch"``, chosen once in ``configure_model``), ``"no_cudnn"`` (SDPA
    never picks cuDNN, whose per-shape plans changing shapes pay again and again) or ``"torch"`` (torch's own choice);
    see ``recipes/attention.py``.
    """

    # Tells ThroughputMFUMonitor that a batch's tokens are its inputs plus its targets (`labels`), see flops_per_token.
    is_encoder_decoder = True

    def __init__(
        self,
        preset_name: str = "tiny",
        vocab_size: int | None = None,
        num_layers: int | None = None,
        num_decoder_layers: int | None = None,
        hidden_size: int | None = None,
        num_heads: int | None = None,
        head_dim: int | None = None,
        ffn_hidden_size: int | None = None,
        feed_forward: str | None = None,
        tie_embeddings: bool | None = None,
        relative_attention_num_buckets: int | None = None,
        relative_attention_max_distance: int | None = None,
        dropout: float | None = None,
        layer_norm_eps: float | None = None,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        decoder_start_token_id: int | None = None,
        sdpa_backends: str | None = None,
        activation_checkpointing: bool = False,
        compile: bool | str = False,
        compile_scope: str = "block",
        attention: str = "explicit",
        learning_rate: float = 1e-3,
        min_learning_rate: float = 1e-4,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        optimizer_foreach: bool | None = None,
        optimizer_fused: bool | None = None,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        init_seed: int = 1234,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config: T5Config = preset(
            preset_name, vocab_size=vocab_size, num_layers=num_layers, num_decoder_layers=num_decoder_layers,
            hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim, ffn_hidden_size=ffn_hidden_size,
            feed_forward=feed_forward, tie_embeddings=tie_embeddings,
            relative_attention_num_buckets=relative_attention_num_buckets,
            relative_attention_max_distance=relative_attention_max_distance, dropout=dropout,
            layer_norm_eps=layer_norm_eps, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
            decoder_start_token_id=decoder_start_token_id, sdpa_backends=sdpa_backends,
        )
        check_speed_options(compile, optimizer_foreach, optimizer_fused, compile_scope)
        check_attention(attention)
        self.model: T5Model | None = None
        # Created on first use, outside the module tree: materialising the model (to_empty) would wipe their states.
        self._metrics: dict[str, MeanMetric] = {}

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
            self.model = T5Model(config, padded, self.hparams.activation_checkpointing, self.hparams.attention)
        if self.hparams.compile_scope == "stage" and self._tensor_parallel_size() > 1:
            raise ValueError(f"compile_scope='stage' needs tensor_parallel_size 1 (got {self._tensor_parallel_size()}):"
                             " tensor-parallel stages are compiled per block (compile_scope='block').")
        if not (self._trainer and isinstance(self.trainer.strategy, Compressed3DStrategy)):
            device = self._trainer.strategy.root_device if self._trainer else torch.device("cpu")
            materialize_(self.model, device)
            self.init_weights()
            if self.hparams.compile_scope == "stage":
                compile_blocks([self.model], self.hparams.compile)
            else:
                self._compile_blocks()

    def _compile_blocks(self) -> None:
        """Per-block compilation (see ``compile_blocks``): the encoder and the decoder block each trace once."""
        compile_blocks([*self.model.encoder.values(), *self.model.decoder.values()], self.hparams.compile)

    def init_weights(self) -> None:
        self.model.init_weights(self.hparams.init_seed)
        self._reset_padding_mask()

    def _reset_padding_mask(self) -> None:
        """The LM head's -inf mask over padded vocabulary columns (a buffer, so not set by ``init_weights``)."""
        head = self.model.lm_head
        if head is not None and head.padding_mask is not None:
            mask = torch.zeros(head.out_features, device=head.weight.device)
            mask[self.config.vocab_size :] = float("-inf")
            copy_full_into(head.padding_mask, mask)

    # ----- single-device / data-parallel path ----------------------------------------------------------------
    def forward(self, input_ids: Tensor, decoder_input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> Tensor:
        return self.model(input_ids, decoder_input_ids, attention_mask, labels)

    def _step_loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"], batch.get("decoder_input_ids"), batch.get("attention_mask"), batch["labels"])
        return self.pipeline_loss(logits, batch) / self.pipeline_loss_terms(batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._step_loss(batch)
        self.log_pipeline_loss(loss, "train")
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._step_loss(batch)
        self.log_pipeline_loss(loss, "val")
        return loss

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._step_loss(batch)
        self.log_pipeline_loss(loss, "test")
        return loss

    def log_pipeline_loss(self, loss: Tensor, stage: str) -> None:
        """Training: the step's loss. Evaluation: torchmetrics means of the loss and of its perplexity, whose
        states are synchronised across ranks when the epoch's value is computed."""
        if stage == "train":
            self.log("train_loss", loss, prog_bar=True)
            return
        for name, kind in ((f"{stage}_loss", MeanMetric), (f"{stage}_ppl", Perplexity)):
            if name not in self._metrics:
                self._metrics[name] = kind().to(loss.device)
            self._metrics[name].update(loss.detach().float())

    def _log_epoch(self, stage: str) -> None:
        for name in (f"{stage}_loss", f"{stage}_ppl"):
            if name in self._metrics:  # every rank logged the same steps, so every rank joins the sync
                # compute() already synchronised the states; sync_dist only averages equal values (and quiets Lightning).
                self.log(name, self._metrics[name].compute(), prog_bar=name.endswith("loss"), sync_dist=True)
                self._metrics[name].reset()

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    # ----- Parallel3DModule protocol -------------------------------------------------------------------------
    def num_pipeline_layers(self) -> int:
        return self.config.num_layers + self.config.decoder_layers

    def build_pipeline_stages(self, layouts: Sequence[StageLayout]) -> list[nn.Module]:
        keep = [i for layout in layouts for i in layout.layers]
        self.model.prune(keep, any(l.is_first for l in layouts), any(l.is_last for l in layouts))
        if self.hparams.compile_scope == "block":
            self._compile_blocks()  # lazy: traced at the first call, after tensor parallelism has sharded the blocks
        stages = [T5Stage(self.model, l.layers, l.is_first, l.is_last, l.activation_checkpointing) for l in layouts]
        if self.hparams.compile_scope == "stage":
            compile_blocks(stages, self.hparams.compile)  # each stage one graph
        return stages

    def parallelize_stage(self, stage: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        parallelize_t5(stage, tp_mesh, sequence_parallel)

    def pipeline_loss(self, output: Tensor, microbatch: dict[str, Tensor]) -> Tensor:
        return summed_token_cross_entropy(output, microbatch["labels"], compiled=bool(self.hparams.compile))

    def pipeline_loss_terms(self, microbatch: dict[str, Tensor]) -> Tensor:
        return count_target_tokens(microbatch["labels"])

    def check_pipeline_batch(self, microbatch: dict[str, Tensor]) -> None:
        """Ids within the vocabulary (relative position buckets bound no sequence length)."""
        check_token_batch(microbatch, self.config.vocab_size, ["input_ids", "decoder_input_ids"], "decoder_input_ids")

    def padded_parameters(self) -> list[str]:
        """Parameters whose first dimension is the padded vocabulary (it changes with the tensor-parallel size)."""
        return ["model.shared.weight", "model.lm_head.weight"]

    def pipeline_tied_parameters(self) -> dict[str, str]:
        return {"model.shared.weight": "model.lm_head.weight"} if self.config.tie_embeddings else {}

    # ----- optimisation --------------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (no decay on norms and bias tables); warmup then cosine decay."""
        return adamw_warmup_cosine(self, lambda name, p: p.ndim >= 2 and "relative_bias" not in name)

    def flops_per_token(self, input_length: int, target_length: int) -> float:
        """Training FLOPs per (input + target) token of ``input_length`` -> ``target_length`` pairs (for MFU)."""
        return self.config.flops_per_token(input_length, target_length)
