"""The probe's routes: which coordinates, preconditioner and Gram each scope takes to step 4
(``head_spectra``, one head at a time). Every route ends in ``extremes.solve``, except the value
block alone, which is exact in closed form.

In order, the first that applies:

1. **V alone**, the family gives V as Y (x) I_d: every singular value of Y, d times, exact
   (``_value_extremes``).
2. **Whole head, V eliminated, Q and K as factors** (softmax, normalized, nystrom):
   ``factored_head``: the Gram from the factors, V as a Schur complement, the null space deflated
   by congruence (the gauge's complement in closed form where it applies) or regularised;
   sigma_min always refined on the exact J.
3. **Whole head, V eliminated, dense Q and K** (forward-mode AD): rows rotated by [Q_Y, Q_perp],
   V's block eliminated exactly, the rest deflated (``coordinates.deflate_columns``).
4. **One block given as factors** (Q or K alone): ``coordinates.factored_scope``, its input-side
   nulls deflated, else every coordinate kept and the nulls regularised.
5. **Few nulls** (k <= n / 4: linear's whole head, most blocks alone): every coordinate kept, the
   nulls regularised, G' + beta Q_B Q_B^T (``coordinates.factored_kept`` from factors, else the
   formed columns).
6. **Anything else**: the null space deflated from the formed columns
   (``coordinates.deflate_columns``).

**The value block in closed form.** For every A = P V family the V block is Y (x) I_d (Y = P X),
checked numerically. Rotating rows by [Q_Y | Q_perp]^T (x) I (Q_Y from the SVD of Y) and the V
columns by V_Y gives J = [[diag(s_Y) (x) I, C], [0, P_perp J_A]]: the value block is eliminated
exactly, and only the projected rest P_perp J_A goes further. Needs every null group to lie in V
alone or outside V (checked); otherwise V is treated like the other blocks.

**Why the whole head needs its joint Gram.** Preconditioned by the Grams of Q, K and V alone
(block Jacobi), the head's Gram keeps a condition number of 5e7-1.4e11 at the reference shape: the
head's small singular values come from the blocks cancelling one another, so the head's Gram is
formed from the factors jointly, its value block as a Schur complement. Because a Schur complement
cancels, sigma_min is then always taken from the exact J (``extremes.solve``'s ``refine``).

The steps, their sources and the measurements behind each route: docs/conditioning.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lra_cond.conditioning import coordinates, extremes, factored, nullspace
from lra_cond.conditioning.coordinates import (
    DeflatedRows,
    Deflation,
    Preconditioner,
    block_grams,
    deflate_columns,
    deflation,
    dense_preconditioner,
    input_whitening,
    kept_coordinates,
    output_whitening,
    whitened,
)
from lra_cond.conditioning.extremes import REGULARISE_RATIO, Extremes
from lra_cond.conditioning.families.base import Factored, ValueBlock
from lra_cond.conditioning.linearised import HeadJacobian
from lra_cond.conditioning.nullspace import ScopeNull
from lra_cond.linalg import (
    gram,
    normal_draws,
    orthonormal_basis,
    spectrum_cut,
    svdvals,
)


def kron_factor(block: torch.Tensor, d: int) -> torch.Tensor | None:
    """Y (T, D') if ``block`` (rows (i, a), columns (b, c)) is Y (x) I_d, i.e. block[(i, a), (b, c)] =
    delta_ab Y[i, c]; else None."""
    t, dim = block.shape[0] // d, block.shape[1] // d
    y = block.reshape(t, d, d, dim)[:, 0, 0]
    # Checked on random directions (the structure holds exactly or fails by O(1)): one product
    # instead of comparing every entry.
    gen = torch.Generator().manual_seed(0)
    v = normal_draws(gen, d * dim, 2, dtype=block.dtype, device=block.device)
    want = ValueBlock(y, d).apply(v)
    got = block @ v
    return y if bool((got - want).norm() <= 1e-12 * max(float(got.norm()), 1e-300)) else None


def _value_extremes(y: torch.Tensor, d: int, verified: int, rtol: float) -> Extremes:
    """Y (x) I_d: every singular value of Y, d times (exact)."""
    s = svdvals(y)
    smax, smin, n_null, excluded = spectrum_cut(torch.cat([s, s.new_zeros(y.shape[1] - s.numel())]), rtol)
    extra = d * n_null - verified
    notes = [f"{extra} value-block null value(s) beyond the verified ones"] if extra > 0 else []
    return Extremes(smax, smin, max(verified, d * n_null), max(extra, 0), "kron", notes, excluded)


def _value_rotation(
    jac: HeadJacobian, blocks: tuple[str, ...], d: int, rtol: float
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]:
    """(Y, U = [Q_Y | Q_perp], s_Y, rank of Y) when the head's value block is Y (x) I_d (rows rotated
    by U^T (x) I, it becomes diag(s_Y) (x) I), else (None, None, None, 0). Formed once per head (kept
    on ``jac``): the probe asks for it scope by scope (else a full SVD each time)."""
    key = ("value_rotation", tuple(blocks), rtol)
    if key not in jac.cache:
        y = jac.value_factor() if "v" in blocks else None
        if y is None and "v" in blocks:  # a dense value block (forward-mode AD): tested numerically
            y = kron_factor(jac.block("v"), d)
        if y is None:
            jac.cache[key] = (None, None, None, 0)
        else:
            u, s_y, _ = torch.linalg.svd(y, full_matrices=True)
            jac.cache[key] = (y, u, s_y, int((s_y > rtol * s_y[0]).sum()))
    return jac.cache[key]


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
    use them). Blocks' rows rotated for the value elimination are shared by the scopes given
    (``jacobian_condition`` gives one at a time: each scope's reduced columns go before the next
    scope's are built); the rotation itself is formed once per head (``_value_rotation``)."""
    factors = factors or {}
    size = d * dim
    y, u, s_y, r_y = _value_rotation(jac, blocks, d, rtol)
    rotated: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    t_len = jac.shape[0] // d

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
            spans = [(i * size, (i + 1) * size) for i, b in enumerate(sb) if b != "v"]
            keep = torch.cat([torch.arange(a, e, device=basis.device) for a, e in spans])
            null_a = basis[:, ~v_part][keep]  # the null directions outside V, in the other blocks
            if all(b in factors for b in a_blocks):  # the Gram from the factors, no rows formed
                fs = [factors[b] for b in a_blocks]
                closed = None
                if null.structure is not None:
                    closed = coordinates.gauge_complement(null.structure, a_blocks, null_a.shape[1], d, dim)
                problem = Head(fs, u, r_y, s_y, null_a, x_real, verified, rtol, method)
                out[scope] = factored_head(problem, closed)
                continue
            (main, coupling), t = deflate_columns(
                [[rows_of(b)[1] for b in a_blocks], [rows_of(b)[0] for b in a_blocks]], d, dim, null_a, x_real
            )
            value = (s_y[:r_y].repeat_interleave(d), coupling)
            out[scope] = extremes.solve([main], t, value, verified, rtol, method)
            continue
        if scope in factors and sb == [scope] and not extra:  # one factored block
            exact, t, g, left_null = coordinates.factored_scope(factors[scope], basis, d, dim, x_real)
            out[scope] = extremes.solve(exact, t, None, verified, rtol, method, g=g, null=left_null)
            continue
        raw = [jac.block(b) for b in sb] + extra
        if basis.shape[1] * REGULARISE_RATIO <= basis.shape[0]:  # few nulls: every coordinate kept
            null_q = orthonormal_basis(basis)
            if sb and all(b in factors for b in sb):  # the Gram from the factors, no rows formed
                fs = [factors[b] for b in sb]
                rows, t, g = coordinates.factored_kept(
                    fs, extra[0] if extra else None, d, x_real, null.dense_product, null.dense_gram
                )
                out[scope] = extremes.solve(rows, t, None, verified, rtol, method, g=g, null=null_q)
                continue
            t, g = Preconditioner(), None
            for b in raw[: len(sb)]:
                t.add_kron(output_whitening(b, d), input_whitening(x_real))
            if extra and not sb and null.dense_product is not None:  # the columns alone, whitened
                r, scaled = whitened(extra[0], null.dense_product, null.dense_gram)  # by its structure
                t.add_dense(r)
                g = gram(scaled)
            elif extra:
                t.add_dense(dense_preconditioner(extra[0], null.dense_gram))
            rows = [torch.cat(raw, 1)] if len(raw) > 1 else raw
            out[scope] = extremes.solve(rows, t, None, verified, rtol, method, g=g, null=null_q)
            continue
        if y is not None:
            tops, bottoms = zip(*([rows_of(b) for b in sb] + [rotate(e) for e in extra]))
            rows = [list(bottoms), list(tops)]
        else:
            rows = [raw]
        dense = extra[0].shape[1] if extra else 0
        rows, t = deflate_columns(rows, d, dim, basis, x_real, dense=dense)
        out[scope] = extremes.solve(rows, t, None, verified, rtol, method)
    return out


