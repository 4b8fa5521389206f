"""Lanczos with full reorthogonalisation for the extreme eigenvalues of a symmetric PSD operator.

Used on the Gram operator J^T J (one jvp + one vjp per product), restricted to the orthogonal
complement of a known null space: every Krylov vector is projected against it, so the deflated
directions never enter the Krylov space and the smallest Ritz value targets the smallest *non-null*
eigenvalue. Full reorthogonalisation keeps the basis orthogonal to working precision (no ghost
copies), at O(k * n) memory, which is small here (n = 3 * H * d_h * D parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Operator = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LanczosResult:
    ritz: torch.Tensor  # all Ritz values, ascending
    residuals: torch.Tensor  # |beta_k * s_{k,i}|: bound on |lambda - theta_i| (symmetric operator)
    iterations: int
    converged: bool
    exhausted: bool  # the Krylov space became invariant (Ritz values are exact eigenvalues)


def lanczos_extremes(
    op: Operator,
    n: int,
    project: Operator,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    tol: float = 1e-3,
    floor: float = 0.0,
    max_iter: int = 1000,
    check_every: int = 10,
    seed: int = 0,
    largest_only: bool = False,
) -> LanczosResult:
    """Lanczos on ``project . op . project`` until the largest Ritz value and the smallest one above
    ``floor`` both have residual <= ``tol`` times their value (only the largest if ``largest_only``).

    ``floor`` lets undeflated (unknown) null directions be skipped: Ritz values <= floor are treated
    as null. The eigenvalue error is bounded by the residual, so tol=1e-3 gives eigenvalues within
    0.1% and singular values (their square roots) within 0.05%.
    """
    gen = torch.Generator().manual_seed(seed)
    v = project(torch.randn(n, generator=gen, dtype=dtype).to(device))
    v = v / v.norm()
    basis = [v]
    alphas: list[float] = []
    betas: list[float] = []
    result = None
    for k in range(max_iter):
        w = project(op(basis[-1]))
        alpha = float(w @ basis[-1])
        alphas.append(alpha)
        vs = torch.stack(basis)
        for _ in range(2):  # "twice is enough" (Kahan/Parlett) for full reorthogonalisation
            w = w - vs.T @ (vs @ w)
        w = project(w)
        beta = float(w.norm())
        last = k + 1 == max_iter
        exhausted = beta <= 1e-12 * max(abs(a) for a in alphas) or len(basis) >= n
        if exhausted or last or (k + 1) % check_every == 0:
            result = _ritz(alphas, betas, beta, tol, floor, k + 1, exhausted, largest_only)
            if result.converged or exhausted:
                return result
        betas.append(beta)
        basis.append(w / beta)
    assert result is not None
    return result


def _ritz(
    alphas: list[float],
    betas: list[float],
    beta: float,
    tol: float,
    floor: float,
    k: int,
    exhausted: bool,
    largest_only: bool = False,
) -> LanczosResult:
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        t = t + torch.diag(off, 1) + torch.diag(off, -1)
    theta, s = torch.linalg.eigh(t)
    residuals = (beta * s[-1, :]).abs()
    if exhausted:
        residuals = torch.zeros_like(residuals)
    above = (theta > floor).nonzero().flatten()
    converged = False
    if above.numel():
        lo, hi = int(above[0]), len(theta) - 1
        lo = hi if largest_only else lo
        converged = bool(residuals[hi] <= tol * theta[hi] and residuals[lo] <= tol * theta[lo])
    return LanczosResult(theta, residuals, k, converged or exhausted, exhausted)
