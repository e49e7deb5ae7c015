"""Our GPT-2-style decoder, written so that pipeline stages keep the full model's parameter names.

Layers live in an ``nn.ModuleDict`` keyed by their global index (torchtitan's trick): pruning the
layers a pipeline rank does not own leaves ``layers.7.attn.q.weight`` named exactly as in the full
model, so checkpoints, optimizer state and Hugging Face export line up across (dp, pp, tp) layouts.

Packed rows (several documents concatenated into one sequence) carry ``document_ids`` and ``position_ids`` in the
micro-batch: attention is then causal *within* each document only and positions restart at 0 per document, so a
packed row computes exactly what its documents compute alone (see docs/multitask.md). ``packed_attention`` picks how:
``"flex"`` builds a FlexAttention block mask (causal and same document), which skips the blocks across documents,
``"sdpa"`` a dense (batch, 1, s, s) boolean mask for SDPA, which computes every block of the row; ``"auto"`` is flex on
CUDA and the SDPA mask elsewhere (FlexAttention has no CPU backward), with attention dropout (flex has none) or with
heads narrower than inductor's flex kernel takes (:data:`FLEX_MIN_HEAD_DIM`).
Without ``document_ids`` the model runs SDPA's causal kernel as before, with no mask built.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from lightning_3d.context import ring_attention, ulysses_attention
from lightning_3d.distributed.rng import ParallelDropout, in_tensor_parallel_region, is_seeded
from lightning_3d.recipes import training
from lightning_3d.recipes.attention import resolve_sdpa_backends, scaled_dot_product_attention
from lightning_3d.recipes.gpt.config import GPTConfig

# Re-exported for the modules that import them from here (T5, the Hugging Face interop); defined in training.py, which
# must not import this module (this one reads training.COMPILE_BACKEND).
from lightning_3d.recipes.training import copy_full_into, seed_for  # noqa: F401
from lightning_3d.strategies.protocol import read_on_host
from lightning_3d.tensor_parallel import TensorParallel, fused_column_parallel
from lightning_3d.utils.compat import flex_attention_trains_on


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden_size
        # Separate q/k/v parameters so that column sharding splits whole heads (a fused qkv weight would hand each
        # tensor-parallel rank a slice that mixes q, k and v rows); under tensor parallelism they still run as one GEMM
        # (project_qkv).
        self.q = nn.Linear(h, h)
        # No key bias by default: it adds q·b to every score of a query, which softmax cancels, so its gradient
        # is exactly zero and Adam would only amplify rounding noise into it (Whisper drops it too).
        self.k = nn.Linear(h, h, bias=config.key_bias)
        self.v = nn.Linear(h, h)
        self.proj = nn.Linear(h, h)
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        # "auto" still here: built outside a Trainer (or by hand), where no data says that shapes vary, so static
        # (the LightningModules resolve it first with their data in view: recipes/attention.py).
        self.sdpa_backends = resolve_sdpa_backends(config.sdpa_backends, varies_microbatch_shapes=False)
        # Context parallelism (GPT.enable_context_parallel): (cp group, layout, "ring" | "ulysses"); the tokens are
        # then this rank's slice of the sequence, and attention spans the whole sequence (docs/context_parallel.md).
        self.context: tuple | None = None
        # Set by parallelize_gpt: q, k and v then run as one column-parallel GEMM on local shards.
        self.tensor_parallel: TensorParallel | None = None

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of ``x``: this rank's heads' columns under tensor parallelism, all tokens (x holds 1/tp of them
        under sequence parallelism)."""
        if self.tensor_parallel is None:
            return self.q(x), self.k(x), self.v(x)
        return fused_column_parallel(x, (self.q, self.k, self.v), self.tensor_parallel)

    def forward(self, x: Tensor, mask: Tensor | BlockMask | None = None) -> Tensor:
        """``mask``: None (plain causal attention), a boolean (batch, 1, queries, keys) mask, True where a query may
        attend (block-diagonal causal for packed documents, see :func:`document_mask`), or the same as a FlexAttention
        ``BlockMask`` (:func:`document_block_mask`)."""
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them (a block mask is head-free).
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in self.project_qkv(x))
        b, s = q.shape[0], q.shape[2]
        causal = mask is None  # a mask already holds causality; SDPA refuses both at once
        if self.context is not None:
            if mask is not None:
                raise ValueError("Context-parallel attention is causal over whole sequences; packed documents (an"
                                 " attention mask, dense or FlexAttention's) need context_parallel_size=1.")
            group, layout, kind = self.context
            attend = ring_attention if kind == "ring" else ulysses_attention
            y = attend(q, k, v, group, causal=True, layout=layout)  # no dropout: refused with cp (enable_context_parallel)
        elif isinstance(mask, BlockMask):
            # No attention dropout here: packed_attention refuses "flex" with dropout > 0 and "auto" takes the SDPA mask
            # then (check_packed_attention, resolve_packed_attention).
            y = flex_document_attention(q, k, v, mask)
        elif self.training and self.dropout > 0 and is_seeded():
            # The probabilities of this rank's own heads: their masks come from its tensor-parallel stream.
            y = in_tensor_parallel_region(scaled_dot_product_attention, q, k, v, self.sdpa_backends, attn_mask=mask,
                                          is_causal=causal, dropout_p=self.dropout, device=x.device)
        else:
            # The same backend selection in eager, compiled and recomputed code (recipes/attention.py).
            y = scaled_dot_product_attention(q, k, v, self.sdpa_backends, attn_mask=mask, is_causal=causal,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.ffn_size)
        self.proj = nn.Linear(config.ffn_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        # Replicated residual: the same masks on every tp rank; sharded under sequence parallelism (parallelize_gpt).
        self.drop = ParallelDropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        # The mask goes by keyword: the tensor-parallel plan's PrepareModuleInput redistributes positional inputs only.
        x = x + self.drop(self.attn(self.ln1(x)) if mask is None else self.attn(self.ln1(x), mask=mask))
        return x + self.drop(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, config: GPTConfig, padded_vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(padded_vocab, config.hidden_size)
        self.wpe = nn.Embedding(config.seq_length, config.hidden_size)
        # On the full (replicated) embeddings, before sequence parallelism shards them: the default stream.
        self.drop = nn.Dropout(config.dropout)
        self.max_positions = config.seq_length
        self.fp32_residual = config.fp32_residual

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """``position_ids``: (batch, seq) positions of packed documents (restarting at 0 per document), or None for
        0..seq-1 in every row."""
        seq = input_ids.shape[1]
        if seq > self.max_positions:
            raise ValueError(f"Sequence length {seq} exceeds the model's {self.max_positions} positions (seq_length).")
        positions = torch.arange(seq, device=input_ids.device) if position_ids is None else position_ids
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        device = x.device.type
        if not self.fp32_residual and torch.is_autocast_enabled(device):
            # The residual stream in the autocast dtype, as Megatron-LM runs it: under autocast it would otherwise
            # stay fp32 (the embedding's dtype) and every block's norm, residual add and their gradients would read
            # and write it at twice the bytes (measured: benchmarks/RESULTS.md#2026-11-22e-bf16-residual).
            # Also halves the activations sent between pipeline stages.
            x = x.to(torch.get_autocast_dtype(device))
        return x


class LMHead(nn.Linear):
    """Output projection onto the padded vocabulary; padded logits are masked to -inf.

    Masking makes padding invisible to the loss, so a model trained at one tensor-parallel size (and thus
    one padding) continues exactly at another. It subclasses ``nn.Linear`` so that torch's
    ``ColwiseParallel`` accepts it.
    """

    def __init__(self, hidden: int, vocab_size: int, padded_vocab: int) -> None:
        super().__init__(hidden, padded_vocab, bias=False)
        mask = torch.zeros(padded_vocab)
        mask[vocab_size:] = float("-inf")
        self.register_buffer("padding_mask", mask if padded_vocab > vocab_size else None, persistent=False)
        # GPT(fused_head_loss=True): the loss applies this projection chunk by chunk (recipes/kernels.py), so the
        # stage ends at the final norm.
        self.fused_with_loss = False

    def forward(self, x: Tensor) -> Tensor:
        # The mask goes in as the GEMM's bias: cuBLAS adds it in the GEMM's epilogue, where a separate add would read
        # and write every logit once more (the largest activation; a compiled stage cannot fuse the add into the loss,
        # which is another graph). Adding 0 or -inf to the product before or after its rounding gives the same bits.
        mask = self.padding_mask
        return F.linear(x, self.weight, None if mask is None else mask.to(self.weight.dtype))


class GPTModel(nn.Module):
    """The full decoder. ``embed``/``norm``/``head`` become ``None`` on pipeline ranks that do not own them."""

    def __init__(self, config: GPTConfig, padded_vocab: int | None = None, activation_checkpointing: bool = False,
                 packed_attention: str = "auto"):
        super().__init__()
        check_packed_attention(packed_attention, config.dropout)
        self.config = config
        self.padded_vocab = padded_vocab or config.padded_vocab_size(1)
        self.activation_checkpointing = activation_checkpointing
        # How packed rows (document_ids) attend: "flex", "sdpa" or "auto" (see the module docstring).
        self.packed_attention = packed_attention
        self.embed: Embedding | None = Embedding(config, self.padded_vocab)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.num_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.head: LMHead | None = LMHead(config.hidden_size, config.vocab_size, self.padded_vocab)
        if config.tie_embeddings:
            self.head.weight = self.embed.wte.weight

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None) -> Tensor:
        """Logits; ``document_ids`` (batch, seq) marks packed documents (see the module docstring)."""
        positions, mask = packing_inputs({"document_ids": document_ids, "position_ids": position_ids},
                                         self.packed_attention, self.config.dropout, self.config.head_dim)
        return run_layers(self, self.embed(input_ids, positions), self.layers.values(), mask)

    # ----- pipeline support -------------------------------------------------------------------------
    def prune(self, keep_layers: Iterable[int], keep_embedding: bool, keep_head: bool) -> None:
        """Delete what this pipeline rank does not own; names of what remains are unchanged."""
        keep = {str(i) for i in keep_layers}
        for name in list(self.layers.keys()):
            if name not in keep:
                del self.layers[name]
        if not keep_embedding:
            self.embed = None
        if not keep_head:
            self.norm = None
            self.head = None
        elif self.config.tie_embeddings and self.embed is None:
            # The head's weight was the embedding's; now it is this stage's own copy, kept equal by the
            # tied-gradient synchronisation between the first and last stage.
            self.head.weight = nn.Parameter(self.head.weight.detach().clone())

    # ----- initialisation -----------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int, prefix: str = "") -> None:
        """Deterministic init keyed by parameter name: every (dp, pp, tp) layout starts from the same weights."""
        cfg = self.config
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        for name, param in self.named_parameters():
            key = "embed.wte.weight" if name == "head.weight" and cfg.tie_embeddings else name
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                std = out_std
            elif name.endswith("bias") or ".ln" in name or name.startswith("norm."):
                std = None
            else:
                std = cfg.init_std
            if std is None:
                full = torch.ones(param.shape) if name.endswith("weight") else torch.zeros(param.shape)
                copy_full_into(param, full.to(param.device, param.dtype))
                continue
            shape = list(param.shape)
            if key in ("embed.wte.weight", "head.weight"):
                shape[0] = cfg.vocab_size  # only real rows are random; padding rows are zero
            generator = torch.Generator(device=param.device).manual_seed(seed_for(seed, prefix + key))
            values = torch.empty(shape, device=param.device, dtype=torch.float32).normal_(0.0, std, generator=generator)
            if shape[0] != param.shape[0]:
                values = torch.cat([values, values.new_zeros(param.shape[0] - shape[0], *shape[1:])])
            copy_full_into(param, values.to(param.dtype))


def run_layers(model: GPTModel, x: Tensor, layers: Iterable[nn.Module], mask: Tensor | BlockMask | None = None) -> Tensor:
    """Apply blocks (with optional activation checkpointing) and, if owned, the final norm and head. ``mask``: the
    packed documents' attention mask (:func:`document_mask` or :func:`document_block_mask`), built once per
    micro-batch and shared by all blocks; a recomputed block gets the same mask, so it runs the same kernel."""
    extra = {} if mask is None else {"mask": mask}
    for layer in layers:
        if model.activation_checkpointing and torch.is_grad_enabled():
            x = checkpoint(layer, x, use_reentrant=False, **extra)
        else:
            x = layer(x, **extra)
    if model.head is not None:
        x = model.norm(x)
        if not model.head.fused_with_loss:
            x = model.head(x)
    return x


def document_mask(document_ids: Tensor) -> Tensor:
    """(batch, 1, seq, seq) boolean mask, True where query i may attend key j: same document and j <= i.

    Every query keeps at least its own position, so no softmax row is empty (padding at the end of a packed row is
    one more "document" whose labels are ignored)."""
    seq = document_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


PACKED_ATTENTION = ("auto", "flex", "sdpa")


def check_packed_attention(packed_attention: str, dropout: float) -> None:
    """ValueError naming the value and the fix for a ``packed_attention`` the model cannot run (at construction, on
    every rank, before any collective)."""
    if packed_attention not in PACKED_ATTENTION:
        raise ValueError(f"packed_attention={packed_attention!r}: use one of {PACKED_ATTENTION} ('auto': FlexAttention's"
                         " block mask on CUDA, SDPA's dense mask elsewhere).")
    if packed_attention == "flex" and dropout > 0:
        raise ValueError(f"packed_attention='flex' with dropout={dropout}: FlexAttention has no attention dropout. Use"
                         " dropout=0.0, or packed_attention='sdpa' (or 'auto', which takes the SDPA mask when"
                         " dropout > 0).")


# Inductor's CUDA FlexAttention kernel refuses narrower heads (tl.dot's smallest tile is 16 wide): it raises while
# compiling, deep inside the first forward, so "auto" keeps the SDPA mask for them and "flex" is refused up front.
FLEX_MIN_HEAD_DIM = 16


def resolve_packed_attention(packed_attention: str, device: torch.device, dropout: float, head_dim: int) -> str:
    """"flex" or "sdpa" for packed rows on ``device``. "auto" takes FlexAttention where it runs as a fused kernel and
    trains (CUDA with heads of at least :data:`FLEX_MIN_HEAD_DIM`; torch has no FlexAttention backward on CPU) and
    where nothing needs attention dropout. "flex" on CUDA with narrower heads: ValueError naming the fix."""
    if packed_attention == "auto":
        cuda_kernel = device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM
        return "flex" if cuda_kernel and dropout == 0 else "sdpa"
    if packed_attention == "flex" and device.type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM:
        raise ValueError(f"packed_attention='flex' with head_dim={head_dim} on cuda: torch's fused FlexAttention kernel"
                         f" needs head_dim >= {FLEX_MIN_HEAD_DIM}. Use packed_attention='auto' or 'sdpa' (SDPA's"
                         " dense mask), or fewer, wider heads (hidden_size / num_heads >= 16).")
    return packed_attention


def check_flex_trains(packed_attention: str, device: torch.device, dropout: float, head_dim: int) -> None:
    """ValueError naming the fix when packed rows would train through FlexAttention on a device where torch has no
    FlexAttention backward (CPU): ``packed_attention="flex"`` there ("auto" takes the SDPA mask)."""
    if resolve_packed_attention(packed_attention, device, dropout, head_dim) != "flex":
        return
    reason = flex_attention_trains_on(device)
    if reason is not None:
        raise ValueError(f"packed_attention='flex' cannot train packed rows on {device.type}: {reason} Use"
                         " packed_attention='auto' (FlexAttention on CUDA, SDPA's dense mask elsewhere) or 'sdpa'.")


@torch.compiler.disable
def document_block_mask(document_ids: Tensor) -> BlockMask:
    """The FlexAttention ``BlockMask`` of :func:`document_mask` (same document and key <= query) over (batch, heads
    broadcast, seq, seq): blocks wholly across documents are skipped, blocks wholly inside one document's causal
    part run without evaluating the mask. Built outside any enclosing graph (``torch.compiler.disable``), also under
    a compiled stage: building it inside the graph would trace the block sparsity computation into every stage graph;
    on CUDA by a compiled ``create_block_mask`` of its own (see below)."""
    batch, seq = document_ids.shape

    def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (document_ids[b, q] == document_ids[b, kv]) & (kv <= q)

    # Eagerly, create_block_mask evaluates the mask on every (query, key) pair through int64 (batch, seq, seq)
    # intermediates: 8 bytes a pair, per micro-batch and stage, more than SDPA's dense boolean mask. Compiled, the
    # same evaluation fuses into one pass that keeps only the block tables. CUDA only: that is where flex trains,
    # while on CPU (inference, tests) a compile per shape would cost more than the eager build.
    build = _compiled_create_block_mask(training.COMPILE_BACKEND) if document_ids.is_cuda else create_block_mask
    return build(same_document_causal, batch, None, seq, seq, device=document_ids.device)


@functools.cache
def _compiled_create_block_mask(backend: str) -> Callable[..., BlockMask]:
    # One compiled builder per process: the document ids are an input of its graph (as of flex's), so new documents
    # of the same shape reuse it.
    return torch.compile(create_block_mask, backend=backend)


@functools.cache
def _compiled_flex_attention(backend: str) -> Callable[..., Tensor]:
    # FlexAttention is fused only under torch.compile (eager runs a reference that materialises every score); one
    # compiled callable per process, reused by every block and micro-batch.
    return torch.compile(flex_attention, backend=backend)


def flex_document_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask) -> Tensor:
    """FlexAttention of (batch, heads, seq, head_dim) ``q``, ``k``, ``v`` under ``block_mask``: compiled on its own
    in eager blocks, traced into the enclosing graph in compiled blocks (a nested torch.compile would be ignored)."""
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask)
    try:
        return _compiled_flex_attention(training.COMPILE_BACKEND)(q, k, v, block_mask=block_mask)
    except NotImplementedError as err:  # torch's refusal, e.g. no FlexAttention backward on CPU
        raise NotImplementedError(f"packed_attention='flex' on {q.device.type}: {err} Use packed_attention='auto'"
                                  " (FlexAttention on CUDA, SDPA's dense mask elsewhere) or 'sdpa'.") from err