class Head(NamedTuple):
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


def factored_head(
    head: Head,
    closed: coordinates.GaugeComplement | None = None,
) -> Extremes:
    """The whole head when every block but V is given as factors (softmax, normalized, nystrom: Q, K),
    every piece from the factors (the dense route rotates and deflates the head's formed rows):

    * each block's input side rotated to [V_perp | V_par] (``coordinates.deflation``), then preconditioned:
      L_b (x) W_perp on the perp coordinates (their final preconditioner), L_b (x) I on the par;
    * the par coordinates replaced by the complement of the null directions by congruence
      (M = (L_b^{-1} (x) I) comp), whitened by the Cholesky factor of its own Gram; with ``closed``
      (the null space is the gauge and null inputs) the complement's columns come from Q's
      factors transformed by a Kronecker product instead (``coordinates.GaugeComplement.factor``: no
      Householder pass, no congruence, and K meets it only on K's perp coordinates);
    * the value block eliminated as a Schur complement, M^T T^T J_A^T (P_perp (x) I) J_A T M =
      M^T G'_AA M - (C' M)^T (C' M) with C' = (Q_Y^T (x) I) J_A T.

    The exact rows (of the check, the refinement and sigma_max) are an operator through the
    factors, never formed; the value coupling C B is, from the Schur complement's pieces."""
    fs, null = head.fs, head.null
    d, dim, n_b = fs[0].left.shape[-1], fs[0].right.shape[-1], len(fs)
    if closed is not None:
        basis = Deflation(closed.perp, closed.rows, closed.comp(), d)
        if not _spans_null(basis, null):
            closed = None
    if closed is None:
        if null.shape[1] * REGULARISE_RATIO <= null.shape[0]:
            return _factored_head_kept(head)
        basis = deflation(null, d, dim, n_b)
    t_d, h, coupling = _deflated_schur(head, basis, closed)
    return _solve_head(head, basis, t_d, h, coupling, preconditioned=False)


