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
3. **Null space by regularisation, not deflation.** G' + beta Q_B Q_B^T, Q_B an orthonormal basis of
   T^T N, is positive definite and equals T^T (J^T J + N Z N^T) T: on N^perp it is J^T J exactly.
   Lanczos vectors are projected onto N^perp, so the regularised eigenvalues never enter.
4. **Extremes by block Lanczos** on R^T R (sigma_max^2) and on (R^T R)^{-1} (1/sigma_min^2, by
   triangular solves: sigma_min keeps its own relative accuracy).
5. **A check with the exact J.** The Rayleigh quotient ||J u|| / ||u|| of the sigma_min vector must
   match sigma_min; if the Gram lost it, R' is recomputed by Householder QR of the stacked
   [J_A T; sqrt(beta) Q_B^T] (backward stable: the same R' without squaring the condition number).
   ``method="qr"`` takes that route directly.

If a null value is left that the verified groups do not explain (sigma_min <= rtol * sigma_max),
the scope falls back to an exact svdvals of the regularised matrix and counts the extra nulls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lra_cond.conditioning.lanczos import top_eigenpair
from lra_cond.linalg import RANK_RTOL, spectrum_cut, svdvals

EPS = torch.finfo(torch.float64).eps
CHECK_RTOL = 1e-7  # Rayleigh-quotient check of sigma_min, on top of the check's own rounding level


@dataclass
class NullGroup:
    """A verified null group of one head: its name, the blocks it touches, its directions."""

    name: str
    blocks: frozenset[str]
    directions: torch.Tensor  # (head_size of its scope, m)


@dataclass
class ScopeNull:
    """The verified null space of one head on one scope: a basis (full rank, not necessarily
    orthonormal) in the scope's own column layout, and whether every group lies in the value block
    alone or outside it (then every basis column lies in one of the two)."""

    basis: torch.Tensor  # (n_scope, k)
    value_split: bool


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
    b4 = block.reshape(t, d, d, dim)
    y = b4[:, 0, 0]
    eye = torch.eye(d, dtype=block.dtype, device=block.device)
    scale = float(y.abs().max()) if y.numel() else 0.0
    ok = (b4 - torch.einsum("ab,ic->iabc", eye, y)).abs().max() <= 1e-12 * max(scale, 1e-300)
    return y if bool(ok) else None


def gram(a: torch.Tensor, panels: int = 4) -> torch.Tensor:
    """a^T a, computing each off-diagonal panel once (~60% of a full GEMM's flops)."""
    n = a.shape[1]
    if n < 512:
        return a.T @ a
    edges = [round(i * n / panels) for i in range(panels + 1)]
    out = torch.empty(n, n, dtype=a.dtype, device=a.device)
    for i in range(panels):
        ci = slice(edges[i], edges[i + 1])
        for j in range(i, panels):
            cj = slice(edges[j], edges[j + 1])
            out[ci, cj] = a[:, ci].T @ a[:, cj]
            if j != i:
                out[cj, ci] = out[ci, cj].T
    return out


class Preconditioner:
    """Block-diagonal T over a column layout: Kronecker blocks L (x) W (columns (b, c), c over
    W's size, row-major) and dense blocks T = R^{-1} (R upper triangular), in column order."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, int, tuple[torch.Tensor, ...]]] = []  # (kind, size, matrices)

    def add_kron(self, lb: torch.Tensor, w: torch.Tensor) -> None:
        inverses = (torch.linalg.inv(lb), torch.linalg.inv(w))
        self.parts.append(("kron", lb.shape[0] * w.shape[0], (lb, w, *inverses)))

    def add_dense(self, r: torch.Tensor) -> None:
        self.parts.append(("dense", r.shape[0], (r,)))

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
            return torch.linalg.solve_triangular(mats[0], x, upper=True)

        return self._each(v, fn)

    def apply_t(self, v: torch.Tensor) -> torch.Tensor:  # T^T v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[0].T, mats[1].T, x)
            return torch.linalg.solve_triangular(mats[0].T, x, upper=False)

        return self._each(v, fn)

    def solve(self, v: torch.Tensor) -> torch.Tensor:  # T^{-1} v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            return self._kron(mats[2], mats[3], x) if kind == "kron" else mats[0] @ x

        return self._each(v, fn)

    def solve_t(self, v: torch.Tensor) -> torch.Tensor:  # T^{-T} v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            return self._kron(mats[2].T, mats[3].T, x) if kind == "kron" else mats[0].T @ x

        return self._each(v, fn)

    def right(self, a: torch.Tensor) -> torch.Tensor:
        """a @ T for a (m, n)."""
        out, start = [], 0
        for kind, n, mats in self.parts:
            block = a[:, start : start + n]
            if kind == "kron":
                lb, w = mats[0], mats[1]
                d, p = lb.shape[0], w.shape[0]
                ab = (block.reshape(-1, p) @ w).reshape(-1, d, p).transpose(1, 2) @ lb
                out.append(ab.transpose(1, 2).reshape(a.shape[0], n))
            else:
                out.append(torch.linalg.solve_triangular(mats[0], block, upper=True, left=False))
            start += n
        return torch.cat(out, 1)


def input_whitening(x: torch.Tensor, rtol: float = RANK_RTOL) -> torch.Tensor:
    """W = V diag(1/s) V^T from the SVD of the real input rows (null directions scaled by 1/s_max):
    the Kronecker preconditioner's input side."""
    _, s, vh = torch.linalg.svd(x, full_matrices=True)
    full = torch.full((x.shape[1],), float(s[0]), dtype=x.dtype, device=x.device)
    full[: s.numel()] = torch.where(s > rtol * s[0], s, s[0])
    return vh.T @ torch.diag(1.0 / full) @ vh


def output_whitening(a: torch.Tensor, d: int, p: int) -> torch.Tensor:
    """L with (a reshaped (m, d, p)) contracted over rows and c having unit Gram on b: the
    Kronecker preconditioner's output side (the inverse Cholesky factor, transposed)."""
    a4 = a.reshape(-1, d, p)
    g = torch.einsum("mbc,mec->be", a4, a4)
    g = g + 1e-12 * g.diagonal().mean() * torch.eye(d, dtype=g.dtype, device=g.device)
    return torch.linalg.inv(torch.linalg.cholesky(g)).T


def dense_whitening(a: torch.Tensor) -> torch.Tensor:
    """R with a R^{-1} having unit Gram (shifted Cholesky: a preconditioner need not be exact)."""
    g = gram(a)
    shift = 1e-10 * float(g.diagonal().mean())
    eye = torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
    return torch.linalg.cholesky_ex(g + shift * eye, upper=True)[0]


DENSE_PRECONDITIONER_MAX = 1536  # larger mixed blocks get a diagonal (Jacobi) preconditioner


def _deflate_columns(
    rows: list[torch.Tensor], blocks: list[str], d: int, dim: int, null: torch.Tensor, x: torch.Tensor
) -> tuple[list[torch.Tensor], Preconditioner]:
    """Restrict the columns of every row matrix to N^perp (exactly, by orthogonal transformations)
    and build the preconditioner for the result.

    Each block's input side is rotated so that the null directions' components live in its first
    s_b input coordinates (V_par: the span of their rows); the other coordinates (V_perp) are free
    of null directions and keep their Kronecker structure. Inside the par coordinates the null
    space is deflated: by its explicit complement, or by Householder reflectors when it is small."""
    size = d * dim
    k = null.shape[1]
    perp, par, t = [], [], Preconditioner()
    null_par = []
    for i, _ in enumerate(blocks):
        nb = null[i * size : (i + 1) * size].T.reshape(k, d, dim)
        spread = torch.einsum("kac,kae->ce", nb, nb) if k else x.new_zeros(dim, dim)
        lam, vecs = torch.linalg.eigh(spread)
        inside = lam > 1e-10 * max(float(lam[-1]), 1e-300) if k else torch.zeros(dim, dtype=torch.bool)
        v_par, v_perp = vecs[:, inside], vecs[:, ~inside]
        for j, r in enumerate(rows):
            r3 = r[:, i * size : (i + 1) * size].reshape(-1, d, dim)
            perp_r = (r3 @ v_perp).reshape(r.shape[0], -1)
            par_r = (r3 @ v_par).reshape(r.shape[0], -1)
            if i == 0:
                perp.append([perp_r])
                par.append([par_r])
            else:
                perp[j].append(perp_r)
                par[j].append(par_r)
        null_par.append((nb @ v_par).reshape(k, d * v_par.shape[1]).T)
        if v_perp.shape[1]:
            t.add_kron(torch.eye(d, dtype=x.dtype, device=x.device), input_whitening(x @ v_perp))
    n_par = sum(np_.shape[0] for np_ in null_par)
    par_rows = [torch.cat(p, 1) for p in par]
    n_c = n_par - k
    if n_c and k:
        nmat = torch.cat(null_par, 0)
        reflectors, tau = torch.geqrf(nmat)
        if 7 * k < n_par:  # few null directions: apply the reflectors (~4 m n k flops)
            par_rows = [torch.ormqr(reflectors, tau, r, left=False, transpose=False)[:, k:] for r in par_rows]
        else:  # many: multiply by the explicit complement (a GEMM)
            padded = torch.cat([reflectors, reflectors.new_zeros(n_par, n_par - k)], 1)
            comp = torch.linalg.householder_product(padded, torch.cat([tau, tau.new_zeros(n_par - k)]))[:, k:]
            par_rows = [r @ comp for r in par_rows]
    elif not n_c:
        par_rows = [r[:, :0] for r in par_rows]
    out = [torch.cat([*perp[j], par_rows[j]], 1) for j in range(len(rows))]
    # output side of each Kronecker block, from the first row matrix (the main rows)
    start, parts = 0, []
    for kind, n, mats in t.parts:
        lb = output_whitening(out[0][:, start : start + n], d, n // d)
        parts.append((kind, n, (lb, mats[1], torch.linalg.inv(lb), mats[3])))
        start += n
    t.parts = parts
    if n_c:
        c_main = out[0][:, start:]
        if n_c <= DENSE_PRECONDITIONER_MAX:
            t.add_dense(dense_whitening(c_main))
        else:
            t.add_dense(torch.diag(c_main.norm(dim=0).clamp_min(1e-300)))
    return out, t


@dataclass
class _Factor:
    """R with R^T R = J^T J on one scope's deflated coordinates: R = [[diag(rv), C], [0, R' T^{-1}]]
    (the value part optional), R'^T R' = T^T A^T A T. ``rows`` are the exact rows, for checks."""

    rv: torch.Tensor | None  # (n_V,) diagonal of the value part (None: no value part)
    c: torch.Tensor | None  # (n_V, n_A) coupling rows of the rest in the value rows
    r: torch.Tensor  # (n_A, n_A) upper triangular R'
    t: Preconditioner
    rows: list[torch.Tensor]  # exact row blocks whose Gram is the rest's Gram
    route: str

    @property
    def n_v(self) -> int:
        return 0 if self.rv is None else self.rv.numel()

    @property
    def n(self) -> int:
        return self.n_v + self.r.shape[0]

    def r_apply(self, u: torch.Tensor) -> torch.Tensor:  # R u
        ua = u[self.n_v :]
        low = self.r @ self.t.solve(ua)
        if self.rv is None:
            return low
        return torch.cat([self.rv[:, None] * u[: self.n_v] + self.c @ ua, low])

    def rt_apply(self, w: torch.Tensor) -> torch.Tensor:  # R^T w
        if self.rv is None:
            return self.t.solve_t(self.r.T @ w)
        wv, wa = w[: self.n_v], w[self.n_v :]
        return torch.cat([self.rv[:, None] * wv, self.c.T @ wv + self.t.solve_t(self.r.T @ wa)])

    def inverse_gram(self, u: torch.Tensor) -> torch.Tensor:  # (R^T R)^{-1} u
        if self.rv is None:
            w = torch.linalg.solve_triangular(self.r.T, self.t.apply_t(u), upper=False)
            return self.t.apply(torch.linalg.solve_triangular(self.r, w, upper=True))
        uv, ua = u[: self.n_v], u[self.n_v :]
        wv = uv / self.rv[:, None]
        wa = torch.linalg.solve_triangular(self.r.T, self.t.apply_t(ua - self.c.T @ wv), upper=False)
        za = self.t.apply(torch.linalg.solve_triangular(self.r, wa, upper=True))
        return torch.cat([(wv - self.c @ za) / self.rv[:, None], za])

    def exact_norm(self, u: torch.Tensor) -> float:
        """||J u|| with the exact (unfactored) rows: the check of a factor that lost precision."""
        ua = u[self.n_v :]
        total = sum(float((rows @ ua).square().sum()) for rows in self.rows)
        if self.rv is not None:
            total += float((self.rv[:, None] * u[: self.n_v] + self.c @ ua).square().sum())
        return math.sqrt(total)

    def dense(self) -> torch.Tensor:
        """The exact matrix whose singular values these are (for the svdvals fallback)."""
        a = torch.cat(self.rows)
        if self.rv is None:
            return a
        zeros = a.new_zeros(a.shape[0], self.n_v)
        return torch.cat([torch.cat([torch.diag(self.rv), self.c], 1), torch.cat([zeros, a], 1)])


def _triangular(rows: list[torch.Tensor], t: Preconditioner, use_qr: bool) -> tuple[torch.Tensor, str]:
    """R' with R'^T R' = T^T A^T A T (A the stacked rows): Cholesky of the preconditioned Gram, or
    Householder QR of the preconditioned rows (also when the Gram is not numerically definite)."""
    pre = [t.right(r) for r in rows]
    if not use_qr:
        g = gram(pre[0])
        for p in pre[1:]:
            g = g + gram(p)
        chol, info = torch.linalg.cholesky_ex(g, upper=True)
        if int(info) == 0:
            return chol, "cholesky"
    r = torch.linalg.qr(torch.cat(pre), mode="r").R
    return r * torch.where(r.diagonal() < 0, -1.0, 1.0)[:, None], "qr"


def _identity(u: torch.Tensor) -> torch.Tensor:
    return u


def _extremes(factor: _Factor) -> tuple[float, float, torch.Tensor, bool]:
    dtype, device = factor.r.dtype, factor.r.device
    top = top_eigenpair(lambda u: factor.rt_apply(factor.r_apply(u)), factor.n, _identity, dtype, device)
    inv = top_eigenpair(factor.inverse_gram, factor.n, _identity, dtype, device)
    sigma_max = math.sqrt(max(top.value, 0.0))
    sigma_min = 1.0 / math.sqrt(inv.value) if inv.value > 0 and math.isfinite(inv.value) else 0.0
    return sigma_max, sigma_min, inv.vector, top.converged and inv.converged


def _check(factor: _Factor, sigma_max: float, sigma_min: float, vector: torch.Tensor) -> float:
    """How far the factor's inverse Gram is from the exact J's along the sigma_min direction, minus
    the check's own rounding level (> 0: the factor lost sigma_min).

    With w = (R^T R)^{-1} u, ||J w||^2 = u . w holds exactly when R^T R = J^T J, for any u; with
    R^T R = J^T J + E it is off by w^T E w / u . w, the relative error of the Gram along w (u the
    sigma_min vector makes w the sigma_min direction). The exact rows give ||J w||."""
    u = vector[:, None]
    w = factor.inverse_gram(u)
    ratio = factor.exact_norm(w) ** 2 / float((u * w).sum())
    noise = 8 * EPS * math.sqrt(vector.numel()) * sigma_max / max(sigma_min, 1e-300)
    return abs(ratio - 1.0) / 2 - noise - CHECK_RTOL


def _solve(
    rows: list[torch.Tensor],
    t: Preconditioner,
    value: tuple[torch.Tensor, torch.Tensor] | None,
    verified: int,
    rtol: float,
    method: str,
) -> Extremes:
    notes: list[str] = []
    rv, c = value if value is not None else (None, None)
    r, route = _triangular(rows, t, use_qr=method == "qr")
    factor = _Factor(rv, c, r, t, rows, route)
    smax, smin, vec, converged = _extremes(factor)
    if route == "cholesky" and (smin <= rtol * smax or _check(factor, smax, smin, vec) > 0):
        notes.append("the Gram's Cholesky factor lost sigma_min: recomputed by Householder QR")
        factor.r, factor.route = _triangular(rows, t, use_qr=True)
        smax, smin, vec, converged = _extremes(factor)
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


def _value_extremes(y: torch.Tensor, d: int, verified: int, rtol: float) -> Extremes:
    """Y (x) I_d: every singular value of Y, d times (exact)."""
    s = svdvals(y)
    smax, smin, n_null = spectrum_cut(torch.cat([s, s.new_zeros(y.shape[1] - s.numel())]), rtol)
    extra = d * n_null - verified
    notes = [f"{extra} value-block null value(s) beyond the verified ones"] if extra > 0 else []
    return Extremes(smax, smin, max(verified, d * n_null), max(extra, 0), "kron", notes)


def head_spectra(
    jac: torch.Tensor,
    blocks: tuple[str, ...],
    d: int,
    dim: int,
    x_real: torch.Tensor,
    nulls: dict[str, ScopeNull],
    rtol: float,
    method: str = "gram",
) -> dict[str, Extremes]:
    """Extremes of every scope in ``nulls`` ("all" over ``blocks``, or a single block) of one head.
    ``nulls[scope].basis`` is in the scope's own column layout (its blocks in ``blocks`` order)."""
    size = d * dim
    col = {b: slice(i * size, (i + 1) * size) for i, b in enumerate(blocks)}
    y = kron_factor(jac[:, col["v"]], d) if "v" in blocks else None
    rotated: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if y is not None:  # rows rotated by [Q_Y | Q_perp]^T (x) I: the value block becomes diag(s_Y) (x) I
        u, s_y, _ = torch.linalg.svd(y, full_matrices=True)
        r_y = int((s_y > rtol * s_y[0]).sum())
        t_len = jac.shape[0] // d

    def rows_of(b: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Block b's columns with rows rotated: (top: Q_Y part, bottom: Q_perp part), cached."""
        if b not in rotated:
            j2 = jac[:, col[b]].reshape(t_len, -1)
            rotated[b] = ((u[:, :r_y].T @ j2).reshape(r_y * d, -1), (u[:, r_y:].T @ j2).reshape(-1, size))
        return rotated[b]

    def columns(part: int, bs: list[str]) -> torch.Tensor:
        return torch.cat([rows_of(b)[part] for b in bs], 1)

    out: dict[str, Extremes] = {}
    for scope, null in nulls.items():
        sb = list(blocks) if scope == "all" else [scope]
        basis = null.basis
        if sb == ["v"] and y is not None:
            out[scope] = _value_extremes(y, d, basis.shape[1], rtol)
            continue
        eliminate = y is not None and "v" in sb and len(sb) > 1 and null.value_split
        if eliminate:
            i_v = sb.index("v")
            v_norm = basis[i_v * size : (i_v + 1) * size].norm(dim=0)
            v_part = v_norm > 0.5 * basis.norm(dim=0)  # each column lies in V or outside V
            eliminate = int(v_part.sum()) == d * (dim - r_y)  # the value block's own nulls are Y's
        if eliminate:
            a_blocks = [b for b in sb if b != "v"]
            keep = torch.cat([torch.arange(i * size, (i + 1) * size) for i, b in enumerate(sb) if b != "v"])
            null_a = basis[:, ~v_part][keep]
            (main, coupling), t = _deflate_columns(
                [columns(1, a_blocks), columns(0, a_blocks)], a_blocks, d, dim, null_a, x_real
            )
            value = (s_y[:r_y].repeat_interleave(d), coupling)
            out[scope] = _solve([main], t, value, basis.shape[1], rtol, method)
        else:
            if y is not None:
                rows = [columns(1, sb), columns(0, sb)]
            else:
                rows = [torch.cat([jac[:, col[b]] for b in sb], 1)]
            rows, t = _deflate_columns(rows, sb, d, dim, basis, x_real)
            out[scope] = _solve(rows, t, None, basis.shape[1], rtol, method)
    return out
