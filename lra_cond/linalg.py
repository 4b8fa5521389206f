"""Small float64 linear-algebra helpers with one tolerance policy (shared by the attention
families' symmetry generators and the condition-number probe)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

# Relative singular-value tolerance that separates exact null directions (float64 round-off,
# ~1e-15 of the largest) from genuine small ones.
RANK_RTOL = 1e-10


def svdvals(m: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.svdvals``, on the wide orientation of ``m`` (same values, descending).

    Torch's CPU LAPACK path is much slower on a tall matrix than on its transpose
    (docs/benchmarks.md, "Speed paths in the probe").
    """
    return torch.linalg.svdvals(m.mT if m.shape[-2] > m.shape[-1] else m)


# A wide matrix whose triangular factor's estimated kappa is at most this has full row rank at any
# rtol down to ~1e-8 (the estimate is a lower bound, measured within 10x; the probe's rtol is 1e-10)
FULL_ROW_RANK_KAPPA = 1e6


def null_vectors(m: torch.Tensor, rtol: float = RANK_RTOL) -> torch.Tensor:
    """Orthonormal basis (cols x z) of {w : m w = 0}, at relative tolerance ``rtol`` on the singular
    values, exact to working precision (these directions are deflated): for a wide m of certified
    full row rank, the complement of its row space by a complete Householder QR of m^T (fewer
    flops than the SVD), else a full SVD."""
    rows, cols = m.shape
    if rows == 0:
        return torch.eye(cols, dtype=m.dtype, device=m.device)
    if rows < cols and rtol * FULL_ROW_RANK_KAPPA <= 1e-2:
        q, r = torch.linalg.qr(m.T, mode="complete")
        if triangular_condition(r[:rows]) <= FULL_ROW_RANK_KAPPA:
            return q[:, rows:]
    _, s, vh = torch.linalg.svd(m, full_matrices=True)
    s_full = torch.zeros(cols, dtype=m.dtype, device=m.device)
    s_full[: s.numel()] = s
    top = float(s.max()) if s.numel() else 0.0
    keep = s_full <= rtol * top if top > 0 else torch.ones(cols, dtype=torch.bool, device=m.device)
    return vh[keep].T


