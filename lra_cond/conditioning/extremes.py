"""Steps 4 and 5 of the probe: a scope's extreme non-null singular values from a triangular factor of
its preconditioned Gram, and their check against the exact J (``solve``).

* **The factor** R with R^T R = G' (Cholesky; shifted by G's rounding bound where that rounding
  made G' indefinite; or Householder QR of the preconditioned rows, which never squares the
  condition number).
* **Extremes by block Lanczos** (``top_eigenpair``; Golub & Van Loan, *Matrix Computations*, 4th
  ed., sec. 10.3) on R^T R for sigma_max^2 and on (R^T R)^{-1}, through triangular solves, for
  1/sigma_min^2, so that sigma_min keeps its own relative accuracy. Full reorthogonalisation; every
  Krylov block is projected off a known null space; the top Ritz pair is converged when its
  residual bound r^2 / gap is below the tolerance (Parlett, *The Symmetric Eigenvalue Problem*,
  ch. 11). A caller that knows a near-degenerate top cluster (the value block's s_Y[0]^2, d-fold)
  passes its directions as ``start``: one wide step resolves the cluster.
* **The check with the exact J** (``_check``): the Rayleigh quotient ||J u|| / ||u|| of the
  sigma_min vector must match sigma_min to the check's own rounding level (~eps sqrt(n) kappa).
  If the Gram lost sigma_min, the check is too coarse to tell, or the factor was shifted, sigma_min
  is taken from the exact J by preconditioned Rayleigh-Ritz with the factor's inverse Gram as
  preconditioner (``_refined_sigma_min``: every iterate an upper bound; a block of vectors after a
  shift, which lumps the values below it together). Only if that does not settle is the
  factor recomputed, from the exact rows' Gram and then by Householder QR; a null value the
  verified groups miss sends the scope to svdvals, which counts it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lra_cond.conditioning.coordinates import (
    DeflatedRows,
    Preconditioner,
    complement,
    materialised,
)
from lra_cond.linalg import (
    Operator,
    ProductOperator,
    gram,
    normal_draws,
    orthonormal_basis,
    shifted_cholesky,
    spectrum_cut,
    svdvals,
)

Product = Callable[[torch.Tensor], torch.Tensor]  # (n, p) -> (n, p)


def top_eigenpair(
    op: Product,
    n: int,
    project: Product,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    block: int = 4,
    tol: float = 1e-10,
    max_applications: int = 100,
    seed: int = 0,
    start: torch.Tensor | None = None,
) -> tuple[float, torch.Tensor, int, bool]:
    """(value, vector, applications, converged): the largest eigenvalue of ``project . op . project``,
    its unit eigenvector, the operator applications it took (each to one block) and whether the
    residual bound met ``tol``. ``start`` (n, s): directions the first block holds next to ``block``
    random ones."""
    gen = torch.Generator().manual_seed(seed)
    block = max(1, min(block, n))
    first = normal_draws(gen, n, block, dtype=dtype, device=device)
    if start is not None:
        first = torch.cat([start.to(dtype), first], 1)[:, :n]
    first = torch.linalg.qr(project(first)).Q
    cap = min(n, first.shape[1] + block * max_applications)
    q = torch.empty(n, cap, dtype=dtype, device=device)  # the basis, filled block by block
    aq = torch.empty_like(q)  # its images
    # the Rayleigh-Ritz matrix Q^T A Q, grown by the newest block's rows and columns only (forming it
    # whole each time cost ~n (block k)^2 per step: ~2.4 GFLOP over 34 steps at n = 5088)
    h = torch.zeros(cap, cap, dtype=dtype, device=device)
    q[:, : first.shape[1]] = first
    lo, hi = 0, first.shape[1]  # the newest block: columns lo:hi
    for k in range(max_applications):
        aq[:, lo:hi] = project(op(q[:, lo:hi]))
        qk, aqk = q[:, :hi], aq[:, :hi]
        h[:hi, lo:hi] = qk.T @ aq[:, lo:hi]
        h[lo:hi, :lo] = q[:, lo:hi].T @ aq[:, :lo]
        hk = h[:hi, :hi]
        theta, s = torch.linalg.eigh((hk + hk.T) / 2)
        value, ys = float(theta[-1]), s[:, -block:]
        vectors = qk @ ys
        residuals = aqk @ ys - vectors * theta[-block:]
        residual = float(residuals[:, -1].norm())
        gap = value - float(theta[-2]) if theta.numel() > 1 else 0.0
        bound = residual if residual >= gap else min(residual, residual**2 / gap)
        vector = vectors[:, -1] / vectors[:, -1].norm()
        if bound <= tol * abs(value) or hi >= n:
            return value, vector, k + 1, True
        w = residuals
        for _ in range(2):  # "twice is enough" (Kahan/Parlett) for full reorthogonalisation
            w = w - qk @ (qk.T @ w)
        qw, rw = torch.linalg.qr(project(w))
        keep = rw.diagonal().abs() > 1e-12 * max(abs(value), 1e-300)
        if not bool(keep.any()):  # the space is invariant: the Ritz pair is exact
            return value, vector, k + 1, True
        new = qw[:, keep][:, : cap - hi]
        if not new.shape[1]:
            break
        lo, hi = hi, hi + new.shape[1]
        q[:, lo:hi] = new
    return value, vector, k + 1, False


EPS = torch.finfo(torch.float64).eps
CHECK_RTOL = 1e-7  # Rayleigh-quotient check of sigma_min, on top of the check's own rounding level


@dataclass
class SpectrumSummary:
    """Extreme non-null singular values of J, of one block of it, or of one head's part of either.
    ``null_gain`` bounds the largest singular value the cut excluded: J's gain on the deflated
    directions (``nullspace.group_gain``) or the largest exact value at or below rtol * sigma_max
    (0: none known)."""

    sigma_max: float
    sigma_min: float
    n_null: int  # singular values excluded as null: the verified ones plus any <= rtol * sigma_max
    notes: list[str] = field(default_factory=list)
    null_gain: float = 0.0
    n_null_expected: int = 0  # the verified null space's dimension (a scope over every head)
    n_params: int = 0

    @property
    def kappa(self) -> float:
        return self.sigma_max / self.sigma_min


@dataclass
class _Factor(Operator):
    """R with R^T R = J^T J on one scope's deflated coordinates: R = [[diag(rv), C], [0, R' T^{-1}]]
    (the value part optional), R'^T R' = T^T A^T A T (R' formed). As an operator it is R (``@``,
    ``.T``, ``solve``); ``exact`` is J through its exact rows.
    ``rows`` are the exact rows, for checks. With ``null`` (regularised), R^T R = J^T J + N Z N^T:
    every vector is projected off N."""

    rv: torch.Tensor | None  # (n_V,) diagonal of the value part (None: no value part)
    c: torch.Tensor | None  # (n_V, n_A) coupling rows of the rest in the value rows
    r: torch.Tensor  # (n_A, n_A) R', upper triangular
    t: Preconditioner
    rows: list[torch.Tensor | DeflatedRows]  # exact row blocks whose Gram is the rest's Gram
    null: torch.Tensor | None = None  # orthonormal null basis still in the coordinates (regularised)
    # [C; rows] as one operator, when both come from the same factors (one product instead of two)
    joint: DeflatedRows | None = None
    gram: torch.Tensor | None = None  # the Gram R' factors (R'^T R' = it to ~eps), when formed
    # ``c`` holds C T, the coupling on the preconditioned coordinates (C = c T^-1 applied through
    # T: no pass over the whole coupling to form C)
    c_preconditioned: bool = False

    def _c_t(self, y: torch.Tensor) -> torch.Tensor:  # C^T y
        out = self.c.T @ y
        return self.t.T.solve(out) if self.c_preconditioned else out

    def _c(self, u: torch.Tensor) -> torch.Tensor:  # C u
        return self.c @ (self.t.solve(u) if self.c_preconditioned else u)

    def coupling(self) -> torch.Tensor | None:
        """C formed."""
        return self.t.solve(self.c, left=False) if self.c_preconditioned else self.c

    def project(self, u: torch.Tensor) -> torch.Tensor:
        """u without its component along the regularised null directions (identity if none)."""
        return u if self.null is None else u - self.null @ (self.null.T @ u)

    def value_cluster(self) -> torch.Tensor | None:
        """The value coordinates of Y's largest singular value (d of them, s_Y (x) I_d), as unit
        vectors: with a value part, J's top eigenvalues start as that d-fold one, split by the
        coupling into a cluster (measured within 0.1-5% on nystrom heads), which ``top_eigenpair``
        resolves in one wide step from them."""
        if self.rv is None:  # (the cluster lies in V: clear of any regularised null direction)
            return None
        size = int((self.rv == self.rv[0]).sum())  # repeat_interleave: exact copies
        return torch.eye(self.n, size, dtype=self.rv.dtype, device=self.rv.device)

    @property
    def n_v(self) -> int:
        return 0 if self.rv is None else self.rv.numel()

    @property
    def n(self) -> int:
        return self.n_v + self.r.shape[0]

    def gram_apply(self, u: torch.Tensor) -> torch.Tensor:
        """J^T J u for sigma_max: through the exact J when the whole head's rows are one operator
        through a family's factors (each product then reads the factors, far smaller than R, its
        transpose and the value coupling: the products are memory-bound), else as R^T R u (a block
        alone: R is the smaller), through the factored Gram when there is one."""
        if self.joint is not None:
            return self.exact.T @ (self.exact @ u)
        if self.gram is None:
            return self.T @ (self @ u)
        # R^T R u with R'^T R' = G': one pass over G' where R' and R'^T take two
        ua = u[self.n_v :]
        low = self.t.T.solve(self.gram @ self.t.solve(ua))
        if self.rv is None:
            return low
        top = self.rv[:, None] * u[: self.n_v] + self._c(ua)
        return torch.cat([self.rv[:, None] * top, self._c_t(top) + low])

    def __matmul__(self, u: torch.Tensor) -> torch.Tensor:  # R u
        ua = u[self.n_v :]
        low = self.r @ self.t.solve(ua)
        if self.rv is None:
            return low
        return torch.cat([self.rv[:, None] * u[: self.n_v] + self._c(ua), low])

    def matmul_t(self, w: torch.Tensor) -> torch.Tensor:  # R^T w
        if self.rv is None:
            return self.t.T.solve(self.r.T @ w)
        wv, wa = w[: self.n_v], w[self.n_v :]
        return torch.cat([self.rv[:, None] * wv, self._c_t(wv) + self.t.T.solve(self.r.T @ wa)])

    def solve(self, w: torch.Tensor, left: bool = True) -> torch.Tensor:  # R^{-1} w
        if not left:
            raise NotImplementedError("a R^{-1} is not needed")
        za = self.t @ torch.linalg.solve_triangular(self.r, w[self.n_v :], upper=True)
        if self.rv is None:
            return za
        return torch.cat([(w[: self.n_v] - self._c(za)) / self.rv[:, None], za])

    def solve_t(self, u: torch.Tensor) -> torch.Tensor:  # R^{-T} u
        if self.rv is None:
            return torch.linalg.solve_triangular(self.r.T, self.t.T @ u, upper=False)
        uv, ua = u[: self.n_v], u[self.n_v :]
        wv = uv / self.rv[:, None]
        wa = torch.linalg.solve_triangular(self.r.T, self.t.T @ (ua - self._c_t(wv)), upper=False)
        return torch.cat([wv, wa])

    def inverse_gram(self, u: torch.Tensor) -> torch.Tensor:  # (R^T R)^{-1} u = R^{-1} R^{-T} u
        return self.solve(self.solve_t(u))

    @property
    def exact(self) -> ProductOperator:
        """J with the exact (unfactored) rows: [value rows; every row block] (m, n)."""
        return ProductOperator(self._exact_apply, self._exact_apply_t)

    def _exact_apply(self, u: torch.Tensor) -> torch.Tensor:
        """J u with the exact (unfactored) rows: [value rows; every row block], (m, k)."""
        ua = u[self.n_v :]
        if self.joint is not None:
            out = self.joint @ ua
            out[: self.n_v] += self.rv[:, None] * u[: self.n_v]
            return out
        low = [rows @ ua for rows in self.rows]
        if self.rv is not None:
            low.insert(0, self.rv[:, None] * u[: self.n_v] + self._c(ua))
        return torch.cat(low)

    def _exact_apply_t(self, y: torch.Tensor) -> torch.Tensor:
        if self.joint is not None:
            return torch.cat([self.rv[:, None] * y[: self.n_v], self.joint.T @ y])
        start, out = self.n_v, None
        for rows in self.rows:
            part = rows.T @ y[start : start + rows.shape[0]]
            out = part if out is None else out + part
            start += rows.shape[0]
        if self.rv is None:
            return out
        yv = y[: self.n_v]
        return torch.cat([self.rv[:, None] * yv, self._c_t(yv) + out])

    def dense(self) -> torch.Tensor:
        """The exact matrix whose singular values these are (for the svdvals fallback)."""
        a, c = torch.cat([materialised(r) for r in self.rows]), self.coupling()
        if self.null is not None:  # the complement of the regularised null directions (none in V)
            comp = complement(*torch.geqrf(self.null[self.n_v :]))
            a, c = a @ comp, None if c is None else c @ comp
        if self.rv is None:
            return a
        zeros = a.new_zeros(a.shape[0], self.n_v)
        return torch.cat([torch.cat([torch.diag(self.rv), c], 1), torch.cat([zeros, a], 1)])


def _triangular(
    rows: list[torch.Tensor],
    t: Preconditioner,
    use_qr: bool,
    g: torch.Tensor | None = None,
    reg: torch.Tensor | None = None,
) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """R' with R'^T R' = T^T A^T A T + beta Q Q^T (A the stacked rows; Q = ``reg`` an orthonormal
    basis of T^T N, so Q Q^T projects onto it; beta the mean diagonal) and how it was formed:
    Cholesky of the preconditioned Gram (``g`` when the caller formed it from factors), "cholesky";
    of that Gram shifted by n eps of its mean diagonal where it is not numerically definite,
    "shifted"; else Householder QR of the preconditioned rows stacked on sqrt(beta) Q^T, "qr".
    Also returns the Gram, unshifted (None after QR). ``g`` is regularised in place (no copy
    of an n x n Gram): callers give a Gram of their own, never a cached one. On vectors orthogonal
    to N (all that Lanczos applies it to) the regularised Gram acts as the plain one:
    Q^T T^-1 u = 0 exactly when N^T u = 0."""
    pre = None
    if not use_qr:
        if g is None:
            pre = [materialised(r) @ t for r in rows]
            g = gram(pre[0])
            for p in pre[1:]:
                g = g + gram(p)
        if reg is not None and reg.shape[1]:
            g = gram(reg.T, add_to=g, alpha=float(g.diagonal().mean()))
        chol, info = torch.linalg.cholesky_ex(g, upper=True)
        if int(info) == 0:
            return chol, "cholesky", g
        # its rounding made it indefinite: shifted by that rounding's bound (n eps of its diagonal),
        # it stays a preconditioner for all but the values below the shift (``_refined_sigma_min``)
        chol, info = shifted_cholesky(g, g.shape[0] * EPS)
        if int(info) == 0:
            return chol, "shifted", g
        del chol  # the failed factor (the Gram's size) is not kept through the QR below
    if pre is None:
        pre = [materialised(r) @ t for r in rows]
    if reg is not None:
        q = reg
        beta = sum(float(p.square().sum()) for p in pre) / q.shape[0]
        pre = [*pre, beta**0.5 * q.T]
    r = torch.linalg.qr(torch.cat(pre) if len(pre) > 1 else pre[0], mode="r").R
    return r * torch.where(r.diagonal() < 0, -1.0, 1.0)[:, None], "qr", None


def _factor_extremes(factor: _Factor) -> tuple[float, float, torch.Tensor, torch.Tensor, bool]:
    """(sigma_max, sigma_min, the sigma_min vector, the sigma_max vector, converged) of the factor."""
    dtype, device = factor.r.dtype, factor.r.device
    top, top_vector, _, top_converged = top_eigenpair(
        factor.gram_apply, factor.n, factor.project, dtype, device, start=factor.value_cluster()
    )
    inv, inv_vector, _, inv_converged = top_eigenpair(
        factor.inverse_gram, factor.n, factor.project, dtype, device
    )
    sigma_max = math.sqrt(max(top, 0.0))
    sigma_min = 1.0 / math.sqrt(inv) if inv > 0 and math.isfinite(inv) else 0.0
    return sigma_max, sigma_min, inv_vector, top_vector, top_converged and inv_converged


def _check(factor: _Factor, sigma_max: float, sigma_min: float, vector: torch.Tensor) -> tuple[float, float]:
    """(error, noise): the factor's inverse Gram's relative error in sigma along the sigma_min
    direction, as measured on the exact J, and the check's own rounding level. The factor lost
    sigma_min when error > noise + CHECK_RTOL; the check cannot vouch for it when noise > CHECK_RTOL.

    With w = (R^T R)^{-1} u, ||J w||^2 = u . w holds exactly when R^T R = J^T J, for any u; with
    R^T R = J^T J + E it is off by w^T E w / u . w, the relative error of the Gram along w (u the
    sigma_min vector makes w the sigma_min direction). The exact rows give ||J w||, to a relative
    ~eps sqrt(n) kappa: above kappa ~1e6 that bound exceeds CHECK_RTOL (measured: a linear-
    attention head at kappa 2.4e9 whose Cholesky sigma_min was 1.8e-4 off passed the check)."""
    u = vector[:, None]
    w = factor.inverse_gram(u)
    ratio = float((factor.exact @ w).norm()) ** 2 / float((u * w).sum())
    noise = 8 * EPS * math.sqrt(vector.numel()) * sigma_max / max(sigma_min, 1e-300)
    return abs(ratio - 1.0) / 2, noise


REFINE_RTOL = 1e-10  # relative change of sigma_min between Rayleigh-Ritz steps that ends the refinement
# The refined sigma_min must lie this close to the factor's (else the next factor is formed),
# widened by twice the factor's error along its sigma_min vector as the check measured it (capped
# at REFINE_AGREE_MAX): a Gram's rounding is absolute, so its relative error is largest on the
# smallest values, and the factor's sigma_min is off by about what the check measures there.
# Measured: a normalized head whose Schur-complement Gram was off by 1.76e-3 along that vector had
# its sigma_min refined 1.80e-3 below the factor's, equal to Householder QR's to 1e-10
REFINE_AGREE = 1e-3
REFINE_AGREE_MAX = 1e-2
# An iterate that rises (exact Rayleigh-Ritz never does) by at most this much relative means the
# rounding floor: at kappa ~1e10 the iterates settle within ~1e-8 and then wander by ~5e-9
# (measured; Householder QR agrees to 5e-9), never by 1e-10
REFINE_FLOOR = 1e-7


# Rayleigh-Ritz steps before the refinement gives up (and the next factor is formed, at far more
# than a step's cost): a factor off by ~4e-3 along its sigma_min vector (measured: a normalized head
# at kappa 2.7e8, whose Schur-complement Gram lost that much) settles in 9-12 steps
REFINE_STEPS = 16
# A shifted factor (``_triangular``) lumps every value below its shift together (six of a linear
# head's at kappa 3.9e12): one vector stalls on their plateaus, a block this wide settles in 3-4
# steps (measured: docs/benchmarks.md)
REFINE_BLOCK = 8


def _refined_sigma_min(
    factor: _Factor,
    vector: torch.Tensor,
    estimate: float,
    steps: int = REFINE_STEPS,
    error: float = 0.0,
    shifted: bool = False,
    sigma_max: float = 0.0,
) -> float | None:
    """sigma_min of the exact J, the Cholesky factor only close (~1 GFLOP at the reference shape,
    against ~140 for a Householder QR of the rows): preconditioned Rayleigh-Ritz (LOBPCG, Knyazev
    2001) on J^T J with the factor's inverse Gram as the preconditioner, starting from the factor's
    sigma_min vector; each step takes the smallest singular values of J V over
    V = span(W, P R, previous W) (R = J^T J W - W diag(rho)). Every iterate is an upper bound on
    sigma_min (Rayleigh-Ritz on a subspace), exact to eps * sigma_max through the SVD of J V,
    decreasing; it stops when it stagnates (REFINE_RTOL) or rises by a rounding step (REFINE_FLOOR,
    or eps ``sigma_max`` / sigma_min where that is larger). None (take the next factor) when it does
    neither or ends far from the factor's estimate (``error``: the factor's measured error along
    ``vector``, see REFINE_AGREE): the factor then was not a good preconditioner. A ``shifted``
    factor's estimate is high by its shift, so the result need only lie below it; the block is
    REFINE_BLOCK wide there, its other columns from inverse subspace iteration on the factor."""
    agree = min(REFINE_AGREE + 2 * error, REFINE_AGREE_MAX)
    w = vector[:, None] / vector.norm()
    if shifted:
        gen = torch.Generator().manual_seed(0)
        w = torch.cat([w, normal_draws(gen, factor.n, REFINE_BLOCK - 1, dtype=w.dtype, device=w.device)], 1)
        for _ in range(3):
            w = torch.linalg.qr(factor.project(factor.inverse_gram(w))).Q
    previous, sigma, k = None, None, w.shape[1]
    for _ in range(steps):
        jw = factor.exact @ w
        rho = jw.square().sum(0)
        p = factor.project(factor.inverse_gram(factor.exact.T @ jw - rho * w))
        span = torch.cat([w, p] + ([previous] if previous is not None else []), 1)
        v = torch.linalg.qr(span).Q
        _, s, vh = torch.linalg.svd(factor.exact @ v, full_matrices=False)
        new_w, new_sigma = v @ vh[-k:].T, float(s[-1])
        floor = max(REFINE_FLOOR, EPS * sigma_max / new_sigma) if new_sigma > 0 else REFINE_FLOOR
        settled = sigma is not None and (
            abs(sigma - new_sigma) <= REFINE_RTOL * new_sigma
            or sigma <= new_sigma <= (1 + floor) * sigma  # risen: the rounding floor
        )
        if settled:
            new_sigma = min(sigma, new_sigma)  # the smaller upper bound
            if shifted:
                return new_sigma if new_sigma <= (1 + agree) * estimate else None
            return new_sigma if abs(new_sigma - estimate) <= agree * new_sigma else None
        previous, w, sigma = w, new_w, new_sigma
    return None


def solve(
    rows: list[torch.Tensor],
    t: Preconditioner,
    value: tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, bool] | None,
    verified: int,
    rtol: float,
    method: str,
    g: torch.Tensor | None = None,
    null: torch.Tensor | None = None,
    refine: bool = False,
    joint: DeflatedRows | None = None,
) -> SpectrumSummary:
    """``value``: (rv, C) of a value part, or (rv, C T, True) (``_Factor.c_preconditioned``).
    ``g``: the preconditioned Gram, when the caller formed it from factors. ``null``: an
    orthonormal basis of null directions left in the coordinates (regularised in the factor,
    projected out of every Lanczos and Rayleigh-Ritz vector). ``refine``: ``g`` was formed by
    cancellation (a Schur complement): take the extremes from the exact J whether or not the check
    fails, and if they do not settle, form the Gram from the exact rows before Householder QR."""
    notes: list[str] = []
    rv, c, *preconditioned = value if value is not None else (None, None)
    reg = None
    if null is not None:  # its basis need not be orthonormal to working precision
        reg = orthonormal_basis(t.T @ null[null.shape[0] - t.size :], 1e6)
    # where the factor comes from, in turn: the given Gram, the exact rows' Gram, Householder QR
    # (a given Gram formed without cancellation has the same sums as the rows': no "rows" then)
    if method == "qr":
        sources = ["qr"]
    elif g is None:
        sources = ["rows", "qr"]
    else:
        sources = ["given", "rows", "qr"] if refine else ["given", "qr"]
    for source in sources:
        r, route, factored_gram = _triangular(
            rows, t, use_qr=source == "qr", g=g if source == "given" else None, reg=reg
        )
        factor = _Factor(rv, c, r, t, rows, null, joint, factored_gram, bool(preconditioned))
        smax, smin, vec, top, converged = _factor_extremes(factor)
        if route == "qr":
            if source != "qr":  # its Cholesky failed: say why this scope took longer (QR of the rows)
                notes.append("the Gram is not numerically positive definite: factored by Householder QR")
            break
        shifted = route == "shifted"
        error, noise = _check(factor, smax, smin, vec) if smin > rtol * smax else (1.0, 0.0)
        lost = error > noise + CHECK_RTOL
        if not (lost or noise > CHECK_RTOL or shifted or (refine and source == "given")):
            break
        # the Gram lost sigma_min (or may have): take it from the exact J, the factor as
        # preconditioner, and recompute the factor from the next source when that does not settle
        refined = None
        if smin > rtol * smax:
            refined = _refined_sigma_min(factor, vec, smin, error=error, shifted=shifted, sigma_max=smax)
        if refined is not None:
            if shifted:
                notes.append("the Gram is not numerically positive definite: shifted, refined on the exact J")
            elif lost:
                notes.append("the Gram's Cholesky factor lost sigma_min: refined on the exact J")
            # sigma_max too, as the exact J's Rayleigh quotient of the factor's vector: a lower
            # bound whose error is quadratic in the vector's (the factor's own is linear)
            smin, smax = refined, float((factor.exact @ top[:, None]).norm())
            break
        why = "lost sigma_min" if lost and not shifted else "was not refined on the exact J"
        after = sources[sources.index(source) + 1]
        how = "Householder QR" if after == "qr" else "the Gram of the exact rows"
        what = "shifted Cholesky factor" if shifted else "Cholesky factor"
        notes.append(f"the Gram's {what} {why}: recomputed by {how}")
    if not converged:
        notes.append("Lanczos did not converge to 1e-10")
    if smin <= rtol * smax:  # a null direction the verified groups miss: exact values, counted
        smax, smin, extra, excluded = spectrum_cut(svdvals(factor.dense()), rtol)
        notes.append(
            f"{extra} singular value(s) <= rtol * sigma_max beyond the {verified} verified null "
            "directions: taken from svdvals"
        )
        return SpectrumSummary(smax, smin, verified + extra, notes, excluded)
    return SpectrumSummary(smax, smin, verified, notes)
