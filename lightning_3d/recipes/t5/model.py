"""Our T5 encoder-decoder, written so that pipeline stages keep the full model's parameter names.

The pipeline sees ``num_layers + num_decoder_layers`` splittable layers: the encoder blocks, then the decoder
blocks, held in two ``nn.ModuleDict`` keyed by their index within their stack, so a pruned rank keeps names like
``decoder.3.cross_attn.q.weight`` exactly as in the full model (checkpoints, optimizer state, export).

Every stage runs :func:`run_stage` on the tensors it received. The first stage owns the shared embedding and
both relative-attention-bias tables; it embeds the encoder *and* the decoder input and passes the two tables on
as boundary tensors (tiny: buckets x heads), so each stage computes its position bias locally and the tables'
gradients flow back through the pipeline to their one owner: no weight is tied across more than two stages.

Packed rows (several (input, target) pairs concatenated) carry ``document_ids`` (encoder) and
``decoder_document_ids``: each pair's tokens then attend only to their own pair (encoder self-attention, causal
decoder self-attention and cross-attention), and the decoder input restarts with the start token at every pair.
Relative position buckets depend only on key - query offsets, which are unchanged inside a contiguous pair, so a
packed row computes exactly what its pairs compute alone (docs/multitask.md). Without them nothing extra is built.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.distributed.rng import ParallelDropout
from lightning_3d.recipes.attention import resolve_sdpa_backends, scaled_dot_product_attention
from lightning_3d.recipes.gpt.model import LMHead, copy_full_into, seed_for
from lightning_3d.recipes.t5.config import T5Config
from lightning_3d.recipes.training import IGNORE_INDEX
from lightning_3d.tensor_parallel import TensorParallel, fused_column_parallel, local_view

# Added to masked attention scores: finite in fp32 and bf16 alike (finfo(float32).min becomes -inf in bf16).
MASK_VALUE = torch.finfo(torch.bfloat16).min
# How attention is computed (the same function either way, see Attention): "explicit" (the default) or "sdpa".
# "sdpa" is not yet the default: under CB at full rank (tests/scenarios/t5_layouts.py, dp = pp = 2) its different
# rounding of the decoder bias table's rank-deficient gradient tips compression/lowrank.py's column-keeping threshold,
# and that layout is then no longer exact (docs/speed.md).
ATTENTION_IMPLEMENTATIONS = ("explicit", "sdpa")


def check_attention(implementation: str) -> None:
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention={implementation!r} is not supported; choose one of"
                         f" {list(ATTENTION_IMPLEMENTATIONS)} ('explicit': scores, fp32 softmax and the value mix as three"
                         " steps; 'sdpa': one scaled_dot_product_attention call).")


class RMSNorm(nn.Module):
    """T5's layer norm: scale only, no mean subtraction, statistics in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:class:`RMSNorm`'s computation on a given weight (the tensor-parallel norm passes its local one)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return weight * x