def normal_draws(
    gen: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Standard normal draws from a seeded CPU generator, moved to ``device``: the same numbers on
    every device, whatever torch's default device (a CUDA probe starts where the CPU one does)."""
    return torch.randn(*shape, generator=gen, dtype=dtype, device="cpu").to(device)


def gram(
    a: torch.Tensor, panels: int = 4, add_to: torch.Tensor | None = None, alpha: float = 1.0
) -> torch.Tensor:
    """a^T a, computing each off-diagonal panel once (~60% of a full GEMM's flops; a diagonal panel
    of 1024 columns or more the same way in two: ~56%); panels at least 384 columns wide
    (narrower ones did not pay: docs/benchmarks.md, "Speed paths in the probe"); with ``add_to``,
    ``add_to + alpha a^T a`` in place (a symmetric ``add_to``)."""
    n = a.shape[1]
    panels = max(1, min(panels, n // 384))
    if n < 512:
        return a.T @ a if add_to is None else add_to.addmm_(a.T, a, alpha=alpha)
    edges = [round(i * n / panels) for i in range(panels + 1)]
    out = torch.empty(n, n, dtype=a.dtype, device=a.device) if add_to is None else add_to
    for i in range(panels):
        ci = slice(edges[i], edges[i + 1])
        for j in range(i, panels):
            cj = slice(edges[j], edges[j + 1])
            if j == i and edges[i + 1] - edges[i] >= 1024:  # in its own panels
                if add_to is None:
                    out[ci, ci] = gram(a[:, ci], 2)
                else:
                    gram(a[:, ci], 2, out[ci, ci], alpha)
                continue
            if add_to is None:
                out[ci, cj] = a[:, ci].T @ a[:, cj]
            else:
                out[ci, cj].addmm_(a[:, ci].T, a[:, cj], alpha=alpha)
            if j != i:
                out[cj, ci] = out[ci, cj].T
    return out


def shifted_cholesky(g: torch.Tensor, rel: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, info) of g + rel * mean(diag g) * I, upper (``torch.linalg.cholesky_ex``): a Cholesky
    factor that a shift of ``rel`` keeps defined where g is only semi-definite or its rounding made
    it indefinite."""
    eye = torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
    return torch.linalg.cholesky_ex(g + rel * float(g.diagonal().mean()) * eye, upper=True)


def kron_right(
    a: torch.Tensor, o: torch.Tensor | None, m: torch.Tensor, d: int, rows: int = 64
) -> torch.Tensor:
    """A (O (x) M) for A (n, d p) in the (b, c) column layout, O (d, d) (None: the identity) and
    M (p, p'), as two GEMMs; with O, over chunks of ``rows`` rows, each product's result still in
    cache for the next."""
    n, p2 = a.shape[0], m.shape[1]
    if o is None:
        return (a.reshape(n, d, m.shape[0]) @ m).reshape(n, d * p2)
    out = a.new_empty(n, d * p2)
    for start in range(0, n, rows):
        t = a[start : start + rows].reshape(-1, d, m.shape[0]) @ m  # (rows, d, p')
        torch.matmul(o.T, t, out=out[start : start + rows].view(-1, d, p2))  # batched over the rows
    return out


def _independent(m: torch.Tensor, rtol: float) -> torch.Tensor | None:
    """Upper Cholesky factor of m^T m when m's (unit-scaled) columns are independent at ``rtol``
    (every pivot, a column's distance to the span of those before it, above rtol), else None."""
    chol, info = torch.linalg.cholesky_ex(gram(m), upper=True)
    if int(info) or bool((chol.diagonal() <= rtol).any()):
        return None
    return chol


def orthonormal_columns(
    m: torch.Tensor, rtol: float = 1e-6, norms: torch.Tensor | None = None
) -> torch.Tensor:
    """Orthonormal basis of span(m), rank-revealing (duplicated directions count once).

    Columns are scaled to unit ``norms`` (default: their own norms; pass the norms before a
    projection to judge residuals against the original size). Candidate directions are either
    independent (residuals far above rtol) or exactly dependent (~1e-8 through the Gram), so
    rtol = 1e-6 separates them. Independent columns (the usual case) take a Cholesky-QR; otherwise
    the Gram is diagonalised, which finds the rank and a rotation that makes the kept columns
    orthogonal. A second Cholesky-QR pass makes the result orthonormal to working precision (a
    Householder QR or an SVD of the tall m costs several times more on CPU).
    """
    if m.shape[1] == 0:
        return m
    norms = m.norm(dim=0) if norms is None else norms
    m = m / norms.clamp_min(torch.finfo(m.dtype).tiny)
    chol = _independent(m, rtol)
    if chol is not None:
        q = torch.linalg.solve_triangular(chol, m, upper=True, left=False)
    else:
        lam, vecs = torch.linalg.eigh(gram(m))
        keep = lam > rtol**2
        q = (m @ vecs[:, keep]) / lam[keep].sqrt()
    chol = torch.linalg.cholesky(gram(q), upper=True)
    return torch.linalg.solve_triangular(chol, q, upper=True, left=False)


def orthonormal_basis(m: torch.Tensor, max_condition: float = 1e3) -> torch.Tensor:
    """An orthonormal basis of span(m) for m of full column rank, orthonormal to ~eps kappa(m)^2:
    one Cholesky-QR pass (m R^-1, R^T R = m^T m) when R's estimated condition number is at most
    ``max_condition``, else Householder QR (about twice the flops, its Q formed). The default keeps
    the columns orthonormal to ~1e-10; a
    regulariser's basis, which only needs singular values near 1, can take more."""
    if not m.shape[1]:
        return m
    chol, info = torch.linalg.cholesky_ex(gram(m), upper=True)
    if int(info) == 0 and triangular_condition(chol) <= max_condition:
        return torch.linalg.solve_triangular(chol, m, upper=True, left=False)
    return torch.linalg.qr(m).Q


def triangular_condition(r: torch.Tensor, steps: int = 8, block: int = 4, seed: int = 0) -> float:
    """An estimate of kappa(R) for an upper triangular R, from below: block power iteration on
    R^T R and on (R^T R)^{-1} (triangular solves: n^2 a step where the SVD costs n^3), and the
    diagonal's ratio (max |r_ii| <= sigma_max, min |r_ii| >= sigma_min); inf when R is singular to
    working precision."""
    diag = r.diagonal().abs()
    if not bool(torch.isfinite(r).all()) or float(diag.min()) == 0.0:
        return math.inf
    gen = torch.Generator().manual_seed(seed)
    hi = normal_draws(gen, r.shape[0], block, dtype=r.dtype, device=r.device)
    lo = hi
    for _ in range(steps):
        hi = r.T @ (r @ hi)
        hi = hi / hi.norm(dim=0)
        lo = torch.linalg.solve_triangular(r, torch.linalg.solve_triangular(r.T, lo, upper=False), upper=True)
        lo = lo / lo.norm(dim=0)
    smax = float((r @ hi).norm(dim=0).max())
    smin = float((r @ lo).norm(dim=0).min())  # NaN after an overflow: then not > 0
    return max(smax / smin, float(diag.max() / diag.min())) if smin > 0 else math.inf


def span_union(
    mats: list[torch.Tensor], rtol: float = 1e-6, last_independent: bool = False
) -> tuple[torch.Tensor, list[int]]:
    """A basis of the span of several candidate sets, and how many directions each adds to those
    before it (sets in the given order). Every set but the last is made orthonormal; the last (pass
    the largest) is only projected off the others and kept as it is when independent, which saves
    its orthonormalisation: callers that need orthonormal columns use ``orthonormal_columns``.
    ``last_independent``: the caller has proven that test's outcome (every pivot above rtol)."""
    basis: torch.Tensor | None = None
    added = []
    for i, m in enumerate(mats):
        norms = m.norm(dim=0)
        last = i == len(mats) - 1
        if basis is not None and basis.shape[1]:
            m = m - basis @ (basis.T @ m)
            if not last:  # twice is enough (to orthonormalise; the last set is only tested for
                m = m - basis @ (basis.T @ m)  # independence, which a 1e-16 leftover cannot change)
        if last and m.shape[1]:
            scaled = m / norms.clamp_min(torch.finfo(m.dtype).tiny)
            independent = last_independent or _independent(scaled, rtol) is not None
            new = scaled if independent else orthonormal_columns(m, rtol, norms)
        else:
            new = orthonormal_columns(m, rtol, norms) if m.shape[1] else m
        added.append(new.shape[1])
        basis = new if basis is None else torch.cat([basis, new], 1)
    if basis is None:
        raise ValueError("span_union needs at least one candidate set")
    return basis, added


class Cut(NamedTuple):
    """A spectrum cut at rtol * sigma_max (``spectrum_cut``)."""

    sigma_max: float
    sigma_min: float  # the smallest value above the cut
    n_null: int  # how many values are at or below it
    largest_excluded: float  # the largest of those (0 if none)


def spectrum_cut(s: torch.Tensor, rtol: float) -> Cut:
    """The null cut the dense reference uses, of singular values ``s`` in any order."""
    s = torch.sort(s, descending=True).values
    n_kept = int((s > rtol * s[0]).sum())
    excluded = float(s[n_kept]) if n_kept < s.numel() else 0.0
    return Cut(float(s[0]), float(s[n_kept - 1]), int(s.numel() - n_kept), excluded)


def matrix_condition(m: torch.Tensor) -> float:
    """sigma_max / sigma_min over the min(rows, cols) singular values (inf if rank-deficient)."""
    s = svdvals(m.detach().to(torch.float64))
    return float(s[0] / s[-1]) if s[-1] > 0 else float("inf")


class Operator:
    """A linear operator known by its products, read like a matrix: ``A @ v``, ``A.T @ y``,
    ``a @ A`` and, where A is invertible, ``A.solve(v)`` (A^{-1} v), ``A.T.solve(y)`` and
    ``A.solve(a, left=False)`` (a A^{-1}), as ``torch.linalg.solve``. A subclass defines
    ``__matmul__`` and ``matmul_t`` (A^T y), as scipy's ``LinearOperator`` defines ``matvec`` and
    ``rmatvec``; ``__rmatmul__``, ``solve`` and ``solve_t`` where it has them."""

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def matmul_t(self, y: torch.Tensor) -> torch.Tensor:  # A^T y
        raise NotImplementedError(f"{type(self).__name__} has no transposed product")

    def solve(self, v: torch.Tensor, left: bool = True) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no inverse")

    def solve_t(self, y: torch.Tensor) -> torch.Tensor:  # A^{-T} y
        raise NotImplementedError(f"{type(self).__name__} has no inverse")

    @property
    def T(self) -> Operator:  # noqa: N802 (reads like a tensor's)
        return Transposed(self)


class Transposed(Operator):
    """A^T of an ``Operator`` A: its products are A's transposed ones."""

    def __init__(self, a: Operator) -> None:
        self.a = a

    def __matmul__(self, y: torch.Tensor) -> torch.Tensor:
        return self.a.matmul_t(y)

    def matmul_t(self, v: torch.Tensor) -> torch.Tensor:
        return self.a @ v

    def solve(self, y: torch.Tensor, left: bool = True) -> torch.Tensor:
        if not left:
            raise NotImplementedError("a A^{-T}: solve with A and transpose instead")
        return self.a.solve_t(y)

    def solve_t(self, v: torch.Tensor) -> torch.Tensor:
        return self.a.solve(v)

    @property
    def T(self) -> Operator:  # noqa: N802
        return self.a


class ProductOperator(Operator):
    """An ``Operator`` given by its two products as functions: ``matmul`` (A v) and ``matmul_t``
    (A^T y)."""

    def __init__(
        self,
        matmul: Callable[[torch.Tensor], torch.Tensor],
        matmul_t: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self._matmul, self._matmul_t = matmul, matmul_t

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        return self._matmul(v)

    def matmul_t(self, y: torch.Tensor) -> torch.Tensor:
        return self._matmul_t(y)
