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
3. **Null space: deflated or regularised.** The whole head's null space (the gauge: ~1/3 of its columns;
   normalized attention's orthogonal gauge, ~1/8, by a complement that is not orthogonal, its metric in
   the preconditioner: ``whole_head._factored_head_orthogonal``, else regularised as below:
   ``whole_head._factored_head_kept``) is deflated by orthogonal transformations
   (``deflation.deflate_columns``): every block's input side is rotated so that the null directions live
   in a few input coordinates, and only those are replaced by their complement. A scope with few null
   directions (k <= n / 4, ``REGULARISE_RATIO``: most blocks alone, linear attention's whole head,
   normalized attention's) keeps every coordinate and its Kronecker preconditioner, and the null space
   is regularised instead: G' + beta Q_B Q_B^T, Q_B an orthonormal basis of T^T N, is positive definite
   and equals T^T (J^T J + N Z N^T) T, which is J^T J on N^perp and maps N to itself (Q_B Q_B^T, the
   projector onto T^T N, comes in closed form for a group of the gauge's form: normalized attention's
   rotations, ``gauge.GaugeProjector``). Lanczos and Rayleigh-Ritz vectors are projected onto N^perp, so
   the regularised eigenvalues never enter. (Deflating a block with a non-input-side null, e.g.
   normalized attention's scale W_Q, would turn all of W_Q's row space into dense columns: a Householder
   pass, a dense preconditioner and a triangular solve over every row, ~30% of such a probe.)
4. **Extremes by block Lanczos** on R^T R (sigma_max^2, its R' part through the Gram R' factors,
   one pass instead of two; on the exact J^T J instead where a family's factors give the whole
   head's rows as one cheap operator) and on (R^T R)^{-1} (1/sigma_min^2, by triangular solves:
   sigma_min keeps its own relative accuracy).
5. **A check with the exact J.** The Rayleigh quotient ||J u|| / ||u|| of the sigma_min vector
   must match sigma_min (``extremes._check``, to its own rounding level ~eps sqrt(n) kappa). If the Gram
   lost it, or the check is too coarse to tell (kappa above ~1e6), sigma_min is taken from the exact J:
   preconditioned Rayleigh-Ritz on J^T J with the factor's inverse Gram as the preconditioner,
   from the factor's vector (``extremes._refined_sigma_min``; every iterate an upper bound, exact to
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
complement, the deflation by congruence, ``whole_head.factored_head``), the exact rows stay an operator
(``deflation.DeflatedRows``), and because a Schur complement cancels, sigma_min is always taken from the
exact J by the Rayleigh-Ritz step of 5 (measured: a normalized-attention head at kappa 2.6e8
whose Schur-complement sigma_min was 1.8e-3 off, refined to Householder QR's value to 1e-10);
when that does not settle, the Gram is formed from the exact rows (no cancellation) before
Householder QR is tried. A scope with few null directions whose blocks all come as factors
(next to a family's dense columns or not: linear attention's whole head, normalized's Q or K
alone) has its Gram formed from them the same way, without a Schur complement
(``factored_scopes.factored_kept``).

If a null value is left that the verified groups do not explain (sigma_min <= rtol * sigma_max),
the scope falls back to an exact svdvals of J on N^perp and counts the extra nulls.

This module takes each scope to its route (``head_spectra``); the steps live in their own modules,
each importing only those before it: ``preconditioner`` (2), ``deflation`` (3: the coordinates and
the exact rows as an operator), ``extremes`` (4, 5: the factor, Lanczos, the check, the refinement
and the fallbacks), ``factored_scopes`` (scopes whose blocks all come as factors) and
``whole_head`` (the whole head from factors, the value block as a Schur complement).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lra_cond.conditioning import extremes, factored_scopes, gauge, whole_head
from lra_cond.conditioning.deflation import deflate_columns
from lra_cond.conditioning.extremes import REGULARISE_RATIO, Extremes
from lra_cond.conditioning.families.base import Factored, ValueBlock
from lra_cond.conditioning.gauge import NullStructure
from lra_cond.conditioning.head_jacobian import HeadJacobian
from lra_cond.conditioning.preconditioner import (
    Preconditioner,
    dense_preconditioner,
    input_whitening,
    output_whitening,
    whitened,
)
from lra_cond.conditioning.whole_head import GaugePart, Head
from lra_cond.linalg import gram, normal_draws, orthonormal_basis, spectrum_cut, svdvals


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
    # the group span the null space): its regulariser in closed form (``whole_head._gauge_regulariser``)
    gauge_part: GaugePart | None = None


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
    on ``jac``): the probe asks for it scope by scope (the full SVD alone took 1.3 s at 4096 tokens)."""
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
                    closed = gauge.complement(null.structure, a_blocks, null_a.shape[1], d, dim)
                part = None  # a gauge-form group's columns among null_a ([Q | K] blocks only)
                if null.gauge_part is not None and a_blocks == ["q", "k"]:
                    part = (null.gauge_part[0], null.gauge_part[1][~v_part])
                problem = Head(fs, u, r_y, s_y, null_a, x_real, verified, rtol, method)
                out[scope] = whole_head.factored_head(problem, closed, part)
                continue
            (main, coupling), t = deflate_columns(
                [[rows_of(b)[1] for b in a_blocks], [rows_of(b)[0] for b in a_blocks]], d, dim, null_a, x_real
            )
            value = (s_y[:r_y].repeat_interleave(d), coupling)
            out[scope] = extremes.solve([main], t, value, verified, rtol, method)
            continue
        if scope in factors and sb == [scope] and not extra:  # one factored block
            exact, t, g, left_null = factored_scopes.factored_scope(factors[scope], basis, d, dim, x_real)
            out[scope] = extremes.solve(exact, t, None, verified, rtol, method, g=g, null=left_null)
            continue
        raw = [jac.block(b) for b in sb] + extra
        if basis.shape[1] * REGULARISE_RATIO <= basis.shape[0]:  # few nulls: every coordinate kept
            null_q = orthonormal_basis(basis)
            if sb and all(b in factors for b in sb):  # the Gram from the factors, no rows formed
                fs = [factors[b] for b in sb]
                rows, t, g = factored_scopes.factored_kept(
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