class Attention(nn.Module):
    """Unscaled multi-head attention (T5 folds 1/sqrt(d) into the init); ``memory`` makes it cross-attention."""

    def __init__(self, config: T5Config, implementation: str = "explicit") -> None:
        super().__init__()
        check_attention(implementation)
        self.implementation = implementation
        # "auto" still here: built outside a Trainer (or by hand), where no data says that shapes vary, so static
        # (the LightningModules resolve it first with their data in view: recipes/attention.py).
        self.sdpa_backends = resolve_sdpa_backends(config.sdpa_backends, varies_microbatch_shapes=False)
        h, inner = config.hidden_size, config.inner_size
        # Separate q/k/v so that column sharding hands every tensor-parallel rank whole heads.
        self.q = nn.Linear(h, inner, bias=False)
        self.k = nn.Linear(h, inner, bias=False)
        self.v = nn.Linear(h, inner, bias=False)
        self.o = nn.Linear(inner, h, bias=False)
        self.head_dim = config.head_dim
        # On the probabilities of this rank's own heads: its tensor-parallel stream.
        self.drop = ParallelDropout(config.dropout, sharded=True)
        # Set by parallelize_t5 (local tensors): the projections of one input then run as one column-parallel GEMM.
        self.tensor_parallel: TensorParallel | None = None

    def project(self, x: Tensor, memory: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """q of ``x``, k and v of ``memory`` (or of ``x``): this rank's heads' columns under tensor parallelism, all
        tokens (the inputs hold 1/tp of them under sequence parallelism). Self-attention's three projections read
        one input and cross-attention's k and v another: each input enters the tensor-parallel region once."""
        tp = self.tensor_parallel
        if tp is None:
            source = x if memory is None else memory
            return self.q(x), self.k(source), self.v(source)
        if memory is None:
            return fused_column_parallel(x, (self.q, self.k, self.v), tp)
        return (self.q(x), *fused_column_parallel(memory, (self.k, self.v), tp))

    def forward(self, x: Tensor, bias: Tensor | None, memory: Tensor | None = None,
                key_bias: Tensor | None = None) -> Tensor:
        """``bias``: position bias plus mask, (1 or batch, heads or 1, queries, keys), or None; ``key_bias``: the padding
        mask (batch, 1, 1, keys) added on top, kept apart so that ``bias`` and its gradient stay batch-free."""
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them (and of the bias). The lengths are
        # the projections': under sequence parallelism x and memory hold this rank's tokens, q, k and v all of them.
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in self.project(x, memory))
        b, s = q.shape[0], q.shape[2]
        if self.implementation == "sdpa" and not (self.training and self.drop.p > 0):
            y = self._fused(q, k, v, bias, key_bias, self.sdpa_backends)
        else:
            scores = q @ k.transpose(-1, -2)
            if bias is not None:
                scores = scores + bias
            if key_bias is not None:
                scores = scores + key_bias
            probs = self.drop(scores.float().softmax(-1).to(v.dtype))
            y = probs @ v
        return self.o(y.transpose(1, 2).reshape(b, s, -1))

    @staticmethod
    def _fused(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, key_bias: Tensor | None,
               sdpa_backends: str = "torch") -> Tensor:
        """The same attention in one SDPA call: the bias and mask as its additive ``attn_mask`` (whose gradient the
        memory-efficient CUDA kernel computes, so the relative-bias tables still train), no 1/sqrt(d) (``scale=1``).

        Not with dropout on the probabilities: SDPA draws its mask from the default generator, while ``self.drop``
        draws from the tensor-parallel stream (distributed/rng.py), so training with dropout keeps the explicit path.
        The mask takes the inputs' dtype (what autocast does to SDPA's arguments): under bf16 the bias is rounded
        once, where the explicit path rounds the scores ``q @ kᵀ`` instead, an error of the same order; SDPA then
        adds it to scores accumulated in fp32 and normalises in fp32."""
        mask = bias if key_bias is None else key_bias if bias is None else bias + key_bias
        if mask is not None:
            mask = mask.to(q.dtype)
        # sdpa_backends: flash takes no additive mask, so "no_cudnn" leaves the memory-efficient kernel (or math).
        return scaled_dot_product_attention(q, k, v, sdpa_backends, attn_mask=mask, scale=1.0)


