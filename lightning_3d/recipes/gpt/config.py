"""GPT configuration and the size presets the recipes and benchmarks use."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from lightning_3d.recipes.attention import DEFAULT_SDPA_BACKENDS, check_sdpa_backends, check_vocabulary


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-style decoder (learned positions, pre-LayerNorm, GELU MLP, tied embeddings)."""

    vocab_size: int = 50257
    seq_length: int = 1024
    num_layers: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    ffn_hidden_size: int | None = None
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    # GPT-2 checkpoints carry a key bias; it cannot change the output (softmax cancels it) and is off for
    # models trained here, on only to import such weights exactly.
    key_bias: bool = False
    # Under mixed precision the residual stream runs in the autocast dtype (bf16), like Megatron-LM's default; True
    # keeps it in fp32 (twice the memory traffic between the blocks' kernels).
    fp32_residual: bool = False
    init_std: float = 0.02
    vocab_multiple: int = 128
    # Which SDPA backends attention may run: "auto" (resolved by the LightningModule from its data), "no_cudnn" or
    # "torch" (recipes/attention.py, docs/dynamic.md).
    sdpa_backends: str = DEFAULT_SDPA_BACKENDS

    def __post_init__(self) -> None:
        check_sdpa_backends(self.sdpa_backends)
        check_vocabulary(self.vocab_size, self.vocab_multiple)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """Vocabulary rounded up to a multiple of ``vocab_multiple * tp`` (even shards, aligned GEMMs)."""
        multiple = self.vocab_multiple * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Trainable parameters of the unpadded model, the tied embedding counted once."""
        h, f, layers = self.hidden_size, self.ffn_size, self.num_layers
        per_layer = 4 * h * h + (4 if self.key_bias else 3) * h + 2 * h * f + f + h + 4 * h  # attention, MLP, norms
        total = layers * per_layer + 2 * h  # final LayerNorm
        if include_embeddings:
            total += self.vocab_size * h + self.seq_length * h
            if not self.tie_embeddings:
                total += self.vocab_size * h
        return total

    def flops_per_token(self, seq_length: int | None = None) -> float:
        """Training FLOPs per token: 6·N plus causal attention counted in full (12·layers·hidden·seq), Megatron's way."""
        seq = seq_length or self.seq_length
        return 6.0 * self.num_parameters() + 12.0 * self.num_layers * self.hidden_size * seq

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=4096, seq_length=128, num_layers=4, hidden_size=128, num_heads=4),
    "125m": GPTConfig(num_layers=12, hidden_size=768, num_heads=12),
    "350m": GPTConfig(num_layers=24, hidden_size=1024, num_heads=16),
    "760m": GPTConfig(num_layers=24, hidden_size=1536, num_heads=16),
    "1.3b": GPTConfig(num_layers=24, hidden_size=2048, num_heads=16),
    "2.5b": GPTConfig(num_layers=52, hidden_size=1920, num_heads=24),
    "8.3b": GPTConfig(num_layers=72, hidden_size=3072, num_heads=24),
}


def preset(name: str, **overrides) -> GPTConfig:
    """A preset by name with some fields replaced (``None`` values are ignored)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"Unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}.")
    return replace(PRESETS[key], **{k: v for k, v in overrides.items() if v is not None})
