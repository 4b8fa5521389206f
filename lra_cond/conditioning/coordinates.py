"""Step 3 of the probe: the problem on the complement of the null space: its coordinates, its
preconditioner, and its exact rows as an operator.

* **Coordinates.** Each block's input side is rotated so that the null directions live in a few
  input coordinates, and only those are replaced by an orthonormal complement: the gauge's, in
  closed form (``GaugeComplement``), or none where they are the block's null inputs alone
  (``factored_scope``). The blocks keep their Kronecker layout. Any other null space keeps every
  coordinate and is regularised in the factor (``extremes.solve``).
* **The gauge's complement in closed form** (``gauge_complement``). Scores that see queries and
  keys only through inner products (softmax, nystrom) leave the gauge {(M A, -M^T B)} null
  (A = W~_Q, B = W~_K, M any d x d). With A_b = U_b S_b Vh_b off the null inputs, the d^2 columns
  (alpha_ij u^K_j (x) vh^Q_i, beta_ij u^Q_i (x) vh^K_j), alpha_ij = s^K_j / r_ij,
  beta_ij = s^Q_i / r_ij, r_ij = (s^Q_i^2 + s^K_j^2)^(1/2), are orthonormal and orthogonal to every
  gauge direction: (alpha_ij s^Q_i - beta_ij s^K_j) u^K_j^T M u^Q_i = 0. Because the gauge is null,
  the K half of each column moves J as a multiple of its Q half does, so the complement's columns
  of J are Q's factors transformed by a Kronecker product (``GaugeComplement.factor``).
  Normalized attention's orthogonal gauge (M antisymmetric) is regularised instead.
* **Preconditioner** (``Preconditioner``): block diagonal, Kronecker L_b (x) W on each block (W
  whitens the inputs, L_b the block's output side), triangular or Jacobi on other columns, so that
  the preconditioned Gram T^T J^T J T is well conditioned and its Cholesky factor keeps every
  singular value (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 10.1).
* **Exact rows** (``DeflatedRows``): J on those coordinates through a family's factors, never
  formed unless a fallback needs them.
* **Scopes whose blocks all come as factors** (``factored_scope``, ``factored_kept``): every Gram
  from the factors (this module's last part: ``cross_gram`` and its helpers), each block's
  preconditioned factors and Gram formed once per probe and shared by the whole head and the block
  alone (``kept_coordinates``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from lra_cond.conditioning import nullspace
from lra_cond.conditioning.families.base import Factored, Mixing, TokenMixing
from lra_cond.linalg import RANK_RTOL, Operator, gram, kron_right, orthonormal_basis, shifted_cholesky

INDEPENDENT_RTOL = 1e-8  # the gauge's input directions must be independent of the null inputs


@dataclass
class GaugeComplement(Operator):
    """An orthonormal basis B of the complement of the gauge and the null inputs on [Q | K], in a
    Kronecker layout: per block, the input side rotated to ``perp`` (D', p_b: input directions kept
    whole) and ``rows`` (D', d: the gauge's input directions, Vh_b^T); B's columns are every block's
    perp coordinates (d x p_b each), then the d^2 columns on the ``rows`` coordinates,
    (alpha_ij u^K_j (x) e_i, beta_ij u^Q_i (x) e_j), applied through U_Q, U_K and the scales, never
    formed: on Q's rows coordinates (b, c) column (i, j) is alpha_ij U_K[b, j] [c = i], on K's
    beta_ij U_Q[b, i] [c = j], so a product with k columns costs ~4 d^3 k flops where the dense
    (2 d^2, d^2) matrix reads 2 d^4 entries, twice per product of a whole head's exact rows."""

    perp: list[torch.Tensor]
    rows: list[torch.Tensor]
    u: tuple[torch.Tensor, torch.Tensor]  # (U_Q, U_K)
    alpha: torch.Tensor  # (d, d) [i, j]
    beta: torch.Tensor

    @property
    def d(self) -> int:
        return self.alpha.shape[0]

    @property
    def n(self) -> int:
        return sum(self.d * p.shape[1] for p in self.perp) + self.d * self.d

    def columns(self, v: torch.Tensor) -> torch.Tensor:
        """The d^2 columns on the blocks' ``rows`` coordinates (rows (b, c): output b, input
        ``rows[:, c]``), (2 d^2, d^2), times v."""
        d, k, (u_q, u_k) = self.d, v.shape[1], self.u
        v3 = v.reshape(d, d, k)  # [i, j, k]
        on_q = u_k @ (v3 * self.alpha[:, :, None]).transpose(0, 1).reshape(d, -1)  # [b, (c = i, k)]
        on_k = u_q @ (v3 * self.beta[:, :, None]).reshape(d, -1)  # [b, (c = j, k)]
        return torch.cat([on_q, on_k]).reshape(2 * d * d, k)

    def columns_t(self, v: torch.Tensor) -> torch.Tensor:
        """The transpose's product: [(b, c) on Q | (b, c) on K] -> (i, j)."""
        d, k, (u_q, u_k) = self.d, v.shape[1], self.u
        on_q = (u_k.T @ v[: d * d].reshape(d, -1)).view(d, d, k).transpose(0, 1)  # [i, j, k]
        on_k = (u_q.T @ v[d * d :].reshape(d, -1)).view(d, d, k)  # [i, j, k]
        return (on_q * self.alpha[:, :, None] + on_k * self.beta[:, :, None]).reshape(d * d, k)

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:  # B v: deflated -> full coordinates
        d, k = self.d, v.shape[1]
        n_perp = self.n - d * d
        par = self.columns(v[n_perp:])
        out, col = [], 0
        for i, (perp, rows) in enumerate(zip(self.perp, self.rows)):
            wp = d * perp.shape[1]
            block = torch.einsum("cj,ajk->ack", perp, v[col : col + wp].reshape(d, -1, k))
            on_rows = par[i * d * d : (i + 1) * d * d].reshape(d, d, k)
            block = block + torch.einsum("cj,ajk->ack", rows, on_rows)
            out.append(block.reshape(-1, k))
            col += wp
        return torch.cat(out)

    def matmul_t(self, v: torch.Tensor) -> torch.Tensor:  # B^T v: full -> deflated coordinates
        d, k = self.d, v.shape[1]
        perps, pars, start = [], [], 0
        for perp, rows in zip(self.perp, self.rows):
            block = v[start : start + d * perp.shape[0]].reshape(d, perp.shape[0], k)
            perps.append(torch.einsum("cj,ack->ajk", perp, block).reshape(-1, k))
            pars.append(torch.einsum("cj,ack->ajk", rows, block).reshape(-1, k))
            start += d * perp.shape[0]
        return torch.cat([*perps, self.columns_t(torch.cat(pars))])

    def factor(self, fs: list[Factored]) -> Factored:
        """J_Q (U_K (x) Vh_Q^T) (columns (j, i)): the complement's columns of J, up to ``scale``.

        The gauge is null, so J_Q(M^T W~_Q) = J_K(M W~_K) for every M, and on the gauge's input
        directions (the null inputs' part of W~_b is null too) J_K(u^Q_i (x) vh^K_j) =
        (s^Q_i / s^K_j) J_Q(u^K_j (x) vh^Q_i): column (i, j) of the complement is
        (alpha_ij + beta_ij s^Q_i / s^K_j) J_Q(u^K_j (x) vh^Q_i) = J_Q(u^K_j (x) vh^Q_i) / alpha_ij.
        One block's factor, not two: the complement's Grams with K need K's perp columns only."""
        return preconditioned(fs[0], self.u[1], self.rows[0])

    def scale(self, m: torch.Tensor) -> torch.Tensor:
        """M comp from M's products with ``factor``'s columns (n, d^2): reindexed (j, i) -> (i, j)
        and divided by alpha (``factor``)."""
        d = self.d
        return m.reshape(-1, d, d).transpose(1, 2).reshape(m.shape[0], d * d) / self.alpha.reshape(-1)

    def gram(self, g: torch.Tensor) -> torch.Tensor:
        """comp^T G comp from G, the Gram of ``factor``'s columns (d^2, d^2)."""
        return self.scale(self.scale(g).T)