def document_positions(document_ids: Tensor) -> Tensor:
    """Positions restarting at 0 where the document id changes (documents are contiguous runs of one id)."""
    seq = document_ids.shape[-1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values


def packing_inputs(microbatch: Mapping[str, Tensor | None], packed_attention: str = "sdpa", dropout: float = 0.0,
                   head_dim: int = FLEX_MIN_HEAD_DIM) -> tuple[Tensor | None, Tensor | BlockMask | None]:
    """(position ids, attention mask) of a micro-batch: both None without ``document_ids`` (plain rows); with them,
    its ``position_ids`` (or positions derived from the documents) and the block-diagonal causal mask: a FlexAttention
    block mask or SDPA's dense mask, as ``packed_attention`` resolves on the documents' device for the model's
    ``dropout`` and ``head_dim`` (:func:`resolve_packed_attention`; the models pass their own)."""
    documents = microbatch.get("document_ids")
    if documents is None:
        return microbatch.get("position_ids"), None
    positions = microbatch.get("position_ids")
    positions = document_positions(documents) if positions is None else positions
    if resolve_packed_attention(packed_attention, documents.device, dropout, head_dim) == "flex":
        return positions, document_block_mask(documents)
    return positions, document_mask(documents)


def check_packed_batch(microbatch: Mapping[str, Tensor], max_positions: int) -> None:
    """ValueError naming the bad value when a packed micro-batch's ``document_ids`` / ``position_ids`` do not match
    its ``input_ids`` or hold a position outside the model's ``max_positions`` (an embedding index error on one stage
    otherwise). Nothing to do (no synchronisation) for plain micro-batches; positions are read through ``read_on_host``."""
    ids = microbatch.get("input_ids")
    for name in ("document_ids", "position_ids"):
        value = microbatch.get(name)
        if value is not None and ids is not None and value.shape != ids.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} but input_ids {tuple(ids.shape)}: packed rows need"
                             f" one {name[:-4]} id per token.")
    positions = microbatch.get("position_ids")
    if positions is not None and positions.numel():
        def verdict(bounds: list[int]) -> None:
            low, high = bounds
            if low < 0 or high >= max_positions:
                raise ValueError(f"position_ids hold {low if low < 0 else high}, outside the model's {max_positions}"
                                 f" positions (0 to {max_positions - 1}, seq_length): pack documents of at most"
                                 f" {max_positions} tokens, or build the model with a larger seq_length.")

        read_on_host(torch.stack([positions.min(), positions.max()]), verdict)
