"""Orthonormalisation for the power steps of CB and SC.

Both codecs need orthonormal columns spanning a tall, thin factor P (n x r, r <= 128), every step, on the hot path.
``torch.linalg.qr`` does that with Householder reflections in cuSOLVER, a latency-bound call per batch (CB's
encoder, one QR included, measured 0.4–1 ms per call on an H200 whatever the boundary size: RESULTS.md (b)). Cholesky-QR needs only a Gram product, an r x r Cholesky factor and a
triangular solve, batched over any number of matrices, with no host synchronisation.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

# Diagonal shift of the Gram matrix, relative to its mean eigenvalue (plus a floor for an all-zero P): it keeps the
# Cholesky factor of a rank-deficient P finite in fp32; such columns come out scaled towards zero, not NaN.
RELATIVE_SHIFT = 1e-6
ABSOLUTE_SHIFT = 1e-30


def orthonormalize(p: Tensor) -> Tensor:
    """fp32 matrix (or batch [..., n, r], n >= r) with orthonormal columns whose span contains that of ``p``.

    Cholesky-QR: with PᵀP = LLᵀ, P·L⁻ᵀ has orthonormal columns spanning the same space as P. One pass loses
    orthogonality as cond(P)² grows, so passes repeat with a small diagonal shift (shifted CholeskyQR, Fukaya et al.
    2020). Like Gram-Schmidt it works column by column, so a column (nearly) in the span of the earlier ones comes
    out (nearly) zero; such columns are replaced by fixed, data-independent directions and orthonormalised again,
    which completes the basis as Householder QR does. Without that, a rank-deficient P (a warm-started Q after a
    low-rank gradient, zero rows, r above the gradient's rank) would lose those directions for good: every later
    power step would stay in the smaller span, and a full-rank factorisation would no longer be exact.
    The column signs may differ from Householder QR's; the projection P·Pᵀ, all that PowerSGD uses, does not.
    """
    a = _cholesky_qr(_cholesky_qr(p.float()))
    weak = a.norm(dim=-2, keepdim=True) < 0.5  # orthonormal columns have norm 1; degenerate ones ~0
    return _cholesky_qr(_cholesky_qr(torch.where(weak, _completion(*a.shape[-2:], a.device), a)))


@functools.lru_cache(maxsize=64)
def _completion(rows: int, cols: int, device: torch.device) -> Tensor:
    """Fixed fp32 columns for the basis completion: the same on every rank, without RNG; built once per shape."""
    i = torch.arange(rows, device=device, dtype=torch.float32)[:, None]
    j = torch.arange(1, cols + 1, device=device, dtype=torch.float32)[None, :]
    return torch.cos(i * j * 0.7548776662 + j * 0.5698402910)


@functools.lru_cache(maxsize=64)
def _identity(size: int, device: torch.device) -> Tensor:
    return torch.eye(size, device=device, dtype=torch.float32)


def _cholesky_qr(a: Tensor) -> Tensor:
    eye = _identity(a.shape[-1], a.device)
    gram = a.mT @ a
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    gram = gram + eye * (scale * RELATIVE_SHIFT + ABSOLUTE_SHIFT)
    factor, _ = torch.linalg.cholesky_ex(gram)  # no error check: that would synchronise with the host
    return torch.linalg.solve_triangular(factor.mT, a, upper=True, left=False)