def gauge_complement(
    gauge: tuple[torch.Tensor, torch.Tensor] | None,
    null_inputs: dict[str, torch.Tensor],
    blocks: list[str],
    k: int,
    d: int,
    dim: int,
) -> GaugeComplement | None:
    """The closed-form complement for a null space of rank ``k`` over ``blocks``, made of the gauge
    of ``gauge`` = (W~_Q, W~_K) and each block's ``null_inputs`` (an orthonormal basis W_b: every
    u w^T, w in span W_b, null), or None when it does not apply: no gauge, other blocks, a rank
    other than d^2 + d (t_Q + t_K) (other groups, or directions shared between them), or gauge
    input directions that (nearly) lie among the null inputs (the caller then regularises)."""
    if gauge is None or blocks != ["q", "k"]:
        return None
    inputs = [null_inputs.get(b, gauge[0].new_zeros(dim, 0)) for b in blocks]
    if k != d * d + d * sum(w.shape[1] for w in inputs):
        return None
    perps, rows, us, ss = [], [], [], []
    for w, a in zip(inputs, gauge):
        a_proj = a - (a @ w) @ w.T
        u, s, vh = torch.linalg.svd(a_proj, full_matrices=False)
        if float(s[-1]) <= INDEPENDENT_RTOL * float(s[0]):
            return None
        q = torch.linalg.qr(torch.cat([w, vh.T], 1), mode="complete").Q
        perps.append(q[:, w.shape[1] + d :])
        rows.append(vh.T)
        us.append(u)
        ss.append(s)
    s_q, s_k = ss
    r = torch.sqrt(s_q[:, None] ** 2 + s_k[None, :] ** 2)
    return GaugeComplement(perps, rows, (us[0], us[1]), s_k[None, :] / r, s_q[:, None] / r)


