"""The matrices the init schemes draw: Haar semi-orthogonal matrices and low-rank factors.

Every draw is made in float64 and cast to the weight's dtype, so orthonormality and low-rank
factorisations hold to ~1e-7 in float32 weights.
"""

from __future__ import annotations

import torch
from torch import nn


def haar_semi_orthogonal(rows: int, cols: int, device: torch.device | None = None) -> torch.Tensor:
    """A Haar-random float64 (rows, cols) matrix: orthonormal rows if rows <= cols, else columns."""
    return nn.init.orthogonal_(torch.empty(rows, cols, dtype=torch.float64, device=device))


def low_rank_factors(target: torch.Tensor, inner: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``left`` (n, inner) and ``right`` (inner, n) whose product is the best rank-``r`` approximation
    of the square ``target``, r = min(inner, n), split symmetrically as U sqrt(S) and sqrt(S) V^T.

    When ``inner > n`` the rank-n factors are spread over all ``inner`` coordinates with a random
    isometry P (inner x n, P^T P = I): left = U sqrt(S) P^T, right = P sqrt(S) V^T. The product is
    unchanged and no inner coordinate starts (and, with a zero partner, stays) at exactly zero.
    """
    u, s, vh = torch.linalg.svd(target.to(torch.float64))
    r = min(inner, target.shape[0])
    root = s[:r].sqrt()
    left, right = u[:, :r] * root, root[:, None] * vh[:r]
    if inner > r:
        p = haar_semi_orthogonal(inner, r, device=target.device)
        left, right = left @ p.T, p @ right
    return left, right