def _deflated_schur(
    head: Head, basis: Deflation, closed: coordinates.GaugeComplement | None
) -> tuple[Preconditioner, torch.Tensor, torch.Tensor]:
    """``factored_head``'s preconditioner T, the value block's Schur complement (preconditioned,
    on the coordinates ``basis``) and the value coupling C B, from the factors."""
    fs, u, r_y, x = head.fs, head.u, head.r_y, head.x
    d = fs[0].left.shape[-1]
    n_c, pcol = basis.comp.shape[1], 0
    # each block split by input side into its perp and its par coordinates, as separate factors
    # (the layout of ``Deflation``: every block's perp ones, then the par ones): every product
    # below lands in that layout, no columns gathered
    t_d, perp_fs, par_fs, m_par = Preconditioner(), [], [], []
    for f, perp, par in zip(fs, basis.perp, basis.par):
        lb = factored.output_side(f)  # a sum over the inputs: any rotation of them keeps it
        if perp.shape[1]:  # (every input direction may carry a null one: then no perp part)
            w_perp = input_whitening(x @ perp)
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
        g_cc = m_par.T @ (block_grams(par_fs, None, x) @ m_par)
        g_pc = block_grams(perp_fs, par_fs, x) @ m_par
        g_pp = block_grams(perp_fs, None, x)
    else:
        comp_f = closed.factor(fs)  # the complement's columns, up to ``closed.scale``
        top_c = closed.scale(factored.rows_rotated(comp_f, u[:, :r_y]))
        g = block_grams([*perp_fs, comp_f], None, x)
        g_pp, g_pc = g[:n_perp, :n_perp], closed.scale(g[:n_perp, n_perp:])
        g_cc = closed.gram(g[n_perp:, n_perp:])
    h, r_c = _schur_whitened(g_pp, g_pc, g_cc, top_perp, top_c)
    t_d.add_dense(r_c)
    # C B formed (its pieces are formed anyway): the inverse Gram's products read it, where the
    # factors' operator re-reads nystrom's larger corrections Z every Lanczos step
    return t_d, h, torch.cat([c_perp, top_c], 1)


def _solve_head(
    head: Head,
    basis: Deflation,
    t: Preconditioner,
    h: torch.Tensor,
    coupling: torch.Tensor,
    preconditioned: bool,
    null: torch.Tensor | None = None,
) -> Extremes:
    """The extremes of a whole head from its value block's Schur complement ``h`` (preconditioned
    by ``t`` on the coordinates ``basis``), the value part diag(s_Y) (x) I_d and its ``coupling``
    (C, or C T when ``preconditioned``: ``extremes._Factor.c_preconditioned``); the exact rows through the
    factors, those of Q_perp and, for sigma_max, [C B; rows] as one operator (``joint``). ``null``:
    null directions left in the coordinates (``extremes.solve``)."""
    fs, u, r_y = head.fs, head.u, head.r_y
    d = fs[0].left.shape[-1]
    rows = [DeflatedRows(fs, u[:, r_y:], d, basis)]
    joint = DeflatedRows(fs, u, d, basis)  # [C B; rows]: u's columns are [Q_Y | Q_perp]
    s = head.s_y[:r_y].repeat_interleave(d)
    value = (s, coupling, True) if preconditioned else (s, coupling)
    # the Schur complement cancels: its rounding is eps ||G'_AA|| (measured 1e-7 of sigma_min at
    # kappa 7.5e8, under the check's threshold), so sigma_min always comes from the exact J
    return extremes.solve(
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
    )