class FeedForward(nn.Module):
    """v1.0: ``wo(relu(wi x))``; v1.1: ``wo(gelu_tanh(wi_0 x) * wi_1 x)`` (Hugging Face's names)."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_size
        self.gated = config.gated
        if self.gated:
            self.wi_0 = nn.Linear(h, f, bias=False)
            self.wi_1 = nn.Linear(h, f, bias=False)
        else:
            self.wi = nn.Linear(h, f, bias=False)
        self.wo = nn.Linear(f, h, bias=False)
        # On the hidden layer, whose columns are sharded over tp: each rank's own masks.
        self.drop = ParallelDropout(config.dropout, sharded=True)
        # Set by parallelize_t5 (local tensors): the gated pair then runs as one column-parallel GEMM.
        self.tensor_parallel: TensorParallel | None = None

    def forward(self, x: Tensor) -> Tensor:
        if not self.gated:
            hidden = F.relu(self.wi(x))
        else:
            # One input, two projections: entering the tensor-parallel region once (one all-gather under sequence
            # parallelism, one all-reduce of the input gradient) instead of once per projection.
            tp = self.tensor_parallel
            gate, up = (self.wi_0(x), self.wi_1(x)) if tp is None else fused_column_parallel(x, (self.wi_0, self.wi_1), tp)
            hidden = F.gelu(gate, approximate="tanh") * up
        return self.wo(self.drop(hidden))


class EncoderBlock(nn.Module):
    def __init__(self, config: T5Config, attention: str = "explicit") -> None:
        super().__init__()
        self.self_attn_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = Attention(config, attention)
        self.ff_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)
        self.ff = FeedForward(config)
        self.drop = ParallelDropout(config.dropout)  # residual: sharded under sequence parallelism (parallelize_t5)

    def forward(self, x: Tensor, bias: Tensor, key_bias: Tensor | None = None) -> Tensor:
        x = x + self.drop(self.self_attn(self.self_attn_norm(x), bias, key_bias=key_bias))
        return x + self.drop(self.ff(self.ff_norm(x)))


class DecoderBlock(nn.Module):
    def __init__(self, config: T5Config, attention: str = "explicit") -> None:
        super().__init__()
        self.self_attn_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = Attention(config, attention)
        self.cross_attn_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)
        self.cross_attn = Attention(config, attention)
        self.ff_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)
        self.ff = FeedForward(config)
        self.drop = ParallelDropout(config.dropout)  # residual: sharded under sequence parallelism (parallelize_t5)

    def forward(self, y: Tensor, memory: Tensor, bias: Tensor, cross_bias: Tensor | None) -> Tensor:
        y = y + self.drop(self.self_attn(self.self_attn_norm(y), bias))
        y = y + self.drop(self.cross_attn(self.cross_attn_norm(y), cross_bias, memory))
        return y + self.drop(self.ff(self.ff_norm(y)))


def relative_position_bucket(relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bucketing of ``key - query`` offsets (exact for small offsets, logarithmic up to ``max_distance``)."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    max_exact = num_buckets // 2
    large = max_exact + (
        torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(relative < max_exact, relative, large)


def position_bias(table: Tensor, queries: int, keys: int, bidirectional: bool, config: T5Config) -> Tensor:
    """(1, heads, queries, keys) bias from a (buckets, heads) table (a tensor-parallel rank's head slice)."""
    positions = torch.arange(keys, device=table.device)[None, :] - torch.arange(queries, device=table.device)[:, None]
    buckets = relative_position_bucket(positions, bidirectional, config.relative_attention_num_buckets,
                                       config.relative_attention_max_distance)
    return F.embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)


