"""Tolerances for two fp32 evaluations of the same network that differ only in summation order (ours against
transformers', one process against a sharded layout): derived from fp32 rounding, not from a run.

An fp32 sum or dot product of n terms, in any order, lies within n·u·Σ|terms| of the exact value (u = 2^-24 ≈ 6e-8,
the unit roundoff; Higham, Accuracy and Stability of Numerical Algorithms, §3.1), so two orders differ by at most
2·n·u·Σ|terms|. A logit is the end of a chain of such reductions (per block: norm, projections, attention scores,
softmax sum, value mix, MLP products) whose errors carry forward relative to the activations' scale (norms rescale
every block, so the chain is taken as not amplifying them), giving 2 · reductions · longest · u relative to the
*scale* of the logits (their largest magnitude). An elementwise relative test is fragile: a logit near zero carries
the absolute error of its neighbours' scale.
"""

from __future__ import annotations

import torch

U = 2.0**-24  # fp32 unit roundoff


def chain_tolerance(reductions: int, longest: int) -> float:
    """Worst-case relative difference (to the output's scale) of two summation orders of ``reductions`` chained
    reductions of at most ``longest`` terms each."""
    return 2 * reductions * longest * U


def scaled_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` from ``b`` relative to the scale of ``b`` (its largest magnitude)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def loss_tolerance(logits_tolerance: float, logits: torch.Tensor) -> float:
    """Absolute bound on the difference of two token-mean cross-entropies whose logits differ by at most
    ``logits_tolerance`` times the logits' scale: log-sum-exp and the label's logit each move by at most the largest
    logit difference, so the loss moves by at most twice it."""
    return 2 * logits_tolerance * logits.abs().max().item()


def t5_tolerance(encoder_blocks: int, decoder_blocks: int, longest: int) -> float:
    """A T5's logits. Chained reductions: an encoder block has 9 (RMS norm, q/k/v projection, scores, softmax sum,
    value mix, output projection, RMS norm, FFN in, FFN out), a decoder block 15 (the same and cross-attention's
    norm, projection, scores, softmax sum, mix and output projection); then the encoder's final norm, the
    decoder's and the LM head: 3. ``longest``: the widest of them (FFN width, hidden size, sequence length)."""
    return chain_tolerance(9 * encoder_blocks + 15 * decoder_blocks + 3, longest)


def gpt_tolerance(blocks: int, longest: int) -> float:
    """A GPT's logits: 9 chained reductions per block (layer norm, qkv projection, scores, softmax sum, value mix,
    output projection, layer norm, MLP in, MLP out), then the final norm and the head: 2."""
    return chain_tolerance(9 * blocks + 2, longest)