class Preconditioner(Operator):
    """Block-diagonal T over a column layout: Kronecker blocks L (x) W (columns (b, c), c over
    W's size, row-major), dense blocks T = R^{-1} (R upper triangular) and diagonal ones
    T = diag(1/s) (a Jacobi preconditioner, given as s), in column order. ``T @ v``, ``T.T @ v``,
    ``a @ T``, ``T.solve(v)``, ``T.T.solve(v)`` and ``T.solve(a, left=False)`` (a T^{-1})."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, int, tuple[torch.Tensor, ...]]] = []  # (kind, size, matrices)

    def add_kron(self, lb: torch.Tensor, w: torch.Tensor) -> None:
        """T = L (x) W."""
        mats = (lb, w, torch.linalg.inv(lb), torch.linalg.inv(w))
        self.parts.append(("kron", lb.shape[0] * w.shape[0], mats))

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

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:  # T v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[0], mats[1], x)
            if kind == "diag":
                return x / mats[0][:, None]
            return torch.linalg.solve_triangular(mats[0], x, upper=True)

        return self._each(v, fn)

    def matmul_t(self, v: torch.Tensor) -> torch.Tensor:  # T^T v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[0].T, mats[1].T, x)
            if kind == "diag":
                return x / mats[0][:, None]
            return torch.linalg.solve_triangular(mats[0].T, x, upper=False)

        return self._each(v, fn)

    def solve(self, v: torch.Tensor, left: bool = True) -> torch.Tensor:  # T^{-1} v, or v T^{-1}
        if not left:
            return self._right(v, inverse=True)

        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[2], mats[3], x)
            return x * mats[0][:, None] if kind == "diag" else mats[0] @ x

        return self._each(v, fn)

    def solve_t(self, v: torch.Tensor) -> torch.Tensor:  # T^{-T} v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[2].T, mats[3].T, x)
            return x * mats[0][:, None] if kind == "diag" else mats[0].T @ x

        return self._each(v, fn)

    def __rmatmul__(self, a: torch.Tensor) -> torch.Tensor:  # a T
        return self._right(a, inverse=False)

    def _right(self, a: torch.Tensor, inverse: bool) -> torch.Tensor:
        """a @ T for a (m, n); a @ T^{-1} with ``inverse``."""
        out, start = [], 0
        for kind, n, mats in self.parts:
            block = a[:, start : start + n]
            if kind == "kron":
                lb, w = mats[2:4] if inverse else mats[:2]
                d, p = lb.shape[0], w.shape[0]
                tmp = (block.reshape(-1, p) @ w).reshape(-1, d, p)  # input side, then the output side
                tmp = (lb.T @ tmp).reshape(a.shape[0], n)  # in place: no transposed copies
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


def output_whitening(a: torch.Tensor, d: int, rows: int = 64) -> torch.Tensor:
    """L with (a reshaped (m, d, p)) contracted over rows and c having unit Gram on b: the
    Kronecker preconditioner's output side (the inverse Cholesky factor, transposed)."""
    return inverse_cholesky_t(sum_over_inputs(a, a, d, rows))