def decoder_inputs(mb: Mapping[str, Tensor], config: T5Config) -> Tensor:
    """``decoder_input_ids`` of the micro-batch, or its labels shifted right behind the start token."""
    if "decoder_input_ids" in mb:
        return mb["decoder_input_ids"]
    labels = mb["labels"]
    shifted = torch.full_like(labels, config.start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    if (documents := mb.get("decoder_document_ids")) is not None:  # every packed target starts afresh
        shifted[:, 1:] = shifted[:, 1:].masked_fill(documents[:, 1:] != documents[:, :-1], config.start_token_id)
    return shifted.masked_fill(shifted == IGNORE_INDEX, config.pad_token_id)


def _key_mask(mb: Mapping[str, Tensor]) -> Tensor | None:
    """(batch, 1, 1, keys) True where an encoder token must be ignored, or None without an attention mask."""
    mask = mb.get("attention_mask")
    return None if mask is None else ~mask.bool()[:, None, None, :]


def _other_document(queries: Tensor | None, keys: Tensor | None) -> Tensor | None:
    """(batch, 1, queries, keys) True where query and key belong to different packed pairs, or None when unpacked."""
    if queries is None and keys is None:
        return None
    if queries is None or keys is None:
        raise ValueError("Packed T5 micro-batches need both document_ids (encoder) and decoder_document_ids; got only"
                         f" {'document_ids' if keys is not None else 'decoder_document_ids'}.")
    return (queries[:, :, None] != keys[:, None, :])[:, None]


def _masked(bias: Tensor, *masks: Tensor | None) -> Tensor:
    for mask in masks:
        if mask is not None:
            bias = bias.masked_fill(mask, MASK_VALUE)
    return bias


def _mask_addend(*masks: Tensor | None) -> Tensor | None:
    """The masks as one additive fp32 tensor of their broadcast shape (MASK_VALUE where any is True), or None."""
    present = [mask for mask in masks if mask is not None]
    if not present:
        return None
    shape = torch.broadcast_shapes(*(mask.shape for mask in present))
    return _masked(torch.zeros(shape, device=present[0].device), *present)


def run_stage(m: nn.Module, received: tuple[Tensor, ...], mb: Mapping[str, Tensor]) -> Tensor | tuple[Tensor, ...]:
    """The computation of a T5Model or of one pipeline stage ``m`` (same attribute names, absent parts None).

    Boundaries: (encoder hidden, decoder embeddings, encoder table, decoder table) while the encoder runs, then
    (decoder hidden, encoder output, decoder table); the last stage returns the (padded-vocabulary) logits.
    """
    cfg: T5Config = m.config
    dec_ids = decoder_inputs(mb, cfg)
    sp = getattr(m, "sequence_parallel_size", 1)
    if sp > 1 and (mb["input_ids"].shape[1] % sp or dec_ids.shape[1] % sp):
        raise ValueError(f"Sequence parallelism over {sp} ranks needs input and target lengths divisible by {sp}; got"
                         f" {mb['input_ids'].shape[1]} and {dec_ids.shape[1]}. Pad the batches to a multiple of {sp}.")
    x = memory = None
    if not received:
        # This rank's heads' columns under tensor parallelism, computed on locally (no collective).
        enc_table, dec_table = local_view(m.encoder_relative_bias.weight), local_view(m.decoder_relative_bias.weight)
        x, y = m.drop(m.shared(mb["input_ids"])), m.drop(m.shared(dec_ids))
    elif len(received) == 4:
        x, y, enc_table, dec_table = received
    else:
        y, memory, dec_table = received
    enc_docs, dec_docs = mb.get("document_ids"), mb.get("decoder_document_ids")
    if len(m.encoder):
        s = mb["input_ids"].shape[1]
        bias = position_bias(enc_table, s, s, True, cfg)
        # The encoder's masks as their own head-free addend (batch, 1, 1 or s, s): folded into the position bias they
        # made a (batch, heads, s, s) fp32 tensor that every encoder block read, and whose gradient every block wrote
        # and autograd summed; apart, the bias and its gradient stay (1, heads, s, s).
        keys = _mask_addend(_key_mask(mb), _other_document(enc_docs, enc_docs))
        for block in m.encoder.values():
            x = _call(m, block, x, bias, keys)
    if m.encoder_norm is not None:
        memory, x = m.drop(m.encoder_norm(x)), None
    if len(m.decoder):
        t = dec_ids.shape[1]
        future = torch.ones(t, t, dtype=torch.bool, device=dec_table.device).triu(1)
        bias = _masked(position_bias(dec_table, t, t, False, cfg), future, _other_document(dec_docs, dec_docs))
        cross = _mask_addend(_key_mask(mb), _other_document(dec_docs, enc_docs))
        for block in m.decoder.values():
            y = _call(m, block, y, memory, bias, cross)
    if m.lm_head is not None:
        y = m.drop(m.decoder_norm(y))
        if cfg.tie_embeddings:
            y = y * cfg.hidden_size**-0.5  # v1.0's tied head sees a rescaled decoder output (as in transformers)
        return m.lm_head(y)
    # Tensors only passed along become views, so their gradients flow through autograd like any output's.
    if memory is None:
        return x, y.view_as(y), enc_table.view_as(enc_table), dec_table.view_as(dec_table)
    return y, memory.view_as(memory), dec_table.view_as(dec_table)


def _call(m: nn.Module, block: nn.Module, *args: Tensor | None) -> Tensor:
    if m.activation_checkpointing and torch.is_grad_enabled():
        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


class T5Model(nn.Module):
    """The full model; ``prune`` sets the parts a pipeline rank does not own to None (or deletes blocks).

    ``attention``: ``"explicit"`` (scores, fp32 softmax, value mix) or ``"sdpa"`` (one fused kernel per attention,
    the bias as its additive mask); the same function, see :class:`Attention`."""

    def __init__(self, config: T5Config, padded_vocab: int | None = None, activation_checkpointing: bool = False,
                 attention: str = "explicit"):
        super().__init__()
        self.config = config
        self.padded_vocab = padded_vocab or config.padded_vocab_size(1)
        self.activation_checkpointing = activation_checkpointing
        h, heads, buckets = config.hidden_size, config.num_heads, config.relative_attention_num_buckets
        self.shared: nn.Embedding | None = nn.Embedding(self.padded_vocab, h)
        self.encoder_relative_bias: nn.Embedding | None = nn.Embedding(buckets, heads)
        self.decoder_relative_bias: nn.Embedding | None = nn.Embedding(buckets, heads)
        self.encoder = nn.ModuleDict({str(i): EncoderBlock(config, attention) for i in range(config.num_layers)})
        self.encoder_norm: RMSNorm | None = RMSNorm(h, config.layer_norm_eps)
        self.decoder = nn.ModuleDict({str(i): DecoderBlock(config, attention) for i in range(config.decoder_layers)})
        self.decoder_norm: RMSNorm | None = RMSNorm(h, config.layer_norm_eps)
        self.lm_head: LMHead | None = LMHead(h, config.vocab_size, self.padded_vocab)
        if config.tie_embeddings:
            self.lm_head.weight = self.shared.weight
        # On the embeddings and the final norms' outputs: sharded under sequence parallelism (parallelize_t5).
        self.drop = ParallelDropout(config.dropout)

    def forward(self, input_ids: Tensor, decoder_input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> Tensor:
        """Logits over the padded vocabulary (padding columns are -inf)."""
        mb = {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids, "attention_mask": attention_mask,
              "labels": labels}
        return run_stage(self, (), {k: v for k, v in mb.items() if v is not None})

    # ----- pipeline support -------------------------------------------------------------------------
    def prune(self, keep_layers: Iterable[int], keep_first: bool, keep_last: bool) -> None:
        """Delete what this pipeline rank does not own; names of what remains are unchanged."""
        keep, n_enc = set(keep_layers), self.config.num_layers
        for name in list(self.encoder.keys()):
            if int(name) not in keep:
                del self.encoder[name]
        for name in list(self.decoder.keys()):
            if int(name) + n_enc not in keep:
                del self.decoder[name]
        if n_enc - 1 not in keep:
            self.encoder_norm = None
        if not keep_first:
            self.shared = self.encoder_relative_bias = self.decoder_relative_bias = None
        if not keep_last:
            self.decoder_norm = self.lm_head = None
        elif self.config.tie_embeddings and self.shared is None:
            # This stage's own copy of the embedding, kept equal by the tied-gradient sync with the first stage.
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.detach().clone())

    # ----- initialisation -----------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Transformers' T5 init, seeded by parameter name: every (dp, pp, tp) layout starts from the same weights."""
        cfg, f = self.config, self.config.init_factor
        h, inner = cfg.hidden_size, cfg.inner_size
        stds = {"q": f * (h * cfg.head_dim) ** -0.5, "k": f * h**-0.5, "v": f * h**-0.5, "o": f * inner**-0.5,
                "wi": f * h**-0.5, "wi_0": f * h**-0.5, "wi_1": f * h**-0.5, "wo": f * cfg.ffn_size**-0.5}
        for name, param in self.named_parameters():
            key = "shared.weight" if name == "lm_head.weight" and cfg.tie_embeddings else name
            module = key.rsplit(".", 2)[-2]
            if "norm" in module:
                copy_full_into(param, torch.ones(param.shape, device=param.device, dtype=param.dtype))
                continue
            std = f if key in ("shared.weight", "lm_head.weight") else f * h**-0.5 if "relative_bias" in key else stds[module]
            shape = list(param.shape)
            if key in ("shared.weight", "lm_head.weight"):
                shape[0] = cfg.vocab_size  # only real rows are random; padding rows are zero
            generator = torch.Generator(device=param.device).manual_seed(seed_for(seed, key))
            values = torch.empty(shape, device=param.device, dtype=torch.float32).normal_(0.0, std, generator=generator)
            if shape[0] != param.shape[0]:
                values = torch.cat([values, values.new_zeros(param.shape[0] - shape[0], *shape[1:])])
            copy_full_into(param, values.to(param.dtype))
