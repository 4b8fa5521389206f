"""A scope's coordinates off its null space (step 3 of ``spectrum``), in the blocks' Kronecker
layout: each block's input side rotated so that the null directions live in a few input
coordinates, only those replaced by an orthonormal complement (``Deflation``; formed rows:
``deflate_columns``), and the exact rows on those coordinates as an operator through a family's
factors (``DeflatedRows``), never formed unless a fallback needs them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lra_cond.conditioning import factored, gauge
from lra_cond.conditioning.families.base import Factored
from lra_cond.conditioning.preconditioner import (
    Preconditioner,
    dense_preconditioner,
    input_whitening,
    output_whitening,
)
from lra_cond.linalg import matvec


def input_rotation(null: torch.Tensor, d: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One block's input side split as in ``deflate_columns``: (V_perp, V_par, null directions)."""
    k = null.shape[1]
    if not k:
        return torch.eye(dim, dtype=null.dtype, device=null.device), null.new_zeros(dim, 0), 0
    v_par, v_perp = gauge.row_space(null.T.reshape(k * d, dim))
    return v_perp, v_par, k


@dataclass
class Deflation:
    """An orthonormal basis B of N^perp in a Kronecker layout: per block, the input side rotated
    (``perp`` (D', p_b): coordinates free of null directions, kept as they are; ``par`` (D', s_b):
    the null directions' input span), and ``comp`` (sum_b d s_b, n_c): an orthonormal complement
    of the null directions inside the par coordinates (a tensor, or an operator with ``shape``,
    ``@`` and ``.T``: ``gauge.ComplementColumns``). Columns: every block's perp coordinates
    (d x p_b each), then the complement."""

    perp: list[torch.Tensor]
    par: list[torch.Tensor]
    comp: torch.Tensor | gauge.ComplementColumns
    d: int

    @property
    def n(self) -> int:
        return sum(self.d * p.shape[1] for p in self.perp) + self.comp.shape[1]

    def apply(self, v: torch.Tensor) -> torch.Tensor:  # B v: deflated -> full coordinates
        d, k = self.d, v.shape[1]
        n_perp = sum(d * p.shape[1] for p in self.perp)
        par = rows_product(self.comp, v[n_perp:])
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
        return torch.cat([*perps, rows_product(self.comp.T, torch.cat(pars))])


def deflation(null: torch.Tensor, d: int, dim: int, n_blocks: int) -> Deflation:
    """The Deflation of ``null`` (n_blocks d D' x k, the blocks' Kronecker layout)."""
    size, k = d * dim, null.shape[1]
    if not k:
        eye = torch.eye(dim, dtype=null.dtype, device=null.device)
        return Deflation([eye] * n_blocks, [eye[:, :0]] * n_blocks, null.new_zeros(0, 0), d)
    perps, pars, null_par = [], [], []
    for i in range(n_blocks):
        nb = null[i * size : (i + 1) * size]
        v_perp, v_par, _ = input_rotation(nb, d, dim)
        perps.append(v_perp)
        pars.append(v_par)
        null_par.append((nb.T.reshape(k, d, dim) @ v_par).reshape(k, -1).T)
    return Deflation(perps, pars, complement(*torch.geqrf(torch.cat(null_par))), d)


def complement(reflectors: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """The last n - k columns of the Householder Q of a (n, k) matrix's ``geqrf``: an orthonormal
    basis of its columns' orthogonal complement (Q applied to [0; I]: ~2/3 of forming all of Q)."""
    n, k = reflectors.shape
    eye = torch.zeros(n, n - k, dtype=reflectors.dtype, device=reflectors.device)
    eye[k:] = torch.eye(n - k, dtype=reflectors.dtype, device=reflectors.device)
    return torch.ormqr(reflectors, tau, eye, left=True, transpose=False)


class DeflatedRows:
    """(U^T (x) I_d) [J B | D] for J (T d, n) given by its factored column blocks, U (T, r) (None: I),
    B a ``Deflation`` (or ``MetricDeflation``) and D optional dense columns (T d, r_D; only with
    U = None), as an operator: exact rows without forming them (``dense`` does, for a Householder
    QR or svdvals). The whole head's rows after the value elimination, a factored block's rows on
    its deflated coordinates, or factored blocks next to a family's dense columns."""

    def __init__(
        self,
        blocks: list[Factored],
        u: torch.Tensor | None,
        d: int,
        basis: Deflation | MetricDeflation,
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


class MetricDeflation:
    """``Deflation`` whose first ``n_q`` coordinates carry a metric M: B = B_0 diag(M^(-1/2), I)
    (``gauge.OrthogonalGaugeComplement``: orthonormal coordinates of J's restriction)."""

    def __init__(self, base: Deflation, metric: gauge.MetricRoot, n_q: int) -> None:
        self.base, self.metric, self.n_q, self.n = base, metric, n_q, base.n

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        return self.base.apply(torch.cat([self.metric.inverse_root(v[: self.n_q]), v[self.n_q :]]))

    def apply_t(self, v: torch.Tensor) -> torch.Tensor:
        out = self.base.apply_t(v)
        return torch.cat([self.metric.inverse_root(out[: self.n_q]), out[self.n_q :]])


def rows_product(
    m: torch.Tensor | DeflatedRows | _Transposed | gauge.ComplementColumns, v: torch.Tensor
) -> torch.Tensor:
    """m @ v for a dense matrix (either layout, ``matvec``) or an operator."""
    return matvec(m, v) if isinstance(m, torch.Tensor) else m @ v


def materialised(rows: torch.Tensor | DeflatedRows) -> torch.Tensor:
    return rows.dense() if isinstance(rows, DeflatedRows) else rows


def deflate_columns(
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
        v_perp, v_par, _ = input_rotation(nb, d, dim)
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
            comp = complement(reflectors, tau)
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
            t.add_kron(output_whitening(out[0][:, col : col + wp], d), input_whitening(x @ rot[:, :p]))
            col += wp
    if n_c:
        t.add_dense(dense_preconditioner(out[0][:, n_perp:]))
    return out, t