def kron_preconditioner(blocks: list[torch.Tensor], d: int, x: torch.Tensor) -> Preconditioner:
    """L_b (x) W over formed blocks side by side: each block's output whitening, and the probe
    input's whitening W, the same for every block."""
    t, w = Preconditioner(), input_whitening(x)
    for block in blocks:
        t.add_kron(output_whitening(block, d), w)
    return t


def dense_whitening(a: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
    """R with a R^{-1} having unit Gram (shifted Cholesky: a preconditioner need not be exact);
    ``g``: a^T a when the caller has it (e.g. from a family's structure)."""
    return shifted_cholesky(gram(a) if g is None else g, 1e-10)[0]


DENSE_PRECONDITIONER_MAX = 1536  # larger mixed blocks get a diagonal (Jacobi) preconditioner


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


def whitened(
    columns: torch.Tensor,
    product: Callable[[torch.Tensor], torch.Tensor] | None,
    columns_gram: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, columns R^-1) for the dense preconditioner R of ``columns``; through ``product`` (M ->
    columns M by the family's structure) when given: linear attention's statistics apply R^-1 in
    T d^2 r flops where the triangular solve on the formed columns takes T d r^2 / 2, and give R's
    Gram through their own (``columns_gram``)."""
    r = dense_preconditioner(columns, columns_gram)
    if r.dim() == 1:  # Jacobi: the columns scaled
        return r, columns / r
    if product is None:
        return r, torch.linalg.solve_triangular(r, columns, upper=True, left=False)
    eye = torch.eye(r.shape[0], dtype=r.dtype, device=r.device)
    return r, product(torch.linalg.solve_triangular(r, eye, upper=True))


def input_rotation(null: torch.Tensor, d: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One block's input side split by its null directions: (V_perp, V_par, their number)."""
    k = null.shape[1]
    if not k:
        return torch.eye(dim, dtype=null.dtype, device=null.device), null.new_zeros(dim, 0), 0
    v_par, v_perp = nullspace.row_space(null.T.reshape(k * d, dim))
    return v_perp, v_par, k


def complement(reflectors: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """The last n - k columns of the Householder Q of a (n, k) matrix's ``geqrf``: an orthonormal
    basis of its columns' orthogonal complement (Q applied to [0; I]: ~2/3 of forming all of Q)."""
    n, k = reflectors.shape
    eye = torch.zeros(n, n - k, dtype=reflectors.dtype, device=reflectors.device)
    eye[k:] = torch.eye(n - k, dtype=reflectors.dtype, device=reflectors.device)
    return torch.ormqr(reflectors, tau, eye, left=True, transpose=False)


class DeflatedRows(Operator):
    """(U^T (x) I_d) [J B | D] for J (T d, n) given by its factored column blocks, U (T, r) (None: I),
    B a ``GaugeComplement`` (None: every coordinate kept) and D optional dense columns (T d, r_D;
    only with U = None), as an operator: exact rows without forming them (``dense`` does, for a
    Householder QR or svdvals). The whole head's rows after the value elimination, or factored
    blocks next to a family's dense columns."""

    def __init__(
        self,
        blocks: list[Factored],
        u: torch.Tensor | None,
        d: int,
        basis: GaugeComplement | None,
        columns: torch.Tensor | None = None,
    ) -> None:
        self.blocks, self.u, self.d, self.basis, self.columns = blocks, u, d, basis, columns
        self.n = basis.n if basis is not None else sum(d * b.right.shape[-1] for b in blocks)
        extra = 0 if columns is None else columns.shape[1]
        self.shape = (blocks[0].left.shape[0] * d if u is None else u.shape[1] * d, self.n + extra)

    def _rotate(self, m: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        if u is None:
            return m
        return (u.T @ m.reshape(u.shape[0], -1)).reshape(u.shape[1] * self.d, -1)

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        n = self.n
        full = v[:n] if self.basis is None else self.basis @ v[:n]
        out, size = None, full.shape[0] // len(self.blocks)
        for i, b in enumerate(self.blocks):
            part = b @ full[i * size : (i + 1) * size]
            out = part if out is None else out + part
        if self.columns is not None:
            out = torch.addmm(out, self.columns, v[n:])
        return self._rotate(out, self.u)

    def matmul_t(self, y: torch.Tensor) -> torch.Tensor:
        back = y if self.u is None else self._rotate(y, self.u.T)  # U (x) I: back to the token rows
        out = torch.cat([b.T @ back for b in self.blocks])
        out = out if self.basis is None else self.basis.T @ out
        return out if self.columns is None else torch.cat([out, self.columns.T @ back])

    def dense(self) -> torch.Tensor:
        rows = self.blocks[0].left.shape[0] * self.d
        full = torch.cat([self._rotate(b.dense().reshape(rows, -1), self.u) for b in self.blocks], 1)
        out = full if self.basis is None else (self.basis.T @ full.T).T
        return out if self.columns is None else torch.cat([out, self.columns], 1)


def materialised(rows: torch.Tensor | DeflatedRows) -> torch.Tensor:
    return rows.dense() if isinstance(rows, DeflatedRows) else rows


def block_grams(fs1: list[Factored], fs2: list[Factored] | None, like: torch.Tensor) -> torch.Tensor:
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
            g[rows, cols] = _self_gram(fi) if sym and j == i else cross_gram(fi, fs2[j])
            if sym and j != i:
                g[cols, rows] = g[rows, cols].T
    return g


def _self_gram(f: Factored) -> torch.Tensor:
    """J^T J of a factored block, kept in its cache: the preconditioned factors of a block with
    every coordinate kept are shared by its scopes (``_kept_factor``), so the whole head and the
    block alone read the same Gram."""
    if "self_gram" not in f.cache:
        f.cache["self_gram"] = cross_gram(f, f)
    return f.cache["self_gram"]


def _cross_grams(pre: list[Factored], columns: torch.Tensor | None = None) -> torch.Tensor:
    """[J_1 .. J_n | D]^T [J_1 .. J_n | D] for factored blocks J_b and optional dense columns D,
    every block J_b^T J_b' and J_b^T D through the factors."""
    g = block_grams(pre, None, pre[0].left)
    if columns is None:
        return g
    across = torch.cat([f.T @ columns for f in pre])
    # filled in place: nested cats copied every block twice
    n = g.shape[0]
    out = g.new_empty(n + columns.shape[1], n + columns.shape[1])
    out[:n, :n], out[:n, n:], out[n:, :n], out[n:, n:] = g, across, across.T, gram(columns)
    return out


def kept_coordinates(fs: list[Factored], x: torch.Tensor) -> tuple[Preconditioner, list[Factored]]:
    """Factored blocks with every coordinate kept: their Kronecker preconditioner L_b (x) W and the
    preconditioned factors."""
    t, pre = Preconditioner(), []
    for f in fs:
        lb, w, p = _kept_factor(f, x)
        t.add_kron(lb, w)
        pre.append(p)
    return t, pre


def _kept_factor(f: Factored, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Factored]:
    """(L_b, W, the factors of J (L_b (x) W)) of a block with every coordinate kept, formed once
    per probe input (kept in its cache): the whole head and the block alone share them, and with
    them the block's Gram (``_self_gram``)."""
    cached = f.cache.get("kept")
    if cached is None or cached[0] is not x:
        lb, w = output_side(f), input_whitening(x)
        f.cache["kept"] = cached = (x, lb, w, preconditioned(f, lb, w))
    return cached[1:]


def factored_kept(
    fs: list[Factored],
    columns: torch.Tensor | None,
    d: int,
    x: torch.Tensor,
    product: Callable[[torch.Tensor], torch.Tensor] | None = None,
    columns_gram: Callable[[], torch.Tensor] | None = None,
) -> tuple[list[DeflatedRows], Preconditioner, torch.Tensor]:
    """A scope whose coordinates are all kept (its null directions regularised) and whose blocks
    all come as factors, next to optional dense columns (a family's support columns, e.g. linear
    attention's whole head): its exact rows as an operator, its preconditioner (L_b (x) W per
    block, R_D for the columns) and the preconditioned Gram from the factors (``_cross_grams``:
    T d^2 D'^2 per pair of blocks and T d (d + D') r_D against the columns, where the formed rows'
    Gram costs T d n^2). No cancellation: the same sums as the formed rows' Gram, in another order."""
    t, pre = kept_coordinates(fs, x)
    scaled = None
    if columns is not None:
        r, scaled = whitened(columns, product, columns_gram)
        t.add_dense(r)
    rows = [DeflatedRows(fs, None, d, None, columns)]
    return rows, t, _cross_grams(pre, scaled)


def factored_scope(
    f: Factored, null: torch.Tensor, d: int, dim: int, x: torch.Tensor
) -> tuple[list[DeflatedRows], Preconditioner, torch.Tensor, torch.Tensor | None]:
    """A single block given as factors: its exact rows (an operator), Kronecker preconditioner and
    preconditioned Gram formed from the factors (``cross_gram``) and the null directions left to
    regularise. When every null direction is input-side (u w^T: the par
    coordinates entirely null) they are deflated by rotating the input side (None left); otherwise
    the whole block is kept (``factored_kept``) and all of them are returned (an orthonormal basis)."""
    v_perp, v_par, k = input_rotation(null, d, dim)
    if k != d * v_par.shape[1]:
        return (*factored_kept([f], None, d, x), orthonormal_basis(null))
    # the par input coordinates carry null directions only (J vanishes there), so the output side
    # over v_perp is the block's own; its input side rotated to v_perp and whitened
    lb, w = output_side(f), input_whitening(x @ v_perp)
    pre = preconditioned(f, lb, v_perp @ w)
    t = Preconditioner()
    t.add_kron(lb, w)
    on_perp = preconditioned(f, None, v_perp)  # J (I (x) V_perp): the par coordinates dropped
    return [DeflatedRows([on_perp], None, d, None)], t, cross_gram(pre, pre), None


# Grams from per-token factors. A block's rows (i, a) for token i and columns (b, c) (a d x D'
# weight, row-major) come from the family as ``Factored``: token i's d x (d p) row block is
# ``query_local``: J_i[a, (b, c)] = G_i[a, b] x_i[c], or ``outer``: J_i[a, (b, c)] = q_i[b] R_i[a, c].
# Every product below is a sum over tokens of d x p pieces, so it costs T d^2 p^2 flops where the
# dense block's costs T d (d p)^2, and keeps nothing of size T x d x d p. A block's low-rank
# correction E Z (rank r) adds products through its r columns: ~T d p r + (d p)^2 r.


def inverse_cholesky_t(g: torch.Tensor) -> torch.Tensor:
    """L with L^T g L = I (up to a 1e-12 relative shift): a Kronecker factor's output side."""
    g = g + 1e-12 * g.diagonal().mean() * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
    return torch.linalg.inv(torch.linalg.cholesky(g)).T


def output_side(f: Factored) -> torch.Tensor:
    """L_b whitening the block's output side: the inverse Cholesky factor (transposed) of
    sum_i,a,c J[(i, a), (b, c)] J[(i, a), (b', c)]. A sum over the inputs, so any rotation of them
    keeps it: formed once per block (kept in its cache) for every scope that preconditions it."""
    if "output_side" not in f.cache:
        f.cache["output_side"] = _output_side(f)
    return f.cache["output_side"]


def _output_side(f: Factored) -> torch.Tensor:
    if f.kind == "query_local":
        g_left = f.left.transpose(1, 2) @ f.left  # G_i^T G_i
        m = torch.einsum("ibe,i->be", g_left, f.right.square().sum(1))
    else:
        m = torch.einsum("ib,ie,i->be", f.left, f.left, f.right.square().sum((1, 2)))
    if f.low_rank is not None:  # + the same sum over c of Z^T V + V^T Z (see ``cross_gram``)
        z = f.low_rank[1]
        zv = sum_over_inputs(z.reshape(z.shape[0], -1), _correction_products(f)[1], z.shape[1])
        m = m + zv + zv.T
    return inverse_cholesky_t(m)


def sum_over_inputs(a: torch.Tensor, b: torch.Tensor, d: int, rows: int = 64) -> torch.Tensor:
    """sum_j,c a[j, (b, c)] b[j, (e, c)] for a, b (r, d p) in the (b, c) column layout: summed over
    chunks of rows, each transposed to (d, rows p) while in cache (not one product of the whole
    (d, r p) transposed copies, a batched product or an einsum: docs/benchmarks.md, "Speed paths in
    the probe")."""

    def chunk(m: torch.Tensor, start: int) -> torch.Tensor:
        return m[start : start + rows].reshape(-1, d, m.shape[1] // d).transpose(0, 1).reshape(d, -1)

    out = a.new_zeros(d, d)
    for start in range(0, a.shape[0], rows):
        a2 = chunk(a, start)
        out.addmm_(a2, (a2 if b is a else chunk(b, start)).T)
    return out


def preconditioned(f: Factored, lb: torch.Tensor | None, w: torch.Tensor) -> Factored:
    """The factors of J (L_b (x) W) (``lb`` None: J (I (x) W)): the output side multiplies the
    weight rows, W the inputs."""
    left = f.left if lb is None else f.left @ lb  # G_i L / q_i^T L, and x_i^T W / R_i W
    low_rank = None
    if f.low_rank is not None:  # Z_j -> L^T Z_j W
        mix, z = f.low_rank
        d = z.shape[1]
        low_rank = (mix, kron_right(z.reshape(z.shape[0], -1), lb, w, d).view(z.shape[0], d, -1))
    out = Factored(f.kind, left, f.right @ w, low_rank)
    if "correction" in f.cache:  # E^T (B (L (x) W)) = (E^T B) (L (x) W), and E^T E Z alike: ~1/3
        out.cache["correction_of"] = (f.cache["correction"], lb, w)  # of their cost from the factors
    return out


def _correction_products(f: Factored) -> tuple[torch.Tensor, torch.Tensor]:
    """(E^T B, V = E^T B + E^T E Z / 2), each (r, d p), for a corrected block J = B + E Z: every Gram
    with the block needs them (its own: J^T J = B^T B + Z^T V + V^T Z), so they are formed once per
    block (kept in its cache)."""
    if "correction" not in f.cache:
        if "correction_of" in f.cache:  # its block's, carried by ``preconditioned``: formed only
            products, lb, w = f.cache.pop("correction_of")  # when asked (most pieces never are)
            d = f.left.shape[-1]
            f.cache["correction"] = tuple(kron_right(c, lb, w, d) for c in products)
        else:
            mix, z = f.low_rank  # type: ignore[misc]
            eb = _mix_t_base(mix, f.base)
            f.cache["correction"] = (eb, mix.cross(mix, z.reshape(z.shape[0], -1), add_to=eb, alpha=0.5))
    return f.cache["correction"]


def _mix_t_base(mix: Mixing, base: Factored) -> torch.Tensor:
    """E^T B for a correction's E and a block's per-token part B (no correction), (r, d p): for
    E = F (x) I_d that is B's rows rotated by F (T m d^2 p flops, nothing of size T d x r formed)."""
    if isinstance(mix, TokenMixing):
        return rows_rotated(base, mix.f)
    return (base.T @ mix.flat).T


def _kron_layout(m: torch.Tensor, d: int, p1: int, p2: int) -> torch.Tensor:
    """[(b, b'), (c, c')] -> [(b, c), (b', c')]."""
    return m.reshape(d, d, p1, p2).permute(0, 2, 1, 3).reshape(d * p1, d * p2)


def _base_cross_gram(f1: Factored, f2: Factored) -> torch.Tensor:
    t, d = f1.left.shape[0], f1.left.shape[-1]
    p1, p2 = f1.right.shape[-1], f2.right.shape[-1]  # the blocks' input widths may differ
    if f1.kind == "outer" and f2.kind == "query_local":
        return _base_cross_gram(f2, f1).T
    if f1.kind == f2.kind == "query_local":  # sum_i (G_i^T G'_i)[b, b'] x_i[c] x'_i[c']
        left = (f1.left.transpose(1, 2) @ f2.left).reshape(t, d * d)
        right = (f1.right[:, :, None] * f2.right[:, None, :]).reshape(t, p1 * p2)
        return _kron_layout(left.T @ right, d, p1, p2)
    if f1.kind == f2.kind == "outer":  # sum_i q_i[b] q'_i[b'] (R_i^T R'_i)[c, c']
        left = (f1.left[:, :, None] * f2.left[:, None, :]).reshape(t, d * d)
        right = (f1.right.transpose(1, 2) @ f2.right).reshape(t, p1 * p2)
        return _kron_layout(left.T @ right, d, p1, p2)
    # query_local x outer: sum_i M_i[b, c'] x_i[c] q'_i[b'], M_i = G_i^T R'_i
    m = (f1.left.transpose(1, 2) @ f2.right).reshape(t, d * p2)  # [i, (b, c')]
    n = (f1.right[:, :, None] * f2.left[:, None, :]).reshape(t, p1 * d)  # [i, (c, b')]
    return (m.T @ n).reshape(d, p2, p1, d).permute(0, 2, 3, 1).reshape(d * p1, d * p2)


def cross_gram(f1: Factored, f2: Factored) -> torch.Tensor:
    """J1^T J2 over all tokens, (d p1) x (d p2). With corrections J = B + E Z:
    B1^T B2 + Z1^T (E1^T B2 + E1^T E2 Z2) + (B1^T E2) Z2, the products with one E taken from the
    block that shares it (``_correction_products``) when both blocks have the same E."""
    g = _base_cross_gram(f1.base, f2.base)
    if f1 is f2 and f1.low_rank is not None:  # J^T J = B^T B + Z^T V + (Z^T V)^T, V = E^T B + E^T E Z / 2
        z2 = f1.low_rank[1].reshape(f1.low_rank[1].shape[0], -1)
        zv = z2.T @ _correction_products(f1)[1]
        return g.add_(zv).add_(zv.T)  # (g is this call's own: no n x n temporaries)
    mix1 = None if f1.low_rank is None else f1.low_rank[0]
    mix2 = None if f2.low_rank is None else f2.low_rank[0]
    shared = mix1 is not None and mix1 is mix2
    if mix1 is not None:
        z1 = f1.low_rank[1]  # type: ignore[index]
        if shared:  # E^T B2 + E^T E Z2 = 2 V2 - E^T B2
            eb2, v2 = _correction_products(f2)
            v = v2.mul(2.0).sub_(eb2)
        else:
            v = _mix_t_base(mix1, f2.base)
            if mix2 is not None:
                z2 = f2.low_rank[1]  # type: ignore[index]
                v = v + mix1.cross(mix2, z2.reshape(z2.shape[0], -1))
        g = g.addmm_(z1.reshape(z1.shape[0], -1).T, v)
    if mix2 is not None:
        z2 = f2.low_rank[1]  # type: ignore[index]
        eb1 = _correction_products(f1)[0] if shared else _mix_t_base(mix2, f1.base)
        g = g.addmm_(eb1.T, z2.reshape(z2.shape[0], -1))
    return g


def rows_rotated(f: Factored, u: torch.Tensor) -> torch.Tensor:
    """(U^T (x) I_d) J: rows (m, a) = sum_i U[i, m] J[(i, a), :] for U (T, r), as (r d) x (d p)."""
    t, d = f.left.shape[0], f.left.shape[-1]
    p, r = f.right.shape[-1], u.shape[1]
    if f.kind == "query_local":  # sum_i U[i, m] x_i[c] G_i[a, b]
        z = (u[:, :, None] * f.right[:, None, :]).reshape(t, r * p)
        out = (z.T @ f.left.reshape(t, d * d)).reshape(r, p, d, d)  # [m, c, a, b]
        out = out.permute(0, 2, 3, 1).reshape(r * d, d * p)
    else:
        z = (u[:, :, None] * f.left[:, None, :]).reshape(t, r * d)  # sum_i U[i, m] q_i[b] R_i[a, c]
        out = (z.T @ f.right.reshape(t, d * p)).reshape(r, d, d, p)  # [m, b, a, c]
        out = out.permute(0, 2, 1, 3).reshape(r * d, d * p)
    if f.low_rank is not None:  # ((U^T (x) I) E) Z
        mix, zc = f.low_rank
        out = out + mix.rotated(u) @ zc.reshape(zc.shape[0], -1)
    return out
