"""Orthonormalisation for the power steps of CB and SC.

Both codecs need orthonormal columns spanning a tall, thin factor P (n x r, r <= 128), every step, on the hot path.
``torch.linalg.qr`` does that with Householder reflections in cuSOLVER, a latency-bound call per batch whose cost
hardly depends on the boundary size (benchmarks/RESULTS.md#2026-11-22-cb-kernels). Cholesky-QR needs only a Gram
product, an r x r Cholesky factor and a triangular solve, batched over any number of matrices, with no host
synchronisation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor

# Diagonal shifts of the Gram matrix G, relative to its trace (>= its largest eigenvalue). Cholesky breaks down in fp32
# once rounding (about r * eps * ||G||) outweighs G's smallest eigenvalue: a rank-deficient P (a gradient of low rank,
# a warm start left by one) breaks it, and the factor then holds NaN or inf. Shifting by more than that rounding keeps
# every factor finite; a shifted pass only scales weak directions down, which the next pass brings back. The last pass
# sees nearly orthonormal columns, so its shift is negligible and its columns have unit norm to fp32 precision.
SAFE_SHIFT = 1e-4  # passes over possibly ill-conditioned input: 1e-4 > r * eps = 8e-6 at r = 128
FINAL_SHIFT = 1e-10  # input ~orthonormal: no breakdown to prevent; a bias below fp32 eps
TINY = 1e-30  # floor of norms and scales: an all-zero P stays zero instead of dividing by zero


@contextlib.contextmanager
def fp32_matmul_precision(precision: Literal["tf32", "ieee"]) -> Iterator[None]:
    """Run the block's fp32 CUDA matmuls at ``precision``, then restore the caller's setting.

    Through torch's per-backend flag (``torch.backends.cuda.matmul.fp32_precision``), set and restored in the same
    API, so a user's ``torch.set_float32_matmul_precision`` still reads back as they left it. The flag is read when
    a kernel is launched, so this costs nothing on the GPU. CPU matmuls ignore it.
    """
    flags = torch.backends.cuda.matmul
    before = flags.fp32_precision
    flags.fp32_precision = precision
    try:
        yield
    finally:
        flags.fp32_precision = before


def orthonormalize(p: Tensor) -> Tensor:
    """fp32 matrix (or batch [..., n, r], n >= r) with orthonormal columns whose span contains that of ``p``.

    Always in full fp32 (IEEE) matmuls, whatever the caller allowed: the Gram matrix's rounding decides whether the
    Cholesky factorisation breaks down (see the shifts above), and TF32's 10-bit mantissa would be far above it.
    """
    with fp32_matmul_precision("ieee"):
        return _orthonormalize(p)


def _orthonormalize(p: Tensor) -> Tensor:
    """Cholesky-QR: with PᵀP = LLᵀ, P·L⁻ᵀ has orthonormal columns spanning the same space as P. One pass loses
    orthogonality as cond(P)² grows and breaks down on rank-deficient P, so passes repeat with diagonal shifts
    (shifted CholeskyQR, Fukaya et al. 2020), after scaling P's columns to unit norm (same span; no overflow or
    underflow in the Gram matrix whatever the gradient's magnitude). Like Gram-Schmidt it works column by column, so
    a column (nearly) in the span of the earlier ones comes out (nearly) zero; such columns, and any a breakdown
    left non-finite, are replaced by fixed, data-independent directions and orthonormalised again, which completes
    the basis as Householder QR does. Without that, a rank-deficient P (a warm-started Q after a low-rank gradient,
    zero rows, r above the gradient's rank) would lose those directions for good: every later power step would stay
    in the smaller span, and a full-rank factorisation would no longer be exact. Never returns NaN or inf.
    The column signs may differ from Householder QR's; the projection P·Pᵀ, all that PowerSGD uses, does not.
    """
    a = p.float()
    a = a / a.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(TINY)  # |entries| <= 1: squares cannot overflow
    a = a / a.norm(dim=-2, keepdim=True).clamp_min(TINY)
    for shift in (SAFE_SHIFT, SAFE_SHIFT / 10, SAFE_SHIFT / 100):  # decreasing: weak directions come back
        a = _cholesky_qr(a, shift)
    norms = a.norm(dim=-2, keepdim=True)
    # Orthonormal columns have norm ~1, degenerate ones ~0; NaN compares False. A column still damped below 0.8 after
    # three passes is (nearly) dependent on the others: kept, it would leave two nearly parallel columns behind.
    kept = (norms > 0.8) & (norms < 1.2)
    a = torch.where(kept, a, _completion(*a.shape[-2:], a.device))
    a = _cholesky_qr(_cholesky_qr(a, SAFE_SHIFT), FINAL_SHIFT)
    return torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)  # a last breakdown loses a column, never the step


@functools.lru_cache(maxsize=64)
def _completion(rows: int, cols: int, device: torch.device) -> Tensor:
    """Fixed orthonormal fp32 columns for the basis completion, built once per shape: a Gaussian matrix from a
    seeded CPU generator, orthonormalised in fp64, so every rank gets the same bits. Orthonormal among themselves,
    completion columns stay well conditioned after being orthogonalised against the kept ones."""
    generator = torch.Generator().manual_seed(rows * 1_000_003 + cols)
    basis = torch.linalg.qr(torch.randn(rows, cols, generator=generator, dtype=torch.float64)).Q
    return basis.to(device=device, dtype=torch.float32)


@functools.lru_cache(maxsize=64)
def _identity(size: int, device: torch.device) -> Tensor:
    return torch.eye(size, device=device, dtype=torch.float32)


def _cholesky_qr(a: Tensor, shift: float) -> Tensor:
    eye = _identity(a.shape[-1], a.device)
    gram = a.mT @ a
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    gram = gram + eye * (trace * shift + TINY)
    factor, _ = torch.linalg.cholesky_ex(gram)  # no error check: that would synchronise with the host
    return torch.linalg.solve_triangular(factor.mT, a, upper=True, left=False)
