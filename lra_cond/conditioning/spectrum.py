"""Extreme non-null singular values of one head's Jacobian and of its blocks alone, without an SVD.

Input: the head's dense Jacobian J (rows (token, a), columns [Q | K | V] blocks of d x D' each) and
the verified null directions of every scope (the whole head and each block alone). Output: per
scope, sigma_max and sigma_min of J restricted to the orthogonal complement N^perp of its null
space N. Family-free; every step is either an orthogonal transformation or a change of variables
whose effect is undone exactly:

1. **Value block in closed form.** For every A = P V family the V block is Y (x) I_d (Y = P X),
   checked numerically. Rotating rows by [Q_Y | Q_perp]^T (x) I (Q_Y from the SVD of Y) and the V
   columns by V_Y gives J = [[diag(s_Y) (x) I, C], [0, P_perp J_A]]: the value block is eliminated
   exactly, and only the projected rest P_perp J_A goes further. Needs every null group to lie in
   V alone or outside V (checked); otherwise V is treated like the other blocks.
2. **Preconditioned Gram.** The rest is right-multiplied by a Kronecker preconditioner per block,
   T_b = L_b (x) W: W whitens the inputs (the paper's bound grows with kappa(X)), L_b the block's
   output side. The Gram G' = (J_A T)^T (J_A T) is then well conditioned (measured: kappa 3.6e5
   -> 6e3 on a layer whose kappa(J) is 2e7), so its Cholesky factor R' keeps every singular value
   to relative accuracy ~eps * kappa(J_A T)^2 (Ostrowski: R = R' T^{-1} satisfies
   R^T R = T^{-T} (G' + E) T^{-1} with ||G'^{-1/2} E G'^{-1/2}|| <= c eps kappa(G')).
3. **Null space: deflated or regularised.** The whole head's null space (the gauge: ~1/3 of its
   columns; normalized attention's orthogonal gauge, ~1/8, by a complement that is not orthogonal,
   its metric in the preconditioner: ``_factored_head_orthogonal``, else regularised as below:
   ``_factored_head_kept``) is deflated by orthogonal transformations (``_deflate_columns``):
   every block's input side is rotated so that the null directions live in a few input
   coordinates, and only those are replaced by their complement. A scope with few null
   directions (k <= n / 4, ``REGULARISE_RATIO``: most blocks alone, linear attention's whole
   head, normalized attention's) keeps every coordinate
   and its Kronecker preconditioner, and the null space is regularised instead: G' + beta Q_B
   Q_B^T, Q_B an orthonormal basis of T^T N, is positive definite and equals
   T^T (J^T J + N Z N^T) T, which is J^T J on N^perp and maps N to itself (Q_B Q_B^T, the
   projector onto T^T N, comes in closed form for a group of the gauge's form: normalized
   attention's rotations, ``gauge.GaugeProjector``). Lanczos and
   Rayleigh-Ritz vectors are projected onto N^perp, so the regularised eigenvalues never enter.
   (Deflating a block with a non-input-side null, e.g. normalized attention's scale W_Q, would
   turn all of W_Q's row space into dense columns: a Householder pass, a dense preconditioner and
   a triangular solve over every row, ~30% of such a probe.)
4. **Extremes by block Lanczos** on R^T R (sigma_max^2, its R' part through the Gram R' factors,
   one pass instead of two; on the exact J^T J instead where a family's factors give the whole
   head's rows as one cheap operator) and on (R^T R)^{-1} (1/sigma_min^2, by triangular solves:
   sigma_min keeps its own relative accuracy).
5. **A check with the exact J.** The Rayleigh quotient ||J u|| / ||u|| of the sigma_min vector
   must match sigma_min (``_check``, to its own rounding level ~eps sqrt(n) kappa). If the Gram
   lost it, or the check is too coarse to tell (kappa above ~1e6), sigma_min is taken from the exact J:
   preconditioned Rayleigh-Ritz on J^T J with the factor's inverse Gram as the preconditioner,
   from the factor's vector (``_refined_sigma_min``; every iterate an upper bound, exact to
   eps * sigma_max through the SVD of J V, a few steps to 1e-10 or to its rounding floor (an
   iterate that rises: ~5e-9 at kappa 1e10); tested: a factor off by 1e-4
   gives sigma_min to 1e-8; it may end below the factor's value by what the check measured,
   REFINE_AGREE). Only if that does not settle is R' recomputed by Householder QR of
   the preconditioned rows (stacked on sqrt(beta) Q_B^T when regularised; backward stable: the
   same R' without squaring the condition number, ~140 GFLOP at the reference shape).
   ``method="qr"`` takes that route directly.

When every block but V comes as factors (softmax; normalized, its K with a low-rank
correction; nystrom, its Q and K with a landmark correction (F (x) I_d) W), the whole head never
forms its rotated rows: the same Gram comes from the factors (``factored``; the value block as a Schur
complement, the deflation by congruence, ``_factored_head``), the exact rows stay an operator
(``DeflatedRows``), and because a Schur complement cancels, sigma_min is always taken from the
exact J by the Rayleigh-Ritz step of 5 (measured: a normalized-attention head at kappa 2.6e8
whose Schur-complement sigma_min was 1.8e-3 off, refined to Householder QR's value to 1e-10);
when that does not settle, the Gram is formed from the exact rows (no cancellation) before
Householder QR is tried. A scope with few null directions whose blocks all come as factors
(next to a family's dense columns or not: linear attention's whole head, normalized's Q or K
alone) has its Gram formed from them the same way, without a Schur complement
(``_factored_kept``).

If a null value is left that the verified groups do not explain (sigma_min <= rtol * sigma_max),
the scope falls back to an exact svdvals of J on N^perp and counts the extra nulls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate, product
from typing import NamedTuple

import torch

from lra_cond.conditioning import factored, gauge
from lra_cond.conditioning.gauge import NullStructure
from lra_cond.conditioning.head_jacobian import HeadJacobian
from lra_cond.conditioning.lanczos import top_eigenpair
from lra_cond.linalg import (
    RANK_RTOL,
    gram,
    kron_left,
    kron_right,
    matvec,
    orthonormal_basis,
    orthonormal_columns,
    spectrum_cut,
    svdvals,
)
from lra_cond.models.attention.jacobian import Factored, ValueBlock

EPS = torch.finfo(torch.float64).eps
CHECK_RTOL = 1e-7  # Rayleigh-quotient check of sigma_min, on top of the check's own rounding level


# a group of the gauge's form, as its (M_i, W_Q, W_K) (``NullGroup.maps``), and a mask of its
# columns among a scope's null basis (``ScopeNull.gauge_part``)
GaugePart = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class NullGroup:
    """A verified null group of one head: its name, the blocks it touches, its directions."""

    name: str
    blocks: frozenset[str]
    directions: torch.Tensor  # (head_size of its scope, m)
    # its closed form, when it has one (``gauge``): the null inputs W_b of a one-block input-side
    # group (every u w^T, w in span W_b), or the (W~_Q, W~_K) of the gauge
    input_side: torch.Tensor | None = None
    gauge: tuple[torch.Tensor, torch.Tensor] | None = None
    unit_gauge: bool = False  # the gauge's M_i are the unit matrices (``gauge.is_unit_basis``)
    # (M_i, W_Q, W_K) when its directions are (M_i W_Q, -M_i^T W_K), any number of them
    maps: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class ScopeNull:
    """One head's problem on one scope: its blocks (columns of the head Jacobian, Kronecker layout),
    optionally extra dense columns (a family's reduced coordinates for blocks that reach the output
    only through a subspace), and the verified null space: a basis (full rank, not necessarily
    orthonormal) in the layout [blocks..., dense], and whether every group lies in the value block
    alone or outside it (then every basis column lies in one of the two)."""

    basis: torch.Tensor  # (n_scope, k)
    value_split: bool
    blocks: list[str] | None = None  # None: the scope's own blocks (all, or the one)
    dense: torch.Tensor | None = None  # (T * d, r)
    reduced: int = 0  # null directions already removed by the dense reduction (counted in n_null)
    dense_product: Callable[[torch.Tensor], torch.Tensor] | None = None  # M -> dense @ M, structured
    dense_gram: Callable[[], torch.Tensor] | None = None  # () -> ~dense^T dense, for its preconditioner
    structure: NullStructure | None = None  # every group outside V in closed form (``gauge``)
    # a group of the gauge's form (``NullGroup.maps``) and its columns of ``basis`` (the others and
    # the group span the null space): its regulariser in closed form (``_gauge_regulariser``)
    gauge_part: GaugePart | None = None


@dataclass
class Extremes:
    sigma_max: float
    sigma_min: float
    n_null: int  # null directions excluded: the verified rank plus any extra
    n_extra_null: int  # singular values <= rtol * sigma_max the verified groups do not explain
    route: str  # "kron" | "cholesky" | "qr" | "svdvals"
    notes: list[str] = field(default_factory=list)


def kron_factor(block: torch.Tensor, d: int) -> torch.Tensor | None:
    """Y (T, D') if ``block`` (rows (i, a), columns (b, c)) is Y (x) I_d, i.e. block[(i, a), (b, c)] =
    delta_ab Y[i, c]; else None."""
    t, dim = block.shape[0] // d, block.shape[1] // d
    y = block.reshape(t, d, d, dim)[:, 0, 0]
    # Checked on random directions (the structure holds exactly or fails by O(1)): one product
    # instead of comparing every entry.
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(d * dim, 2, generator=gen, dtype=block.dtype).to(block.device)
    want = ValueBlock(y, d).apply(v)
    got = block @ v
    return y if bool((got - want).norm() <= 1e-12 * max(float(got.norm()), 1e-300)) else None


class Preconditioner:
    """Block-diagonal T over a column layout: Kronecker blocks L (x) W (columns (b, c), c over
    W's size, row-major; optionally after a metric's root, ``add_kron``), dense blocks
    T = R^{-1} (R upper triangular) and diagonal ones T = diag(1/s) (a Jacobi preconditioner,
    given as s), in column order."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, int, tuple[torch.Tensor, ...]]] = []  # (kind, size, matrices)

    def add_kron(self, lb: torch.Tensor, w: torch.Tensor, metric: gauge.MetricRoot | None = None) -> None:
        """T = L (x) W; with ``metric``, T = S (L (x) W), S its square root M^(1/2) (symmetric):
        coordinates whose inner product is M (``gauge.OrthogonalGaugeComplement``)."""
        mats = (lb, w, torch.linalg.inv(lb), torch.linalg.inv(w))
        n = lb.shape[0] * w.shape[0]
        self.parts.append(("kron", n, mats) if metric is None else ("kron_metric", n, (*mats, metric)))

    def add_dense(self, r: torch.Tensor) -> None:
        """R (n, n) upper triangular, or the diagonal s (n,) of a Jacobi preconditioner."""
        self.parts.append(("dense" if r.dim() == 2 else "diag", r.shape[0], (r,)))

    @property
    def size(self) -> int:
        return sum(n for _, n, _ in self.parts)

    def _each(self, v: torch.Tensor, fn) -> torch.Tensor:  # noqa: ANN001
        out, start = [], 0
        for kind, n, mats in self.parts:
            out.append(fn(kind, mats, v[start : start + n]))
            start += n
        return torch.cat(out)

    @staticmethod
    def _kron(lb: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(lb (x) w) v for v (d*p, k): per column, lb @ V @ w^T with V = v reshaped (d, p)."""
        d, p, k = lb.shape[0], w.shape[0], v.shape[1]
        tmp = (lb @ v.reshape(d, p * k)).reshape(d, p, k).transpose(0, 1).reshape(p, d * k)
        return (w @ tmp).reshape(p, d, k).transpose(0, 1).reshape(d * p, k)

    def apply(self, v: torch.Tensor) -> torch.Tensor:  # T v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[0], mats[1], x)
            if kind == "kron_metric":
                return mats[4].root(self._kron(mats[0], mats[1], x))
            if kind == "diag":
                return x / mats[0][:, None]
            return torch.linalg.solve_triangular(mats[0], x, upper=True)

        return self._each(v, fn)

    def apply_t(self, v: torch.Tensor) -> torch.Tensor:  # T^T v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[0].T, mats[1].T, x)
            if kind == "kron_metric":
                return self._kron(mats[0].T, mats[1].T, mats[4].root(x))
            if kind == "diag":
                return x / mats[0][:, None]
            return torch.linalg.solve_triangular(mats[0].T, x, upper=False)

        return self._each(v, fn)

    def solve(self, v: torch.Tensor) -> torch.Tensor:  # T^{-1} v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[2], mats[3], x)
            if kind == "kron_metric":
                return self._kron(mats[2], mats[3], mats[4].inverse_root(x))
            return x * mats[0][:, None] if kind == "diag" else matvec(mats[0], x)

        return self._each(v, fn)

    def solve_t(self, v: torch.Tensor) -> torch.Tensor:  # T^{-T} v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[2].T, mats[3].T, x)
            if kind == "kron_metric":
                return mats[4].inverse_root(self._kron(mats[2].T, mats[3].T, x))
            return x * mats[0][:, None] if kind == "diag" else matvec(mats[0].T, x)

        return self._each(v, fn)

    def right(self, a: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """a @ T for a (m, n); a @ T^{-1} with ``inverse``."""
        out, start = [], 0
        for kind, n, mats in self.parts:
            block = a[:, start : start + n]
            if kind in ("kron", "kron_metric"):
                lb, w = mats[2:4] if inverse else mats[:2]
                if kind == "kron_metric" and not inverse:  # a S (L (x) W): S symmetric
                    block = mats[4].root(block.T).T
                d, p = lb.shape[0], w.shape[0]
                tmp = (block.reshape(-1, p) @ w).reshape(-1, d, p)  # input side, then the output side
                tmp = (lb.T @ tmp).reshape(a.shape[0], n)  # in place: no transposed copies
                if kind == "kron_metric" and inverse:  # a (L (x) W)^-1 S^-1
                    tmp = mats[4].inverse_root(tmp.T).T
                out.append(tmp)
            elif kind == "diag":  # T = diag(1/s)
                out.append(block * mats[0] if inverse else block / mats[0])
            elif inverse:  # T = R^{-1}
                out.append(block @ mats[0])
            else:
                out.append(torch.linalg.solve_triangular(mats[0], block, upper=True, left=False))
            start += n
        if not out:  # no parts: a has no columns
            return a
        return out[0] if len(out) == 1 else torch.cat(out, 1)


def input_whitening(x: torch.Tensor, rtol: float = RANK_RTOL) -> torch.Tensor:
    """W = V diag(1/s) V^T from the SVD of the real input rows (null directions scaled by 1/s_max):
    the Kronecker preconditioner's input side."""
    _, s, vh = torch.linalg.svd(x, full_matrices=True)
    full = torch.full((x.shape[1],), float(s[0]), dtype=x.dtype, device=x.device)
    full[: s.numel()] = torch.where(s > rtol * s[0], s, s[0])
    return vh.T @ torch.diag(1.0 / full) @ vh


def output_whitening(a: torch.Tensor, d: int, p: int, rows: int = 64) -> torch.Tensor:
    """L with (a reshaped (m, d, p)) contracted over rows and c having unit Gram on b: the
    Kronecker preconditioner's output side (the inverse Cholesky factor, transposed). Summed over
    chunks of rows, each transposed to (d, rows * p) in cache: half the time of one transposed copy
    of the whole block (measured 22 against 46 ms for 6144 x 2080)."""
    m = a.new_zeros(d, d)
    for start in range(0, a.shape[0], rows):
        a2 = a[start : start + rows].reshape(-1, d, p).transpose(0, 1).reshape(d, -1)
        m.addmm_(a2, a2.T)
    return factored.inverse_cholesky_t(m)


def dense_whitening(a: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
    """R with a R^{-1} having unit Gram (shifted Cholesky: a preconditioner need not be exact);
    ``g``: a^T a when the caller has it (e.g. from a family's structure)."""
    g = gram(a) if g is None else g
    shift = 1e-10 * float(g.diagonal().mean())
    eye = torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
    return torch.linalg.cholesky_ex(g + shift * eye, upper=True)[0]


REGULARISE_RATIO = 4  # a scope regularises its k null directions when k * this <= its columns
DENSE_PRECONDITIONER_MAX = 1536  # larger mixed blocks get a diagonal (Jacobi) preconditioner


def _deflate_columns(
    rows: list[list[torch.Tensor]], d: int, dim: int, null: torch.Tensor, x: torch.Tensor, dense: int = 0
) -> tuple[list[torch.Tensor], Preconditioner]:
    """Restrict the columns of every row matrix to N^perp (exactly, by orthogonal transformations)
    and build the preconditioner for the result. ``rows[j][i]`` is block i of row matrix j (each
    (m_j, d * D')); ``null`` is the null basis in the blocks' layout.

    Each block's input side is rotated so that the null directions' components live in its first
    s_b input coordinates (V_par: the span of their rows); the other coordinates (V_perp) are free
    of null directions and keep their Kronecker structure. Inside the par coordinates the null
    space is deflated: by its explicit complement, or by Householder reflectors when it is small.
    Output columns: every block's V_perp coordinates, then the par complement. With ``dense`` > 0
    the last matrix of every ``rows[j]`` holds that many extra columns (no Kronecker structure:
    all of them are par coordinates), and so do the last rows of ``null``."""
    size, k, n_blocks = d * dim, null.shape[1], len(rows[0]) - (1 if dense else 0)
    rotations, perp_widths, null_par = [], [], []
    for i in range(n_blocks):
        nb = null[i * size : (i + 1) * size]
        v_perp, v_par, _ = _input_rotation(nb, d, dim)
        rotations.append(torch.cat([v_perp, v_par], 1))
        perp_widths.append(d * v_perp.shape[1])
        null_par.append((nb.T.reshape(k, d, dim) @ v_par).reshape(k, d * v_par.shape[1]).T)
    if dense:
        null_par.append(null[n_blocks * size :])
    n_par = sum(np_.shape[0] for np_ in null_par)
    n_c = n_par - k
    comp = None
    if n_c and k:
        reflectors, tau = torch.geqrf(torch.cat(null_par, 0))
        if 7 * k >= n_par:  # many null directions: the explicit complement, applied as a GEMM
            comp = _complement(reflectors, tau)
    n_perp = sum(perp_widths)
    out = []
    for blocks in rows:
        m = blocks[0].shape[0]
        res = blocks[0].new_empty(m, n_perp + n_c)
        par = blocks[0].new_empty(m, n_par) if n_c else None
        col = pcol = 0
        for b, rot, wp in zip(blocks[:n_blocks], rotations, perp_widths):
            b2 = b.reshape(m * d, dim)  # each side's product lands contiguous: one copy into place
            res[:, col : col + wp] = (b2 @ rot[:, : wp // d]).view(m, wp)
            col += wp
            width = size - wp
            if par is not None and width:
                par[:, pcol : pcol + width] = (b2 @ rot[:, wp // d :]).view(m, width)
                pcol += width
        if dense and par is not None:
            par[:, pcol:] = blocks[-1]
        if par is not None:
            if comp is not None:
                res[:, n_perp:] = par @ comp
            elif k:
                res[:, n_perp:] = torch.ormqr(reflectors, tau, par, left=False, transpose=False)[:, k:]
            else:
                res[:, n_perp:] = par
        out.append(res)
    t, col = Preconditioner(), 0
    for rot, wp in zip(rotations, perp_widths):
        if wp:
            p = wp // d
            t.add_kron(output_whitening(out[0][:, col : col + wp], d, p), input_whitening(x @ rot[:, :p]))
            col += wp
    if n_c:
        t.add_dense(dense_preconditioner(out[0][:, n_perp:]))
    return out, t


def dense_preconditioner(
    columns: torch.Tensor, columns_gram: Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """R whitening columns without Kronecker structure, or (when there are many) the column norms s
    of a Jacobi preconditioner diag(1/s) (``Preconditioner.add_dense`` takes either: as a formed
    diagonal matrix every product with it cost a full triangular solve or GEMM, ~0.14 TFLOP per
    whitening of the tiny split's 4096 linear-attention columns); ``columns_gram``: their Gram by a
    family's structure, cheaper than from the columns."""
    if columns.shape[1] <= DENSE_PRECONDITIONER_MAX:
        return dense_whitening(columns, None if columns_gram is None else columns_gram())
    return columns.norm(dim=0).clamp_min(1e-300)


def _whitened(
    columns: torch.Tensor,
    product: Callable[[torch.Tensor], torch.Tensor] | None,
    columns_gram: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, columns R^-1) for the dense preconditioner R of ``columns``; through ``product`` (M ->
    columns M by the family's structure) when given: linear attention's statistics apply R^-1 in
    T d^2 r flops where the triangular solve on the formed columns takes T d r^2 / 2 (~0.05
    against 0.11 s at the reference shape), and give R's Gram through their own (``columns_gram``:
    0.06 against 0.14 s)."""
    r = dense_preconditioner(columns, columns_gram)
    if r.dim() == 1:  # Jacobi: the columns scaled
        return r, columns / r
    if product is None:
        return r, torch.linalg.solve_triangular(r, columns, upper=True, left=False)
    eye = torch.eye(r.shape[0], dtype=r.dtype, device=r.device)
    return r, product(torch.linalg.solve_triangular(r, eye, upper=True))


@dataclass
class _Factor:
    """R with R^T R = J^T J on one scope's deflated coordinates: R = [[diag(rv), C], [0, R' T^{-1}]]
    (the value part optional), R'^T R' = T^T A^T A T. ``rows`` are the exact rows, for checks.
    With ``null`` (regularised), R^T R = J^T J + N Z N^T: every vector is projected off N."""

    rv: torch.Tensor | None  # (n_V,) diagonal of the value part (None: no value part)
    c: torch.Tensor | None  # (n_V, n_A) coupling rows of the rest in the value rows
    r: torch.Tensor  # (n_A, n_A) upper triangular R'
    t: Preconditioner
    rows: list[torch.Tensor | DeflatedRows]  # exact row blocks whose Gram is the rest's Gram
    route: str
    null: torch.Tensor | None = None  # orthonormal null basis still in the coordinates (regularised)
    # [C; rows] as one operator, when both come from the same factors (one product instead of two)
    joint: DeflatedRows | None = None
    gram: torch.Tensor | None = None  # the Gram R' factors (R'^T R' = it to ~eps), when formed
    # ``c`` holds C T, the coupling on the preconditioned coordinates (C = c T^-1 applied through
    # T: no pass over the whole coupling to form C, ~60 ms a head at the reference shape)
    c_preconditioned: bool = False

    # LAPACK returns R (and QR's Q) column-major: every product with a few columns goes through
    # ``matvec``, which reads either layout at row-major speed without a copy
    def _c_t(self, y: torch.Tensor) -> torch.Tensor:  # C^T y
        out = matvec(self.c.T, y)
        return self.t.solve_t(out) if self.c_preconditioned else out

    def _c(self, u: torch.Tensor) -> torch.Tensor:  # C u
        return matvec(self.c, self.t.solve(u) if self.c_preconditioned else u)

    def coupling(self) -> torch.Tensor | None:
        """C formed."""
        return self.t.right(self.c, inverse=True) if self.c_preconditioned else self.c

    def project(self, u: torch.Tensor) -> torch.Tensor:
        """u without its component along the regularised null directions (identity if none)."""
        return u if self.null is None else u - matvec(self.null, matvec(self.null.T, u))

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
        through a family's factors (each product then reads a few MB where R, its transpose and the
        value coupling read ~250 MB at the reference shape: memory-bound), else as R^T R u (a block
        alone: R is the smaller), through the factored Gram when there is one."""
        if self.joint is not None:
            return self.exact_apply_t(self.exact_apply(u))
        if self.gram is None:
            return self.rt_apply(self.r_apply(u))
        # R^T R u with R'^T R' = G': one pass over G' where R' and R'^T take two
        ua = u[self.n_v :]
        low = self.t.solve_t(matvec(self.gram, self.t.solve(ua)))
        if self.rv is None:
            return low
        top = self.rv[:, None] * u[: self.n_v] + self._c(ua)
        return torch.cat([self.rv[:, None] * top, self._c_t(top) + low])

    def r_apply(self, u: torch.Tensor) -> torch.Tensor:  # R u
        ua = u[self.n_v :]
        low = matvec(self.r, self.t.solve(ua))
        if self.rv is None:
            return low
        return torch.cat([self.rv[:, None] * u[: self.n_v] + self._c(ua), low])

    def rt_apply(self, w: torch.Tensor) -> torch.Tensor:  # R^T w
        if self.rv is None:
            return self.t.solve_t(matvec(self.r.T, w))
        wv, wa = w[: self.n_v], w[self.n_v :]
        return torch.cat([self.rv[:, None] * wv, self._c_t(wv) + self.t.solve_t(matvec(self.r.T, wa))])

    def inverse_gram(self, u: torch.Tensor) -> torch.Tensor:  # (R^T R)^{-1} u
        if self.rv is None:
            w = torch.linalg.solve_triangular(self.r.T, self.t.apply_t(u), upper=False)
            return self.t.apply(torch.linalg.solve_triangular(self.r, w, upper=True))
        uv, ua = u[: self.n_v], u[self.n_v :]
        wv = uv / self.rv[:, None]
        wa = torch.linalg.solve_triangular(self.r.T, self.t.apply_t(ua - self._c_t(wv)), upper=False)
        za = self.t.apply(torch.linalg.solve_triangular(self.r, wa, upper=True))
        return torch.cat([(wv - self._c(za)) / self.rv[:, None], za])

    def exact_apply(self, u: torch.Tensor) -> torch.Tensor:
        """J u with the exact (unfactored) rows: [value rows; every row block], (m, k)."""
        ua = u[self.n_v :]
        if self.joint is not None:
            out = self.joint @ ua
            out[: self.n_v] += self.rv[:, None] * u[: self.n_v]
            return out
        low = [_product(rows, ua) for rows in self.rows]
        if self.rv is not None:
            low.insert(0, self.rv[:, None] * u[: self.n_v] + self._c(ua))
        return torch.cat(low)

    def exact_apply_t(self, y: torch.Tensor) -> torch.Tensor:
        """J^T y for y in ``exact_apply``'s row layout."""
        if self.joint is not None:
            return torch.cat([self.rv[:, None] * y[: self.n_v], self.joint.T @ y])
        start, out = self.n_v, None
        for rows in self.rows:
            part = _product(rows.T, y[start : start + rows.shape[0]])
            out = part if out is None else out + part
            start += rows.shape[0]
        if self.rv is None:
            return out
        yv = y[: self.n_v]
        return torch.cat([self.rv[:, None] * yv, self._c_t(yv) + out])

    def exact_norm(self, u: torch.Tensor) -> float:
        """||J u|| with the exact rows: the check of a factor that lost precision."""
        return float(self.exact_apply(u).norm())

    def dense(self) -> torch.Tensor:
        """The exact matrix whose singular values these are (for the svdvals fallback)."""
        a, c = torch.cat([_materialised(r) for r in self.rows]), self.coupling()
        if self.null is not None:  # the complement of the regularised null directions (none in V)
            comp = _complement(*torch.geqrf(self.null[self.n_v :]))
            a, c = a @ comp, None if c is None else c @ comp
        if self.rv is None:
            return a
        zeros = a.new_zeros(a.shape[0], self.n_v)
        return torch.cat([torch.cat([torch.diag(self.rv), c], 1), torch.cat([zeros, a], 1)])


@dataclass
class _Regulariser:
    """beta P for a preconditioned Gram, P the orthogonal projector onto T^T N (N the null
    directions regularised, T the preconditioner): beta Q Q^T for an orthonormal Q (``basis``),
    plus a part in closed form whose range is orthogonal to Q's (``closed``: a gauge group's
    projector, ``gauge.GaugeProjector``, on [Q | K] coordinates), where a rank-m update of the
    Gram would cost (2 d D')^2 m. ``full``: an orthonormal basis of P's whole range (Householder
    QR's route stacks it as rows)."""

    basis: torch.Tensor
    closed: gauge.GaugeProjector | None = None
    full: Callable[[], torch.Tensor] | None = None

    def add_to(self, g: torch.Tensor, beta: float) -> torch.Tensor:
        if self.closed is not None:
            n = g.shape[0] // 2
            for i, j in product((0, 1), (0, 1)):  # formed contiguous: no strided adds
                g[i * n : (i + 1) * n, j * n : (j + 1) * n].add_(self.closed.block(i, j), alpha=beta)
        return gram(self.basis.T, add_to=g, alpha=beta) if self.basis.shape[1] else g

    def range_basis(self) -> torch.Tensor:
        return self.basis if self.full is None else self.full()


def _triangular(
    rows: list[torch.Tensor],
    t: Preconditioner,
    use_qr: bool,
    g: torch.Tensor | None = None,
    reg: _Regulariser | None = None,
) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """R' with R'^T R' = T^T A^T A T + beta P (A the stacked rows, P = ``reg`` the orthogonal
    projector onto T^T N, beta the mean diagonal): Cholesky of the preconditioned Gram (``g`` when
    the caller formed it from factors), or Householder QR of the preconditioned rows stacked on
    sqrt(beta) Q^T, Q an orthonormal basis of P's range (also when the Gram is not numerically
    definite). Also returns the Gram that was factored (None after QR). ``g`` is regularised in
    place (a copy of 4160^2 cost ~0.05 s at the reference shape): callers give a Gram of their own,
    never a cached one. On vectors orthogonal to N (all that Lanczos applies it to) the regularised
    Gram acts as the plain one: P T^-1 u = 0 exactly when N^T u = 0."""
    pre = None
    if not use_qr:
        if g is None:
            pre = [t.right(_materialised(r)) for r in rows]
            g = gram(pre[0])
            for p in pre[1:]:
                g = g + gram(p)
        if reg is not None:
            g = reg.add_to(g, float(g.diagonal().mean()))
        chol, info = torch.linalg.cholesky_ex(g, upper=True)
        if int(info) == 0:
            return chol, "cholesky", g
    if pre is None:
        pre = [t.right(_materialised(r)) for r in rows]
    if reg is not None:
        q = reg.range_basis()
        beta = sum(float(p.square().sum()) for p in pre) / q.shape[0]
        pre = [*pre, beta**0.5 * q.T]
    r = torch.linalg.qr(torch.cat(pre) if len(pre) > 1 else pre[0], mode="r").R
    return r * torch.where(r.diagonal() < 0, -1.0, 1.0)[:, None], "qr", None


def _extremes(factor: _Factor) -> tuple[float, float, torch.Tensor, torch.Tensor, bool]:
    """(sigma_max, sigma_min, the sigma_min vector, the sigma_max vector, converged) of the factor."""
    dtype, device = factor.r.dtype, factor.r.device
    top = top_eigenpair(
        factor.gram_apply, factor.n, factor.project, dtype, device, start=factor.value_cluster()
    )
    inv = top_eigenpair(factor.inverse_gram, factor.n, factor.project, dtype, device)
    sigma_max = math.sqrt(max(top.value, 0.0))
    sigma_min = 1.0 / math.sqrt(inv.value) if inv.value > 0 and math.isfinite(inv.value) else 0.0
    return sigma_max, sigma_min, inv.vector, top.vector, top.converged and inv.converged


@dataclass
class _Checked:
    excess: float  # the Gram's error along the sigma_min direction beyond the check's rounding level
    vouched: bool  # that rounding level is below the tolerance (False: the check cannot tell)
    error: float  # the Gram's relative error in sigma along that direction, as measured


def _check(factor: _Factor, sigma_max: float, sigma_min: float, vector: torch.Tensor) -> _Checked:
    """How far the factor's inverse Gram is from the exact J's along the sigma_min direction, minus
    the check's own rounding level (> 0: the factor lost sigma_min), and whether that rounding
    level is below the check's tolerance (False: the check cannot vouch for sigma_min).

    With w = (R^T R)^{-1} u, ||J w||^2 = u . w holds exactly when R^T R = J^T J, for any u; with
    R^T R = J^T J + E it is off by w^T E w / u . w, the relative error of the Gram along w (u the
    sigma_min vector makes w the sigma_min direction). The exact rows give ||J w||, to a relative
    ~eps sqrt(n) kappa: above kappa ~1e6 that bound exceeds CHECK_RTOL (measured: a linear-
    attention head at kappa 2.4e9 whose Cholesky sigma_min was 1.8e-4 off passed the check)."""
    u = vector[:, None]
    w = factor.inverse_gram(u)
    ratio = factor.exact_norm(w) ** 2 / float((u * w).sum())
    noise = 8 * EPS * math.sqrt(vector.numel()) * sigma_max / max(sigma_min, 1e-300)
    error = abs(ratio - 1.0) / 2
    return _Checked(error - noise - CHECK_RTOL, noise <= CHECK_RTOL, error)


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


# Rayleigh-Ritz steps before the refinement gives up (and the next factor is formed, ~3 s at the
# reference shape): a factor off by ~4e-3 along its sigma_min vector (measured: a normalized head
# at kappa 2.7e8, whose Schur-complement Gram lost that much) settles in 9-12 steps, 0.28 s
REFINE_STEPS = 16


def _refined_sigma_min(
    factor: _Factor, vector: torch.Tensor, estimate: float, steps: int = REFINE_STEPS, error: float = 0.0
) -> float | None:
    """sigma_min of the exact J, the Cholesky factor only close (~1 GFLOP at the reference shape,
    against ~140 for a Householder QR of the rows): preconditioned Rayleigh-Ritz
    (LOBPCG-like, block 1) on J^T J with the factor's inverse Gram as the preconditioner, starting
    from the factor's sigma_min vector; each step takes the smallest singular value of J V over
    V = span(w, P r, previous w) (r = J^T J w - rho w). Every iterate is an upper bound on sigma_min
    (Rayleigh-Ritz on a subspace), exact to eps * sigma_max through the SVD of J V, decreasing; it
    stops when it stagnates (REFINE_RTOL) or rises by a rounding step (REFINE_FLOOR). None (take
    the next factor) when it does neither or ends far from the factor's estimate (``error``: the
    factor's measured error along ``vector``, see REFINE_AGREE): the factor then was not a good
    preconditioner."""
    agree = min(REFINE_AGREE + 2 * error, REFINE_AGREE_MAX)
    w = vector[:, None] / vector.norm()
    previous, sigma = None, None
    for _ in range(steps):
        jw = factor.exact_apply(w)
        rho = float(jw.square().sum())
        p = factor.project(factor.inverse_gram(factor.exact_apply_t(jw) - rho * w))
        span = torch.cat([w, p] + ([previous] if previous is not None else []), 1)
        v = torch.linalg.qr(span).Q
        _, s, vh = torch.linalg.svd(factor.exact_apply(v), full_matrices=False)
        new_w, new_sigma = v @ vh[-1][:, None], float(s[-1])
        settled = sigma is not None and (
            abs(sigma - new_sigma) <= REFINE_RTOL * new_sigma
            or sigma <= new_sigma <= (1 + REFINE_FLOOR) * sigma  # risen: the rounding floor
        )
        if settled:
            new_sigma = min(sigma, new_sigma)  # the smaller upper bound
            return new_sigma if abs(new_sigma - estimate) <= agree * new_sigma else None
        previous, w, sigma = w, new_w, new_sigma
    return None


def _solve(
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
    regulariser: _Regulariser | None = None,
) -> Extremes:
    """``value``: (rv, C) of a value part, or (rv, C T, True) (``_Factor.c_preconditioned``).
    ``g``: the preconditioned Gram, when the caller formed it from factors. ``null``: an
    orthonormal basis of null directions left in the coordinates (regularised in the factor,
    projected out of every Lanczos and Rayleigh-Ritz vector; ``regulariser``: their regulariser
    when the caller has it in closed form). ``refine``: ``g`` was formed by
    cancellation (a Schur complement): take the extremes from the exact J whether or not the check
    fails, and if they do not settle, form the Gram from the exact rows before Householder QR."""
    notes: list[str] = []
    rv, c, *preconditioned = value if value is not None else (None, None)
    reg = regulariser
    if reg is None and null is not None:  # its basis need not be orthonormal to working precision
        reg = _Regulariser(orthonormal_basis(t.apply_t(null[null.shape[0] - t.size :]), 1e6))
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
        factor = _Factor(rv, c, r, t, rows, route, null, joint, factored_gram, bool(preconditioned))
        smax, smin, vec, top, converged = _extremes(factor)
        if route != "cholesky":
            break
        checked = _check(factor, smax, smin, vec) if smin > rtol * smax else _Checked(1.0, True, 1.0)
        lost = checked.excess > 0
        if not (lost or not checked.vouched or (refine and source == "given")):
            break
        # the Gram lost sigma_min (or may have): take it from the exact J, the factor as
        # preconditioner, and recompute the factor from the next source when that does not settle
        refined = None
        if smin > rtol * smax:
            refined = _refined_sigma_min(factor, vec, smin, error=checked.error)
        if refined is not None:
            if lost:
                notes.append("the Gram's Cholesky factor lost sigma_min: refined on the exact J")
            # sigma_max too, as the exact J's Rayleigh quotient of the factor's vector: a lower
            # bound whose error is quadratic in the vector's (the factor's own is linear)
            smin, smax = refined, factor.exact_norm(top[:, None])
            break
        why = "lost sigma_min" if lost else "was not refined on the exact J"
        after = sources[sources.index(source) + 1]
        how = "Householder QR" if after == "qr" else "the Gram of the exact rows"
        notes.append(f"the Gram's Cholesky factor {why}: recomputed by {how}")
    if not converged:
        notes.append("Lanczos did not converge to 1e-10")
    if smin <= rtol * smax:  # a null direction the verified groups miss: exact values, counted
        smax, smin, extra = spectrum_cut(svdvals(factor.dense()), rtol)
        notes.append(
            f"{extra} singular value(s) <= rtol * sigma_max beyond the {verified} verified null "
            "directions: taken from svdvals"
        )
        return Extremes(smax, smin, verified + extra, extra, "svdvals", notes)
    return Extremes(smax, smin, verified, 0, factor.route, notes)


def _input_rotation(null: torch.Tensor, d: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One block's input side split as in ``_deflate_columns``: (V_perp, V_par, null directions)."""
    k = null.shape[1]
    if not k:
        return torch.eye(dim, dtype=null.dtype, device=null.device), null.new_zeros(dim, 0), 0
    v_par, v_perp = gauge.row_space(null.T.reshape(k * d, dim))
    return v_perp, v_par, k


def _factored_scope(
    f: Factored, null: torch.Tensor, d: int, dim: int, x: torch.Tensor
) -> tuple[list[DeflatedRows], Preconditioner, torch.Tensor, torch.Tensor | None]:
    """A single block given as factors: its exact rows (an operator), Kronecker preconditioner and
    preconditioned Gram formed from the factors (``factored``), and the null directions left to
    regularise. When every null direction is input-side (u w^T: the par coordinates entirely null)
    they are deflated by rotating the input side (None left); otherwise the whole block is kept
    (``_factored_kept``) and all of them are returned (an orthonormal basis)."""
    v_perp, v_par, k = _input_rotation(null, d, dim)
    if k != d * v_par.shape[1]:
        return (*_factored_kept([f], None, d, x), orthonormal_basis(null))
    # the par input coordinates carry null directions only (J vanishes there), so the output side
    # over v_perp is the block's own (shared with the whole head's scope); the block alone on them,
    # its input side rotated and whitened, may have been formed for the whole head (``_alone``)
    cached = f.cache.get("alone")
    if cached is not None and cached[0].shape == v_perp.shape and _same_span(cached[0], v_par):
        v_perp = cached[0]
    v_perp, w, _, g = _alone(f, v_perp, x)
    t = Preconditioner()
    t.add_kron(factored.output_side(f), w)
    on_perp = Deflation([v_perp], [v_par], v_par.new_zeros(d * v_par.shape[1], 0), d)
    return [DeflatedRows([f], None, d, on_perp)], t, g, None


def _same_span(v: torch.Tensor, v_par: torch.Tensor) -> bool:
    """Whether ``v`` (orthonormal) spans the orthogonal complement of ``v_par`` (sizes checked by
    the caller)."""
    return bool((v.T @ v_par).abs().max() <= 1e-12) if v_par.numel() else True


class DeflatedRows:
    """(U^T (x) I_d) [J B | D] for J (T d, n) given by its factored column blocks, U (T, r) (None: I),
    B a ``Deflation`` (or ``_MetricDeflation``) and D optional dense columns (T d, r_D; only with
    U = None), as an operator: exact rows without forming them (``dense`` does, for a Householder
    QR or svdvals). The whole head's rows after the value elimination, a factored block's rows on
    its deflated coordinates, or factored blocks next to a family's dense columns."""

    def __init__(
        self,
        blocks: list[Factored],
        u: torch.Tensor | None,
        d: int,
        basis: Deflation | _MetricDeflation,
        columns: torch.Tensor | None = None,
    ) -> None:
        self.blocks, self.u, self.d, self.basis, self.columns = blocks, u, d, basis, columns
        extra = 0 if columns is None else columns.shape[1]
        self.shape = (blocks[0].left.shape[0] * d if u is None else u.shape[1] * d, basis.n + extra)

    def _rotate(self, m: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        if u is None:
            return m
        return (u.T @ m.reshape(u.shape[0], -1)).reshape(u.shape[1] * self.d, -1)

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        n = self.basis.n
        full = self.basis.apply(v[:n])
        out, size = None, full.shape[0] // len(self.blocks)
        for i, b in enumerate(self.blocks):
            part = factored.apply(b, full[i * size : (i + 1) * size], self.d)
            out = part if out is None else out + part
        if self.columns is not None:
            out = torch.addmm(out, self.columns, v[n:])
        return self._rotate(out, self.u)

    @property
    def T(self) -> _Transposed:  # noqa: N802 (reads like a tensor's)
        return _Transposed(self)

    def dense(self) -> torch.Tensor:
        rows = self.blocks[0].left.shape[0] * self.d
        full = torch.cat([self._rotate(b.dense().reshape(rows, -1), self.u) for b in self.blocks], 1)
        out = self.basis.apply_t(full.T).T
        return out if self.columns is None else torch.cat([out, self.columns], 1)


class _Transposed:
    def __init__(self, rows: DeflatedRows) -> None:
        self.rows = rows

    def __matmul__(self, y: torch.Tensor) -> torch.Tensor:
        u = self.rows.u
        back = y if u is None else self.rows._rotate(y, u.T)  # U (x) I: back to the token rows
        d = self.rows.d
        out = self.rows.basis.apply_t(torch.cat([factored.apply_t(b, back, d) for b in self.rows.blocks]))
        return out if self.rows.columns is None else torch.cat([out, matvec(self.rows.columns.T, back)])


@dataclass
class Deflation:
    """An orthonormal basis B of N^perp in a Kronecker layout: per block, the input side rotated
    (``perp`` (D', p_b): coordinates free of null directions, kept as they are; ``par`` (D', s_b):
    the null directions' input span), and ``comp`` (sum_b d s_b, n_c): an orthonormal complement
    of the null directions inside the par coordinates. Columns: every block's perp coordinates
    (d x p_b each), then the complement."""

    perp: list[torch.Tensor]
    par: list[torch.Tensor]
    comp: torch.Tensor
    d: int

    @property
    def n(self) -> int:
        return sum(self.d * p.shape[1] for p in self.perp) + self.comp.shape[1]

    def apply(self, v: torch.Tensor) -> torch.Tensor:  # B v: deflated -> full coordinates
        d, k = self.d, v.shape[1]
        n_perp = sum(d * p.shape[1] for p in self.perp)
        par = matvec(self.comp, v[n_perp:])
        out, col, pcol = [], 0, 0
        for perp, par_in in zip(self.perp, self.par):
            wp, ws = d * perp.shape[1], d * par_in.shape[1]
            block = torch.einsum("cj,ajk->ack", perp, v[col : col + wp].reshape(d, -1, k))
            block = block + torch.einsum("cj,ajk->ack", par_in, par[pcol : pcol + ws].reshape(d, -1, k))
            out.append(block.reshape(-1, k))
            col, pcol = col + wp, pcol + ws
        return torch.cat(out)

    def apply_t(self, v: torch.Tensor) -> torch.Tensor:  # B^T v: full -> deflated coordinates
        d, k = self.d, v.shape[1]
        perps, pars, start = [], [], 0
        for perp, par_in in zip(self.perp, self.par):
            block = v[start : start + d * perp.shape[0]].reshape(d, perp.shape[0], k)
            perps.append(torch.einsum("cj,ack->ajk", perp, block).reshape(-1, k))
            pars.append(torch.einsum("cj,ack->ajk", par_in, block).reshape(-1, k))
            start += d * perp.shape[0]
        return torch.cat([*perps, matvec(self.comp.T, torch.cat(pars))])


def deflation(null: torch.Tensor, d: int, dim: int, n_blocks: int) -> Deflation:
    """The Deflation of ``null`` (n_blocks d D' x k, the blocks' Kronecker layout)."""
    size, k = d * dim, null.shape[1]
    if not k:
        eye = torch.eye(dim, dtype=null.dtype, device=null.device)
        return Deflation([eye] * n_blocks, [eye[:, :0]] * n_blocks, null.new_zeros(0, 0), d)
    perps, pars, null_par = [], [], []
    for i in range(n_blocks):
        nb = null[i * size : (i + 1) * size]
        v_perp, v_par, _ = _input_rotation(nb, d, dim)
        perps.append(v_perp)
        pars.append(v_par)
        null_par.append((nb.T.reshape(k, d, dim) @ v_par).reshape(k, -1).T)
    return Deflation(perps, pars, _complement(*torch.geqrf(torch.cat(null_par))), d)


def _complement(reflectors: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """The last n - k columns of the Householder Q of a (n, k) matrix's ``geqrf``: an orthonormal
    basis of its columns' orthogonal complement (Q applied to [0; I]: ~2/3 of forming all of Q)."""
    n, k = reflectors.shape
    eye = torch.zeros(n, n - k, dtype=reflectors.dtype, device=reflectors.device)
    eye[k:] = torch.eye(n - k, dtype=reflectors.dtype, device=reflectors.device)
    return torch.ormqr(reflectors, tau, eye, left=True, transpose=False)


def _product(m: torch.Tensor | DeflatedRows | _Transposed, v: torch.Tensor) -> torch.Tensor:
    """m @ v for a dense matrix (either layout, ``matvec``) or an operator."""
    return matvec(m, v) if isinstance(m, torch.Tensor) else m @ v


def _materialised(rows: torch.Tensor | DeflatedRows) -> torch.Tensor:
    return rows.dense() if isinstance(rows, DeflatedRows) else rows


def _block_grams(fs1: list[Factored], fs2: list[Factored] | None, like: torch.Tensor) -> torch.Tensor:
    """[J_1 .. J_n]^T [J'_1 .. J'_m] for factored blocks (any input widths), every pair through the
    factors; ``fs2`` None: the Gram of ``fs1`` (each off-diagonal pair once)."""
    sym = fs2 is None
    fs2 = fs1 if fs2 is None else fs2
    off1, off2 = ([0, *accumulate(f.left.shape[-1] * f.right.shape[-1] for f in fs)] for fs in (fs1, fs2))
    g = like.new_empty(off1[-1], off2[-1])
    for i, fi in enumerate(fs1):
        rows = slice(off1[i], off1[i + 1])
        for j in range(i if sym else 0, len(fs2)):
            cols = slice(off2[j], off2[j + 1])
            g[rows, cols] = _self_gram(fi) if sym and j == i else factored.cross_gram(fi, fs2[j])
            if sym and j != i:
                g[cols, rows] = g[rows, cols].T
    return g


def _self_gram(f: Factored) -> torch.Tensor:
    """J^T J of a factored block, kept in its cache: the preconditioned factors of a block with
    every coordinate kept are shared by its scopes (``_kept_factor``), so the whole head and the
    block alone read the same Gram."""
    if "self_gram" not in f.cache:
        f.cache["self_gram"] = factored.cross_gram(f, f)
    return f.cache["self_gram"]


def _cross_grams(pre: list[Factored], columns: torch.Tensor | None = None) -> torch.Tensor:
    """[J_1 .. J_n | D]^T [J_1 .. J_n | D] for factored blocks J_b and optional dense columns D,
    every block J_b^T J_b' and J_b^T D through the factors."""
    g = _block_grams(pre, None, pre[0].left)
    if columns is None:
        return g
    across = torch.cat([factored.apply_t(f, columns, f.left.shape[-1]) for f in pre])
    return torch.cat([torch.cat([g, across], 1), torch.cat([across.T, gram(columns)], 1)])


def _kept_coordinates(
    fs: list[Factored], d: int, x: torch.Tensor
) -> tuple[Preconditioner, list[Factored], Deflation]:
    """Factored blocks with every coordinate kept: their Kronecker preconditioner L_b (x) W, the
    preconditioned factors, and the identity ``Deflation`` of their coordinates."""
    dim = x.shape[1]
    t, pre = Preconditioner(), []
    for f in fs:
        lb, w, p = _kept_factor(f, x)
        t.add_kron(lb, w)
        pre.append(p)
    return t, pre, deflation(x.new_zeros(len(fs) * d * dim, 0), d, dim, len(fs))


def _kept_factor(f: Factored, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Factored]:
    """(L_b, W, the factors of J (L_b (x) W)) of a block with every coordinate kept, formed once
    per probe input (kept in its cache): the whole head and the block alone share them, and with
    them the block's Gram (``_self_gram``)."""
    cached = f.cache.get("kept")
    if cached is None or cached[0] is not x:
        lb, w = factored.output_side(f), input_whitening(x)
        f.cache["kept"] = cached = (x, lb, w, factored.preconditioned(f, lb, w))
    return cached[1:]


def _factored_kept(
    fs: list[Factored],
    columns: torch.Tensor | None,
    d: int,
    x: torch.Tensor,
    product: Callable[[torch.Tensor], torch.Tensor] | None = None,
    columns_gram: Callable[[], torch.Tensor] | None = None,
) -> tuple[list[DeflatedRows], Preconditioner, torch.Tensor]:
    """A scope with few null directions (every coordinate kept, the nulls regularised) whose blocks
    all come as factors, next to optional dense columns (a family's support columns, e.g. linear
    attention's whole head): its exact rows as an operator, its preconditioner (L_b (x) W per
    block, R_D for the columns) and the preconditioned Gram from the factors (``_cross_grams``:
    T d^2 D'^2 per pair of blocks and T d (d + D') r_D against the columns, where the formed rows'
    Gram costs T d n^2). No cancellation: the same sums as the formed rows' Gram, in another order."""
    t, pre, identity = _kept_coordinates(fs, d, x)
    scaled = None
    if columns is not None:
        r, scaled = _whitened(columns, product, columns_gram)
        t.add_dense(r)
    rows = [DeflatedRows(fs, None, d, identity, columns)]
    return rows, t, _cross_grams(pre, scaled)


class _Head(NamedTuple):
    """One head's whole-head problem once the value block is eliminated: the blocks' factors (all
    but V's), the token rotation [Q_Y | Q_perp] with Y's rank and singular values, the null
    directions outside V, the probe input, the verified null count, the cut and the method."""

    fs: list[Factored]
    u: torch.Tensor
    r_y: int
    s_y: torch.Tensor
    null: torch.Tensor
    x: torch.Tensor
    verified: int
    rtol: float
    method: str


def _factored_head(
    head: _Head,
    closed: gauge.GaugeComplement | None = None,
    gauge_part: GaugePart | None = None,
) -> Extremes:
    """The whole head when every block but V is given as factors (softmax, normalized, nystrom: Q, K),
    every piece from the factors (the dense route rotates and deflates ~270 MB of rows per head):

    * each block's input side rotated to [V_perp | V_par] (``deflation``), then preconditioned:
      L_b (x) W_perp on the perp coordinates (their final preconditioner), L_b (x) I on the par;
    * the par coordinates replaced by the complement of the null directions by congruence
      (M = (L_b^{-1} (x) I) comp), whitened by the Cholesky factor of its own Gram; with ``closed``
      (the null space is the gauge and null inputs) the complement's columns come from Q's
      factors transformed by a Kronecker product instead (``gauge.GaugeComplement.factor``: no
      Householder pass, no congruence, and K meets it only on K's perp coordinates);
    * the value block eliminated as a Schur complement, M^T T^T J_A^T (P_perp (x) I) J_A T M =
      M^T G'_AA M - (C' M)^T (C' M) with C' = (Q_Y^T (x) I) J_A T.

    The exact rows (of the check, the refinement and sigma_max) are an operator through the
    factors, never formed; the value coupling C B is, from the Schur complement's pieces."""
    fs, u, r_y, null, x = head.fs, head.u, head.r_y, head.null, head.x
    d, dim, n_b = fs[0].left.shape[-1], fs[0].right.shape[-1], len(fs)
    if closed is not None:
        basis = Deflation(closed.perp, closed.rows, closed.comp(), d)
        if not _spans_null(basis, null):
            closed = None
    if closed is None:
        if null.shape[1] * REGULARISE_RATIO <= null.shape[0]:
            if gauge_part is not None:
                out = _factored_head_orthogonal(head, gauge_part)
                if out is not None:
                    return out
            return _factored_head_kept(head, gauge_part)
        basis = deflation(null, d, dim, n_b)
    n_c, pcol = basis.comp.shape[1], 0
    # each block split by input side into its perp and its par coordinates, as separate factors
    # (the layout of ``Deflation``: every block's perp ones, then the par ones): every product
    # below lands in that layout, no columns gathered
    t_d, perp_fs, par_fs, m_par, w_perps = Preconditioner(), [], [], [], []
    for f, perp, par in zip(fs, basis.perp, basis.par):
        lb = factored.output_side(f)  # a sum over the inputs: any rotation of them keeps it
        w_perps.append(None)
        if perp.shape[1]:  # (every input direction may carry a null one: then no perp part)
            w_perps[-1] = w_perp = input_whitening(x @ perp)
            t_d.add_kron(lb, w_perp)
            perp_fs.append(factored.preconditioned(f, lb, perp @ w_perp))
        if closed is None:
            par_fs.append(factored.preconditioned(f, lb, par))
            ws = d * par.shape[1]  # par coordinates -> the preconditioned ones: L_b^{-1} (x) I
            comp = basis.comp[pcol : pcol + ws].reshape(d, -1)
            m_par.append((torch.linalg.inv(lb) @ comp).reshape(ws, n_c))
            pcol += ws
    n_perp = sum(d * f.right.shape[-1] for f in perp_fs)
    # C' = C T on the perp coordinates and C' M on the complement; the Schur complement's pieces
    top_perp = _rows_rotated(perp_fs, u[:, :r_y], d)
    c_perp = t_d.right(top_perp, inverse=True)  # C on the perp coordinates (t_d: only theirs yet)
    if closed is None:
        m_par = torch.cat(m_par)
        top_c = _rows_rotated(par_fs, u[:, :r_y], d) @ m_par
        g_cc = m_par.T @ (_block_grams(par_fs, None, x) @ m_par)
        g_pc = _block_grams(perp_fs, par_fs, x) @ m_par
        g_pp = _block_grams(perp_fs, None, x)
    else:
        comp_f = closed.factor(fs)  # the complement's columns, up to ``closed.scale``
        top_c = closed.scale(factored.rows_rotated(comp_f, u[:, :r_y]))
        g = _closed_grams(fs, closed, w_perps, [*perp_fs, comp_f], x)
        g_pp, g_pc = g[:n_perp, :n_perp], closed.scale(g[:n_perp, n_perp:])
        g_cc = closed.gram(g[n_perp:, n_perp:])
    h, r_c = _schur_whitened(g_pp, g_pc, g_cc, top_perp, top_c)
    t_d.add_dense(r_c)
    # C B formed (~50 MB at the reference shape; its pieces are formed anyway): the inverse Gram's
    # products read it, where the factors' operator re-reads nystrom's corrections Z (~140 MB):
    # measured 78 -> 36 ms per Lanczos step there, the same for softmax and normalized
    return _solve_head(head, basis, t_d, h, torch.cat([c_perp, top_c], 1), preconditioned=False)


def _solve_head(
    head: _Head,
    basis: Deflation | _MetricDeflation,
    t: Preconditioner,
    h: torch.Tensor,
    coupling: torch.Tensor,
    preconditioned: bool,
    null: torch.Tensor | None = None,
    regulariser: _Regulariser | None = None,
) -> Extremes:
    """The extremes of a whole head from its value block's Schur complement ``h`` (preconditioned
    by ``t`` on the coordinates ``basis``), the value part diag(s_Y) (x) I_d and its ``coupling``
    (C, or C T when ``preconditioned``: ``_Factor.c_preconditioned``); the exact rows through the
    factors, those of Q_perp and, for sigma_max, [C B; rows] as one operator (``joint``). ``null``,
    ``regulariser``: null directions left in the coordinates (``_solve``)."""
    fs, u, r_y = head.fs, head.u, head.r_y
    d = fs[0].left.shape[-1]
    rows = [DeflatedRows(fs, u[:, r_y:], d, basis)]
    joint = DeflatedRows(fs, u, d, basis)  # [C B; rows]: u's columns are [Q_Y | Q_perp]
    s = head.s_y[:r_y].repeat_interleave(d)
    value = (s, coupling, True) if preconditioned else (s, coupling)
    # the Schur complement cancels: its rounding is eps ||G'_AA|| (measured 1e-7 of sigma_min at
    # kappa 7.5e8, under the check's threshold), so sigma_min always comes from the exact J
    return _solve(
        rows,
        t,
        value,
        head.verified,
        head.rtol,
        head.method,
        g=h,
        null=null,
        refine=True,
        joint=joint,
        regulariser=regulariser,
    )


def _schur_whitened(
    g_pp: torch.Tensor, g_pc: torch.Tensor, g_cc: torch.Tensor, top_p: torch.Tensor, top_c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The value block's Schur complement G - C^T C of a Gram G = [[G_pp, G_pc], [., G_cc]] and
    coupling rows C = [C_p | C_c], its complement part whitened by R_c, the (shifted) Cholesky
    factor of its own block H_cc = G_cc - C_c^T C_c: (H, R_c), H's complement columns and rows
    times R_c^-1. ``g_cc`` is overwritten."""
    n_p, n_c = g_pp.shape[0], g_cc.shape[0]
    h_cc = gram(top_c, add_to=g_cc, alpha=-1.0)
    eye = torch.eye(n_c, dtype=g_cc.dtype, device=g_cc.device)
    r_c = torch.linalg.cholesky_ex(h_cc + 1e-10 * float(h_cc.diagonal().mean()) * eye, upper=True)[0]
    h = g_pp.new_empty(n_p + n_c, n_p + n_c)
    h[:n_p, :n_p] = g_pp
    gram(top_p, add_to=h[:n_p, :n_p], alpha=-1.0)  # in place: no third such matrix
    h[:n_p, n_p:] = torch.linalg.solve_triangular(r_c, g_pc - top_p.T @ top_c, upper=True, left=False)
    h[n_p:, :n_p] = h[:n_p, n_p:].T
    h[n_p:, n_p:] = torch.linalg.solve_triangular(
        r_c.T, torch.linalg.solve_triangular(r_c, h_cc, upper=True, left=False), upper=False
    )
    return h, r_c


def _factored_head_kept(
    head: _Head,
    gauge_part: GaugePart | None = None,
) -> Extremes:
    """``_factored_head`` for a null space without a closed form but with few directions
    (normalized attention's: its orthogonal gauge, ~d^2 / 2 of the 2 d D' columns): every
    coordinate keeps its Kronecker preconditioner L_b (x) W and the null directions (all outside
    V) are regularised as in ``_factored_kept``, a group of the gauge's form (``gauge_part``: its
    maps and its columns of ``null``) in closed form (``_gauge_regulariser``). The value block's
    Schur complement T^T G_AA T - C'^T C' is then one Gram of the preconditioned factors less one
    of their rotated rows, where deflating takes a Householder complement and four congruences by
    it (measured ~1.4 s a head at the reference shape)."""
    fs, u, r_y, null, x = head.fs, head.u, head.r_y, head.null, head.x
    d = fs[0].left.shape[-1]
    t, pre, identity = _kept_coordinates(fs, d, x)
    top = _rows_rotated(pre, u[:, :r_y], d)  # C' = C T
    h = _block_grams(pre, None, x)
    h = gram(top, add_to=h, alpha=-1.0)  # in place: no second 4160^2 matrix
    n_v = r_y * d
    # the null directions in the factor's coordinates [V | A]: none has a V part (``value_split``)
    null_q = torch.cat([null.new_zeros(n_v, null.shape[1]), orthonormal_basis(null)])
    reg = None  # (None: from an orthonormal basis of all of T^T N, in ``_solve``)
    if gauge_part is not None and [kind for kind, _, _ in t.parts] == ["kron", "kron"]:
        reg = _gauge_regulariser(t, null, *gauge_part)
    return _solve_head(head, identity, t, h, top, preconditioned=True, null=null_q, regulariser=reg)


class _MetricDeflation:
    """``Deflation`` whose first ``n_q`` coordinates carry a metric M: B = B_0 diag(M^(-1/2), I)
    (``gauge.OrthogonalGaugeComplement``: orthonormal coordinates of J's restriction)."""

    def __init__(self, base: Deflation, metric: gauge.MetricRoot, n_q: int) -> None:
        self.base, self.metric, self.n_q, self.n = base, metric, n_q, base.n

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        return self.base.apply(torch.cat([self.metric.inverse_root(v[: self.n_q]), v[self.n_q :]]))

    def apply_t(self, v: torch.Tensor) -> torch.Tensor:
        out = self.base.apply_t(v)
        return torch.cat([self.metric.inverse_root(out[: self.n_q]), out[self.n_q :]])


def _factored_head_orthogonal(
    head: _Head,
    gauge_part: GaugePart,
) -> Extremes | None:
    """``_factored_head`` for a null space holding the orthogonal gauge (normalized attention: 496 of
    its 578 directions at the reference shape) and the null inputs: both deflated by the
    complement of ``gauge.OrthogonalGaugeComplement`` (Q whole, K's perp inputs, K's gauge inputs
    off the gauge: 3600 of 4160 coordinates there), its metric on Q in the preconditioner, and the
    other null directions (few: the symmetric gauge, the scales) regularised in those coordinates.
    Every Gram from the blocks' factors, as in ``_factored_head_kept`` on fewer columns (its
    Cholesky factor ~2/3 of the cost). None when the groups do not have that form."""
    fs, u, r_y, null, x = head.fs, head.u, head.r_y, head.null, head.x
    (maps, w_q, w_k), columns = gauge_part
    if len(fs) != 2:
        return None
    comp = gauge.orthogonal_complement(maps, w_q, w_k, x)
    if comp is None:
        return None
    d, dim = comp.d, x.shape[1]
    size = d * dim
    rest = null[:, ~columns]
    dq, dk = (rest[i * size : (i + 1) * size].T.reshape(-1, d, dim) for i in range(2))
    left = orthonormal_columns(comp.coordinates(dq, dk, w_q), norms=rest.norm(dim=0))
    n_inputs = 2 * d * (dim - comp.inputs.shape[1])
    if left.shape[1] + n_inputs + maps.shape[0] != null.shape[1]:
        return None  # other groups, or the null inputs not X's
    (f_q, f_k), t = fs, Preconditioner()
    w_in, w_perp = input_whitening(x @ comp.inputs), input_whitening(x @ comp.perp)
    l_q, l_k = factored.output_side(f_q), factored.output_side(f_k)
    pieces = [
        factored.preconditioned(f_q, l_q, comp.inputs @ w_in),
        factored.preconditioned(f_k, l_k, comp.perp @ w_perp),
        factored.preconditioned(f_k, comp.u, comp.rows),  # K's gauge inputs, to be reduced by P
    ]
    n_o = d * (comp.inputs.shape[1] + comp.perp.shape[1])
    g = _block_grams(pieces, None, x)
    top = _rows_rotated(pieces, u[:, :r_y], d)
    top_o, top_s = top[:, :n_o], comp.sym(top[:, n_o:])
    g_ss = comp.sym(comp.sym(g[n_o:, n_o:]).T)
    h, r_c = _schur_whitened(g[:n_o, :n_o], comp.sym(g[:n_o, n_o:]), g_ss, top_o, top_s)
    t.add_kron(l_q, w_in, comp.metric)
    t.add_kron(l_k, w_perp)
    t.add_dense(r_c)
    coupling = torch.cat([top_o, torch.linalg.solve_triangular(r_c, top_s, upper=True, left=False)], 1)
    base = Deflation([comp.inputs, comp.perp], [comp.inputs[:, :0], comp.rows], comp.sym_matrix(), d)
    basis = _MetricDeflation(base, comp.metric, d * comp.inputs.shape[1])
    null_q = torch.cat([null.new_zeros(r_y * d, left.shape[1]), left])
    return _solve_head(head, basis, t, h, coupling, preconditioned=True, null=null_q)


def _gauge_regulariser(
    t: Preconditioner,
    null: torch.Tensor,
    maps: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    columns: torch.Tensor,
) -> _Regulariser | None:
    """The regulariser of ``null`` ([Q | K] coordinates, T Kronecker on each) whose ``columns`` are
    a group (M_i W_Q, -M_i^T W_K): that group's projector in closed form, the other columns' by an
    orthonormal basis of their part orthogonal to it (the two ranges together: T^T span(null)).
    Measured at the reference shape (normalized attention, 496 of 578 null directions): ~0.13 s a
    head for both parts and their addition to the Gram, against ~0.23 s for an orthonormal basis of
    all of them and its rank-578 update. None when the group's projector has no closed form."""
    (_, _, (l_q, in_q, *_)), (_, _, (l_k, in_k, *_)) = t.parts  # [Q | K], each L_b (x) W
    closed = gauge.GaugeProjector.of(maps[0], maps[1:], (l_q, in_q, l_k, in_k))
    if closed is None:
        return None
    rest = t.apply_t(null[:, ~columns])
    for _ in range(2):  # twice is enough: off the group's range to working precision
        rest = rest - closed.apply(rest)
    return _Regulariser(orthonormal_basis(rest, 1e6), closed, lambda: orthonormal_basis(t.apply_t(null), 1e6))


def _alone(
    f: Factored, v: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Factored, torch.Tensor]:
    """Block f alone with its input side restricted to ``v`` (D', p orthonormal: the complement of
    its null inputs): (v, W, the factors of J (L_b (x) v W), their Gram), formed once (kept in its
    cache): the block's own scope (``_factored_scope``) and the whole head's pieces of that block
    (``_closed_grams``) share it."""
    cached = f.cache.get("alone")
    if cached is None or cached[0] is not v:
        w = input_whitening(x @ v)
        pre = factored.preconditioned(f, factored.output_side(f), v @ w)
        f.cache["alone"] = (v, w, pre, factored.cross_gram(pre, pre))
    return f.cache["alone"]


def _closed_grams(
    fs: list[Factored],
    closed: gauge.GaugeComplement,
    w_perps: list[torch.Tensor | None],
    pieces: list[Factored],
    x: torch.Tensor,
) -> torch.Tensor:
    """The Gram of the whole head's pieces (each block's perp coordinates, then the complement's
    factor, a piece of Q: ``GaugeComplement.factor``; as in ``_factored_head``). For blocks with a
    low-rank correction (nystrom's), a pair of pieces of one block is a congruence of its Gram
    alone (``_alone``) by the pieces' transforms relative to it, O (x) M with M = W^-1 v^T on the
    input side and O = L_b^-1 on the output side: ~(d p)^2 p flops where the correction's Grams
    take m d (d p)^2 again. A pair across the two blocks is Q's side of such a congruence of Q's
    coordinates alone against K's piece, that product formed once per K piece (K's only piece is
    its perp one: half of K's coordinates, where the full cross Gram of the two blocks alone costs
    twice that: 0.27 s a head at the reference shape, measured, against 0.52). Every other pair comes
    from the factors (T d^2 p^2: cheaper than the congruence without a correction)."""
    d = closed.d
    alone = {}  # block -> its Gram alone, for the blocks with a correction
    for b, f in enumerate(fs):
        if f.low_rank is not None:
            alone[b] = _alone(f, torch.cat([closed.rows[b], closed.perp[b]], 1), x)

    def relative(b: int, u_out: torch.Tensor | None, w_in: torch.Tensor) -> tuple | None:
        """Block b's piece with output side ``u_out`` (None: L_b) and input side ``w_in``, as (O, M)
        relative to the block's Gram alone (O = L_b^-1 u_out, M = W^-1 v^T w_in); None where it
        has none (then neither solve is needed)."""
        if b not in alone:
            return None
        v, w = alone[b][:2]
        o = None if u_out is None else torch.linalg.solve(factored.output_side(fs[b]), u_out)
        return o, torch.linalg.solve(w, v.T @ w_in)

    owner, transform = [], []  # per piece, in ``pieces`` order: perp ones, then the complement's
    for b, (perp, w_perp) in enumerate(zip(closed.perp, w_perps)):
        if w_perp is not None:
            owner.append(b)
            transform.append(relative(b, None, perp @ w_perp))
    owner.append(0)  # the complement's factor: Q's, output side U_K
    transform.append(relative(0, closed.u[1], closed.rows[0]))
    offsets = [0, *accumulate(p.left.shape[-1] * p.right.shape[-1] for p in pieces)]
    g = x.new_empty(offsets[-1], offsets[-1])
    against: dict[int, torch.Tensor] = {}  # piece j of K -> J_Q^T J_j on Q's coordinates alone
    for i, pi in enumerate(pieces):
        left: dict[int, torch.Tensor] = {}  # (O (x) M)^T J_b^T J_b of piece i's owner b
        for j in range(i, len(pieces)):
            rows, cols = slice(offsets[i], offsets[i + 1]), slice(offsets[j], offsets[j + 1])
            if transform[i] is None or transform[j] is None:
                g[rows, cols] = factored.cross_gram(pi, pieces[j])
            elif owner[i] == owner[j]:
                if owner[i] not in left:
                    left[owner[i]] = kron_left(alone[owner[i]][3], *transform[i], d)
                g[rows, cols] = kron_right(left[owner[i]], *transform[j], d)
            else:  # Q's piece q against K's piece k
                q, k = (i, j) if owner[i] == 0 else (j, i)
                if k not in against:
                    against[k] = factored.cross_gram(alone[0][2], pieces[k])
                block = kron_left(against[k], *transform[q], d)
                g[rows, cols] = block if q == i else block.T
            if j != i:
                g[cols, rows] = g[rows, cols].T
    return g


def _spans_null(basis: Deflation, null: torch.Tensor, probes: int = 2) -> bool:
    """Whether the closed-form basis is orthogonal to the verified null directions (random
    combinations of them: a basis built from a wrong structure would not be)."""
    gen = torch.Generator().manual_seed(0)
    v = null @ torch.randn(null.shape[1], probes, generator=gen, dtype=null.dtype).to(null.device)
    return bool(basis.apply_t(v).norm() <= gauge.GAUGE_RTOL * v.norm())


def _rows_rotated(fs: list[Factored], u: torch.Tensor, d: int) -> torch.Tensor:
    """(U^T (x) I_d) [J_1 .. J_n] for factored blocks (possibly none)."""
    if not fs:
        return u.new_zeros(u.shape[1] * d, 0)
    return torch.cat([factored.rows_rotated(f, u) for f in fs], 1)


def _value_extremes(y: torch.Tensor, d: int, verified: int, rtol: float) -> Extremes:
    """Y (x) I_d: every singular value of Y, d times (exact)."""
    s = svdvals(y)
    smax, smin, n_null = spectrum_cut(torch.cat([s, s.new_zeros(y.shape[1] - s.numel())]), rtol)
    extra = d * n_null - verified
    notes = [f"{extra} value-block null value(s) beyond the verified ones"] if extra > 0 else []
    return Extremes(smax, smin, max(verified, d * n_null), max(extra, 0), "kron", notes)


def head_spectra(
    jac: HeadJacobian,
    blocks: tuple[str, ...],
    d: int,
    dim: int,
    x_real: torch.Tensor,
    nulls: dict[str, ScopeNull],
    rtol: float,
    method: str = "gram",
    factors: dict[str, Factored] | None = None,
) -> dict[str, Extremes]:
    """Extremes of every scope in ``nulls`` ("all", or a single block) of one head: each scope's
    columns are its ``ScopeNull.blocks`` of ``jac`` (blocks laid out in ``blocks`` order), then its
    ``dense`` columns. ``factors``: blocks the family gave in factored form (single-block scopes
    use them). The value elimination's row rotation is shared by the scopes."""
    factors = factors or {}
    size = d * dim
    y = jac.value_factor() if "v" in blocks else None
    if y is None and "v" in blocks:  # a dense value block (forward-mode AD): tested numerically
        y = kron_factor(jac.block("v"), d)
    rotated: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    t_len = jac.shape[0] // d
    if y is not None:  # rows rotated by [Q_Y | Q_perp]^T (x) I: the value block becomes diag(s_Y) (x) I
        u, s_y, _ = torch.linalg.svd(y, full_matrices=True)
        r_y = int((s_y > rtol * s_y[0]).sum())

    def rotate(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = m.shape[1]
        both = (u.T @ m.reshape(t_len, -1)).reshape(-1, n)  # one product: u = [Q_Y | Q_perp]
        return both[: r_y * d], both[r_y * d :]

    def rows_of(b: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Block b's columns with rows rotated: (top: Q_Y part, bottom: Q_perp part), cached."""
        if b not in rotated:
            rotated[b] = rotate(jac.block(b))
        return rotated[b]

    out: dict[str, Extremes] = {}
    for scope, null in nulls.items():
        sb = null.blocks if null.blocks is not None else (list(blocks) if scope == "all" else [scope])
        basis, extra = null.basis, [] if null.dense is None else [null.dense]
        verified = basis.shape[1] + null.reduced
        if scope == "v" and y is not None:  # exact, whatever reduction the family offers
            out[scope] = _value_extremes(y, d, verified, rtol)
            continue
        eliminate = y is not None and "v" in sb and len(sb) > 1 and null.value_split and not extra
        if eliminate:
            i_v = sb.index("v")
            v_norm = basis[i_v * size : (i_v + 1) * size].norm(dim=0)
            v_part = v_norm > 0.5 * basis.norm(dim=0)  # each column lies in V or outside V
            eliminate = int(v_part.sum()) == d * (dim - r_y)  # the value block's own nulls are Y's
        if eliminate:
            a_blocks = [b for b in sb if b != "v"]
            keep = torch.cat([torch.arange(i * size, (i + 1) * size) for i, b in enumerate(sb) if b != "v"])
            null_a = basis[:, ~v_part][keep]  # the null directions outside V, in the other blocks
            if all(b in factors for b in a_blocks):  # the Gram from the factors, no rows formed
                fs = [factors[b] for b in a_blocks]
                closed = None
                if null.structure is not None:
                    closed = gauge.complement(null.structure, a_blocks, null_a.shape[1], d, dim)
                part = None  # a gauge-form group's columns among null_a ([Q | K] blocks only)
                if null.gauge_part is not None and a_blocks == ["q", "k"]:
                    part = (null.gauge_part[0], null.gauge_part[1][~v_part])
                problem = _Head(fs, u, r_y, s_y, null_a, x_real, verified, rtol, method)
                out[scope] = _factored_head(problem, closed, part)
                continue
            (main, coupling), t = _deflate_columns(
                [[rows_of(b)[1] for b in a_blocks], [rows_of(b)[0] for b in a_blocks]], d, dim, null_a, x_real
            )
            value = (s_y[:r_y].repeat_interleave(d), coupling)
            out[scope] = _solve([main], t, value, verified, rtol, method)
            continue
        if scope in factors and sb == [scope] and not extra:  # one factored block
            exact, t, g, left_null = _factored_scope(factors[scope], basis, d, dim, x_real)
            out[scope] = _solve(exact, t, None, verified, rtol, method, g=g, null=left_null)
            continue
        raw = [jac.block(b) for b in sb] + extra
        if basis.shape[1] * REGULARISE_RATIO <= basis.shape[0]:  # few nulls: every coordinate kept
            null_q = orthonormal_basis(basis)
            if sb and all(b in factors for b in sb):  # the Gram from the factors, no rows formed
                fs = [factors[b] for b in sb]
                rows, t, g = _factored_kept(
                    fs, extra[0] if extra else None, d, x_real, null.dense_product, null.dense_gram
                )
                out[scope] = _solve(rows, t, None, verified, rtol, method, g=g, null=null_q)
                continue
            t, g = Preconditioner(), None
            for b in raw[: len(sb)]:
                t.add_kron(output_whitening(b, d, dim), input_whitening(x_real))
            if extra and not sb and null.dense_product is not None:  # the columns alone, whitened
                r, scaled = _whitened(extra[0], null.dense_product, null.dense_gram)  # by its structure
                t.add_dense(r)
                g = gram(scaled)
            elif extra:
                t.add_dense(dense_preconditioner(extra[0], null.dense_gram))
            rows = [torch.cat(raw, 1)] if len(raw) > 1 else raw
            out[scope] = _solve(rows, t, None, verified, rtol, method, g=g, null=null_q)
            continue
        if y is not None:
            tops, bottoms = zip(*([rows_of(b) for b in sb] + [rotate(e) for e in extra]))
            rows = [list(bottoms), list(tops)]
        else:
            rows = [raw]
        dense = extra[0].shape[1] if extra else 0
        rows, t = _deflate_columns(rows, d, dim, basis, x_real, dense=dense)
        out[scope] = _solve(rows, t, None, verified, rtol, method)
    return out