def _schur_whitened(
    g_pp: torch.Tensor, g_pc: torch.Tensor, g_cc: torch.Tensor, top_p: torch.Tensor, top_c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The value block's Schur complement G - C^T C of a Gram G = [[G_pp, G_pc], [., G_cc]] and
    coupling rows C = [C_p | C_c], its complement part whitened by R_c, the Cholesky factor of its
    own block H_cc = G_cc - C_c^T C_c: (H, R_c), H's complement columns and rows times R_c^-1 (that
    block the identity). Where H_cc is not numerically definite, R_c is shifted and H's whitened
    block formed. ``g_pp`` and ``g_cc`` are overwritten."""
    h_cc = gram(top_c, add_to=g_cc, alpha=-1.0)
    r_c, info = torch.linalg.cholesky_ex(h_cc, upper=True)
    cc = torch.eye(h_cc.shape[0], dtype=h_cc.dtype, device=h_cc.device)
    if int(info):
        eye = torch.eye(h_cc.shape[0], dtype=h_cc.dtype, device=h_cc.device)
        r_c = torch.linalg.cholesky_ex(h_cc + 1e-10 * float(h_cc.diagonal().mean()) * eye, upper=True)[0]
        cc = torch.linalg.solve_triangular(
            r_c.T, torch.linalg.solve_triangular(r_c, h_cc, upper=True, left=False), upper=False
        )
    h_pp = gram(top_p, add_to=g_pp, alpha=-1.0)  # in place: no second such matrix
    h_pc = torch.linalg.solve_triangular(
        r_c, torch.addmm(g_pc, top_p.T, top_c, alpha=-1.0), upper=True, left=False
    )
    n_p, n_c = h_pc.shape
    h = h_pp.new_empty(n_p + n_c, n_p + n_c)
    h[:n_p, :n_p], h[:n_p, n_p:], h[n_p:, :n_p], h[n_p:, n_p:] = h_pp, h_pc, h_pc.T, cc
    return h, r_c


def _factored_head_kept(head: Head) -> Extremes:
    """``factored_head`` for a null space without a closed form but with few directions (normalized
    attention's: its orthogonal gauge, ~d^2 / 2 of the 2 d D' columns): every coordinate keeps its
    Kronecker preconditioner L_b (x) W and the null directions (all outside V) are regularised as in
    ``coordinates.factored_kept``. The value block's Schur complement T^T
    G_AA T - C'^T C' is then one Gram of the preconditioned factors less one of their rotated rows, where
    deflating takes a Householder complement and four congruences by it."""
    fs, u, r_y, null, x = head.fs, head.u, head.r_y, head.null, head.x
    d = fs[0].left.shape[-1]
    t, pre, identity = kept_coordinates(fs, d, x)
    top = _rows_rotated(pre, u[:, :r_y], d)  # C' = C T
    h = block_grams(pre, None, x)
    h = gram(top, add_to=h, alpha=-1.0)  # in place: no second 4160^2 matrix
    n_v = r_y * d
    # the null directions in the factor's coordinates [V | A]: none has a V part (``value_split``)
    null_q = torch.cat([null.new_zeros(n_v, null.shape[1]), orthonormal_basis(null)])
    return _solve_head(head, identity, t, h, top, preconditioned=True, null=null_q)


def _spans_null(basis: Deflation, null: torch.Tensor, probes: int = 2) -> bool:
    """Whether the closed-form basis is orthogonal to the verified null directions (random
    combinations of them: a basis built from a wrong structure would not be)."""
    gen = torch.Generator().manual_seed(0)
    v = null @ normal_draws(gen, null.shape[1], probes, dtype=null.dtype, device=null.device)
    return bool(basis.apply_t(v).norm() <= nullspace.GAUGE_RTOL * v.norm())


def _rows_rotated(fs: list[Factored], u: torch.Tensor, d: int) -> torch.Tensor:
    """(U^T (x) I_d) [J_1 .. J_n] for factored blocks (possibly none)."""
    if not fs:
        return u.new_zeros(u.shape[1] * d, 0)
    return torch.cat([factored.rows_rotated(f, u) for f in fs], 1)
