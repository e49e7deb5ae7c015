"""T5 configuration and the size presets (T5 v1.0 and v1.1 shapes)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from lightning_3d.recipes.attention import DEFAULT_SDPA_BACKENDS, check_sdpa_backends, check_vocabulary

FEED_FORWARD = ("relu", "gated-gelu")


@dataclass(frozen=True)
class T5Config:
    """Shape of a T5 encoder-decoder: relative position bias, RMS norm, ReLU (v1.0) or gated-GELU (v1.1) MLP.

    ``tie_embeddings=True`` is v1.0: the output projection is the shared embedding and the decoder output is
    scaled by ``hidden_size ** -0.5`` before it (as Hugging Face does); v1.1 has an untied, unscaled head.
    ``pad_token_id`` doubles as the decoder start token (T5's convention) unless ``decoder_start_token_id`` says
    otherwise; the ids only matter for export and for shifting labels when a batch has no ``decoder_input_ids``.
    """

    vocab_size: int = 32128
    num_layers: int = 6  # encoder blocks
    num_decoder_layers: int | None = None  # default: as many as the encoder
    hidden_size: int = 512  # d_model
    num_heads: int = 8
    head_dim: int = 64  # d_kv; num_heads * head_dim need not equal hidden_size
    ffn_hidden_size: int = 2048  # d_ff
    feed_forward: str = "relu"
    tie_embeddings: bool = True
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout: float = 0.0
    layer_norm_eps: float = 1e-6
    init_factor: float = 1.0
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int | None = None
    vocab_multiple: int = 128
    # Which SDPA backends attention="sdpa" may run: "auto" (resolved by the LightningModule from its data), "no_cudnn"
    # or "torch" (recipes/attention.py, docs/dynamic.md).
    sdpa_backends: str = DEFAULT_SDPA_BACKENDS

    def __post_init__(self) -> None:
        check_sdpa_backends(self.sdpa_backends)
        check_vocabulary(self.vocab_size, self.vocab_multiple)
        if self.feed_forward not in FEED_FORWARD:
            raise ValueError(f"feed_forward={self.feed_forward!r} is not supported; choose one of {list(FEED_FORWARD)}.")
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "head_dim", "ffn_hidden_size",
                     "relative_attention_num_buckets", "relative_attention_max_distance"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer.")
        if self.decoder_layers < 1:
            raise ValueError(f"num_decoder_layers={self.num_decoder_layers} must be a positive integer.")

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size

    @property
    def inner_size(self) -> int:
        """Width of the attention projections (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def gated(self) -> bool:
        return self.feed_forward.startswith("gated")

    @property
    def start_token_id(self) -> int:
        return self.pad_token_id if self.decoder_start_token_id is None else self.decoder_start_token_id

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """Vocabulary rounded up to a multiple of ``vocab_multiple * tp`` (even shards, aligned GEMMs)."""
        multiple = self.vocab_multiple * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Trainable parameters of the unpadded model, the tied embedding counted once."""
        h, i, f = self.hidden_size, self.inner_size, self.ffn_size
        attention, mlp = 4 * h * i, (3 if self.gated else 2) * h * f
        encoder = self.num_layers * (attention + mlp + 2 * h) + h
        decoder = self.decoder_layers * (2 * attention + mlp + 3 * h) + h
        total = encoder + decoder + 2 * self.relative_attention_num_buckets * self.num_heads
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total

    def flops_per_sample(self, input_length: int, target_length: int) -> float:
        """Training FLOPs (forward + backward = 3x forward) of one (input, target) pair, Megatron's way.

        Weights: 6 FLOPs per weight per token that passes through it. A source token passes the encoder blocks and
        every decoder block's cross-attention k/v (they read the encoder output); a target token passes the decoder
        self-attention, cross-attention q/o, feed-forward and the LM head (unpadded vocabulary). Attention: the
        score and value products (4·inner per query-key pair forward, x3) of encoder self-attention (s x s), decoder
        self-attention counted in full (t x t, as Megatron counts causal attention) and cross-attention (t x s).
        Not counted: embedding lookups, norms, softmax, position biases and the loss (not matmuls).
        """
        s, t, h, i = input_length, target_length, self.hidden_size, self.inner_size
        mlp = (3 if self.gated else 2) * h * self.ffn_size
        per_source = self.num_layers * (4 * h * i + mlp) + self.decoder_layers * 2 * h * i
        per_target = self.decoder_layers * (6 * h * i + mlp) + h * self.vocab_size
        attention = 12 * i * (self.num_layers * s * s + self.decoder_layers * (t * t + t * s))
        return 6.0 * (s * per_source + t * per_target) + float(attention)

    def flops_per_token(self, input_length: int, target_length: int) -> float:
        """Training FLOPs per *(input + target)* token: ``flops_per_sample / (input_length + target_length)``.

        Multiply by ``batch x (input_length + target_length)``, the tokens ThroughputMFUMonitor counts for an
        encoder-decoder batch (padding positions included, as for GPT), to get a batch's FLOPs.
        """
        return self.flops_per_sample(input_length, target_length) / (input_length + target_length)

    def to_dict(self) -> dict:
        return asdict(self)


_V11 = dict(feed_forward="gated-gelu", tie_embeddings=False)
PRESETS: dict[str, T5Config] = {
    # CPU-sized, for smoke runs and the t5_tiny config.
    "tiny": T5Config(vocab_size=4096, num_layers=2, hidden_size=128, num_heads=4, head_dim=32, ffn_hidden_size=512),
    # T5 v1.1 shapes (google/t5-v1_1-small/base/large): gated-GELU, untied head.
    "small": T5Config(num_layers=8, hidden_size=512, num_heads=6, head_dim=64, ffn_hidden_size=1024, **_V11),
    "base": T5Config(num_layers=12, hidden_size=768, num_heads=12, head_dim=64, ffn_hidden_size=2048, **_V11),
    "large": T5Config(num_layers=24, hidden_size=1024, num_heads=16, head_dim=64, ffn_hidden_size=2816, **_V11),
    # T5 v1.0 shapes (t5-large, t5-3b, t5-11b): ReLU, tied head.
    "770m": T5Config(num_layers=24, hidden_size=1024, num_heads=16, head_dim=64, ffn_hidden_size=4096),
    "3b": T5Config(num_layers=24, hidden_size=1024, num_heads=32, head_dim=128, ffn_hidden_size=16384),
    "11b": T5Config(num_layers=24, hidden_size=1024, num_heads=128, head_dim=128, ffn_hidden_size=65536),
}


def preset(name: str, **overrides) -> T5Config:
    """A preset by name with some fields replaced (``None`` values are ignored)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"Unknown T5 preset {name!r}; choose one of {sorted(PRESETS)}.")
    return replace(PRESETS[key], **{k: v for k, v in overrides.items() if v is not None})
