"""Condition number of the attention Jacobian J = d vec(A) / d theta_qkv.

Definition. A is one attention layer's output before ``out_proj`` (heads concatenated) at the real
(unpadded) tokens of a fixed probe input x (the layer's own input, i.e. after its LayerNorm), and
theta_qkv is **every parameter of the q, k and v projections**: weights, and biases where the layer
has them. For a layer without biases this is the paper's d A / d (W_Q, W_K, W_V) for
A(X) = softmax(X W_Q W_K^T X^T / sqrt(d)) X W_V. Why the biases are in: with them held fixed, a
LayerNorm bias beta makes every input row share a component c along 1/gamma, so the weight change
u (1/gamma)^T acts exactly like the bias change c u, and the direction that is null at beta = 0
survives as a singular value proportional to c; kappa then tracks how far beta has moved (measured:
7e3 at beta = 0, 1e11 at beta = 1e-8), not the attention. With the biases in J, it is an exact null
for every beta and kappa is continuous in beta. Linear attention is measured in its eps -> 0
limit, where scaling a sequence's key/value statistics (S, z) together is an exact symmetry
(deflated like the others); with eps > 0 those directions sit at ~eps * sigma_max and set kappa.

J is computed in float64, dropout off, on a ``jacobian_copy`` of the layer (explicit math, the
projections as bias-free maps of the augmented input [x, 1]). It is block diagonal over heads; each
head's block comes from the family's closed form (``families/<family>.py``) or forward-mode AD.
J has an exact null space (``nullspace``: the input's own, and the family's verified symmetries),
so kappa = sigma_max / sigma_min over its orthogonal complement; ``n_null`` says how many directions
were excluded (the verified ones, plus any value <= rtol * sigma_max they do not explain).

The probe, in order (``jacobian_condition``):

1. linearise the layer (``linearised``);
2. find and verify the null space (``nullspace``);
3. build each scope's problem on its complement: coordinates, preconditioner, exact rows as an
   operator (``coordinates``, with the Grams from a family's per-token factors), along the
   route ``head_spectra`` chooses (below);
4. find the extreme singular values (``extremes``: a Cholesky factor of the preconditioned Gram,
   block Lanczos on it and on its inverse);
5. check them against the exact J (``extremes``), and apply one cut for the whole probe here.

Methods:
* ``gram`` (default): the steps above; exact to ~1e-8 relative, with the check against the exact J.
* ``qr``: the same with the factor from Householder QR (more flops, never squares the condition).
* ``dense``: every singular value of every head block by ``svdvals``, null cut at rtol; the
  reference the tests hold the others to, at the cost of a full SVD of every head block.

**The routes** (``head_spectra``, one head at a time): which coordinates, preconditioner and Gram
each scope takes to step 4. Every route ends in ``extremes.solve``, except the value block alone,
which is exact in closed form. In order, the first that applies:

1. **V alone**, the family gives V as Y (x) I_d: every singular value of Y, d times, exact
   (``_value_extremes``).
2. **Whole head, V eliminated** (V is Y (x) I_d and every null group lies in V or outside it).
   The other blocks as factors (softmax, normalized, nystrom: Q and K): ``factored_head``, the
   Gram from the factors, V as a Schur complement, the null space deflated by the gauge's
   complement in closed form where it is the gauge and the null inputs, else regularised;
   sigma_min always refined on the exact J. The other blocks formed (forward-mode AD; nystrom
   where its landmark correction is nearly as wide as the rows): ``formed_head``, V eliminated by
   rotating the formed rows, the rest's null directions regularised.
3. **One block given as factors** (Q or K alone): ``coordinates.factored_scope``, its input-side
   nulls deflated, else every coordinate kept and the nulls regularised.
4. **Anything else** (linear's whole head, blocks alone from forward-mode AD, dense columns):
   every coordinate kept, the null space regularised, G' + beta Q_B Q_B^T (the Gram from the
   factors by ``coordinates.factored_kept`` where every block has them, else from the formed
   columns).

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

The steps and their sources: docs/conditioning.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lra_cond.conditioning import coordinates, extremes, nullspace
from lra_cond.conditioning.coordinates import (
    DeflatedRows,
    GaugeComplement,
    Preconditioner,
    block_grams,
    dense_preconditioner,
    input_whitening,
    kept_coordinates,
    kron_preconditioner,
    whitened,
)
from lra_cond.conditioning.extremes import SpectrumSummary
from lra_cond.conditioning.families.base import Factored, ValueBlock
from lra_cond.conditioning.linearised import HeadJacobian, LinearisedLayer, linearise, weight_conditions
from lra_cond.conditioning.nullspace import ScopeNull, scope_nulls, snap_input
from lra_cond.errors import UserError
from lra_cond.linalg import (
    RANK_RTOL,
    gram,
    normal_draws,
    orthonormal_basis,
    shifted_cholesky,
    spectrum_cut,
    svdvals,
)
from lra_cond.models.attention.base import Attention

METHODS = ("gram", "qr", "dense")
# Exact null singular values come out of float64 svdvals at <= ~4e-16 sigma_max (measured on every
# family's probes); genuine small ones reach down to ~2.5e-13 sigma_max: linear attention, whose
# query features pass near 0 at some token (phi = exp(q) vs q + 1 differ by ~q^2 / 2 there), has
# kappa 1e10-4e12 at init and during training. 1e-13 sits in that gap (1e-11 cut into it).
DEFAULT_RTOL = 1e-13
# A cut closer than this (decades) to the largest value it excluded does not separate the spectrum:
# kappa then moves with rtol and with tiny weight changes (a value crossing the cut), and the probe
# says so (``cut_separated``; docs/conditioning.md, "When the cut is not separated").
SEPARATION_MIN = 1.0
UNSEPARATED = "no separated cut: kappa depends on where rtol falls in a continuous spectrum"
DEFINITION = (
    "kappa of d A / d (W_Q, b_Q, W_K, b_K, W_V, b_V) over the orthogonal complement of its verified "
    "null space; A = attention output before out_proj at the probe's real tokens; float64, eval, "
    "explicit math; linear attention at eps -> 0"
)


@dataclass
class JacobianCondition:
    """Result of :func:`jacobian_condition`. ``kappa`` is None when ``reason`` says why."""

    kappa: float | None
    sigma_max: float | None
    sigma_min: float | None
    n_null: int
    rtol: float
    method: str
    blocks: str
    n_params: int
    n_tokens: int
    n_null_expected: int = 0
    null_groups: dict[str, int] = field(default_factory=dict)  # verified symmetry -> directions
    per_block: dict[str, SpectrumSummary] = field(default_factory=dict)  # "q", "k", "v" alone
    weights: dict[str, dict] = field(default_factory=dict)  # kappa(W_b) stacked and per head
    null_gain: float = 0.0  # ``SpectrumSummary.null_gain`` of the whole head's scope
    kappa_x: float | None = None  # kappa of the probe input the projections read ([X, 1] with biases)
    n_null_x: int = 0  # its null directions excluded from kappa_x (1 after a LayerNorm, any bias)
    reason: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def cut_separation(self) -> float | None:
        return separation(self.sigma_min, self.null_gain)


def separation(sigma_min: float | None, null_gain: float) -> float | None:
    """Decades between sigma_min and the largest value the cut excluded (``null_gain``): how clearly
    the cut separates the kept spectrum from what it excluded (None when nothing was excluded)."""
    if sigma_min is None or null_gain <= 0:
        return None
    return math.log10(sigma_min / null_gain)


def cut_separated(separation: float | None) -> bool:
    """Whether a probe's cut lies at least ``SEPARATION_MIN`` decades below sigma_min (None: nothing
    was excluded, nothing to separate)."""
    return separation is None or separation >= SEPARATION_MIN


def input_condition(x: torch.Tensor, rtol: float) -> tuple[float, int]:
    """kappa of the real input rows over their non-null spectrum, and how many values were null."""
    s = svdvals(x)
    s = torch.cat([s, s.new_zeros(x.shape[1] - s.numel())])
    smax, smin, n_null, _ = spectrum_cut(s, max(rtol, RANK_RTOL))
    return smax / smin, n_null


def _too_small(probe: LinearisedLayer) -> str | None:
    t, dim = probe.num_tokens, probe.dim
    need = len(probe.blocks) * dim
    if t < need:
        return (
            f"probe too small to be full rank: {t} real tokens < {len(probe.blocks)}*D' = {need} "
            f"(J has {t * probe.head_dim} rows per head for {probe.head_size} parameters); use a larger probe"
        )
    return None


def _combine(
    heads: list[SpectrumSummary], expected: int, n_params: int, rtol: float, null_gain: float
) -> SpectrumSummary:
    smax = max(e.sigma_max for e in heads)
    kept = [e.sigma_min for e in heads if e.sigma_min > rtol * smax]  # the dense reference's cut
    smin = min(kept)
    n_null = sum(e.n_null for e in heads) + sum(e.sigma_min <= rtol * smax for e in heads)
    cut = [e.sigma_min for e in heads if e.sigma_min <= rtol * smax] + [e.null_gain for e in heads]
    return SpectrumSummary(smax, smin, n_null, [], max([null_gain, *cut]), expected, n_params)


def _dense_summary(
    jacs: list[HeadJacobian],
    sb: tuple[str, ...],
    rtol: float,
    expected: int,
    n_params: int,
    nulls: list[ScopeNull] | None = None,
) -> SpectrumSummary:
    """The scope's every singular value by svdvals of each head's columns, cut at rtol (the
    ``dense`` method's definition). With ``nulls`` from a family's support, of the reduced columns
    [J_kron | J_S P] and the support's removed directions as exact zeros: J_S = J_S P P^T with P
    orthonormal, so they are the same values, from half the columns (linear attention's K)."""
    values = []
    for h, j in enumerate(jacs):
        null = None if nulls is None else nulls[h]
        if null is None or null.dense is None:
            values.append(svdvals(j.columns(sb)))
            continue
        columns = torch.cat([j.columns(null.blocks), null.dense], 1) if null.blocks else null.dense
        values += [svdvals(columns), columns.new_zeros(null.reduced)]
    smax, smin, n_null, excluded = spectrum_cut(torch.cat(values), rtol)
    return SpectrumSummary(smax, smin, n_null, [], excluded, expected, n_params)


def jacobian_condition(
    layer: Attention,
    x: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    method: str = "gram",
    blocks: str = "qkv",
    rtol: float = DEFAULT_RTOL,
    per_block: bool = True,
    input_rtol: float | None = None,
) -> JacobianCondition:
    """Condition number of one attention layer's Jacobian with respect to its q/k/v parameters.

    Args:
        layer: any attention layer (``lra_cond.models.attention.Attention``); never modified.
        x: the layer's input (after LayerNorm), (batch, seq, D) or (seq, D).
        key_padding_mask: (batch, seq), True at padded positions; padded query rows are not outputs.
        method: ``gram`` (default), ``qr`` or ``dense`` (see the module docstring).
        blocks: which projections J is taken with respect to, e.g. ``qkv`` (default) or ``qk``.
        rtol: singular values <= rtol * sigma_max are null (the dense cut; the fast methods count
            any such value beyond the verified null space, from exact svdvals).
        per_block: also report kappa of each block alone (Q, K, V).
        input_rtol: input directions with relative singular value below this are exact null
            directions of x (removed); default max(100 eps of x's dtype, 1e-10) (float32 LayerNorm
            outputs are mean-free only to ~1e-7).
    """
    if method not in METHODS:
        raise UserError(f"unknown method '{method}'; valid methods: {', '.join(METHODS)}")
    if not 0 < rtol < 1:
        raise UserError(f"rtol must be in (0, 1), got {rtol}")
    if input_rtol is None:
        eps = torch.finfo(x.dtype).eps if x.is_floating_point() else 0.0
        input_rtol = max(100 * eps, RANK_RTOL)
    probe = linearise(layer, x, key_padding_mask, blocks)
    # kappa of what the projections read: [x, 1] for a layer with biases (x alone would jump like
    # 1/beta as a LayerNorm bias leaves 0, exactly as J did with its biases held fixed), else x.
    kappa_x, n_null_x = input_condition(probe.x[probe.real], input_rtol)
    result = JacobianCondition(
        kappa=None,
        sigma_max=None,
        sigma_min=None,
        n_null=0,
        rtol=rtol,
        method=method,
        blocks="".join(probe.blocks),
        n_params=probe.num_params,
        n_tokens=probe.num_tokens,
        weights=weight_conditions(layer, probe.blocks),
        kappa_x=kappa_x,
        n_null_x=n_null_x,
    )
    reason = _too_small(probe)
    if reason:
        result.reason = reason
        return result
    w0 = snap_input(probe, input_rtol)
    if w0.shape[1]:
        result.notes.append(f"input rows span {probe.dim - w0.shape[1]} of {probe.dim} dimensions")

    heads = range(probe.num_heads)
    jacs = [probe.head_jacobian_operator(h) for h in heads]
    scopes = {"all": probe.blocks, **({b: (b,) for b in probe.blocks} if per_block else {})}
    x_real = probe.x[probe.real]
    group_ranks: dict[str, int] = {}
    # One scope at a time, each head's spectrum taken before the next scope's nulls are built: a
    # family's reduced columns (linear attention's K/V statistics support, large on the tiny
    # split) never outlive their scope
    for scope, sb in scopes.items():
        nulls, null_gain = scope_nulls(probe, jacs, sb, w0, group_ranks, scope == "all")
        expected = sum(n.basis.shape[1] + n.reduced for n in nulls)
        n_params = probe.num_heads * len(sb) * probe.block_size
        if method == "dense":
            summary = _dense_summary(jacs, sb, rtol, expected, n_params)
        else:
            per_head = [
                head_spectra(
                    jacs[h],
                    probe.blocks,
                    probe.head_dim,
                    probe.dim,
                    x_real,
                    {scope: nulls[h]},
                    rtol,
                    method,
                    jacs[h].factors,
                )[scope]
                for h in heads
            ]
            for h, e in enumerate(per_head):
                result.notes += [f"{scope}, head {h}: {n}" for n in e.notes]
            summary = _combine(per_head, expected, n_params, rtol, null_gain)
            if summary.null_gain > rtol * summary.sigma_max:
                # one cut for the whole probe: a verified group J does not map under rtol * sigma_max
                # is not null by the spectrum's own test, so the scope's values come from svdvals
                result.notes.append(
                    f"{scope}: J reaches {summary.null_gain / summary.sigma_max:.1e} sigma_max on the "
                    "directions verified as null, above rtol: values taken from svdvals"
                )
                summary = _dense_summary(jacs, sb, rtol, expected, n_params, nulls)
        del nulls
        if summary.n_null != expected:
            result.notes.append(
                f"{scope}: {summary.n_null} singular values below rtol "
                f"but the verified symmetries give {expected}"
            )
        if scope == "all":
            result.kappa, result.sigma_max = summary.kappa, summary.sigma_max
            result.sigma_min = summary.sigma_min
            result.n_null, result.n_null_expected = summary.n_null, summary.n_null_expected
            result.null_groups = group_ranks
            result.null_gain = summary.null_gain
        else:
            result.per_block[scope] = summary
    return result


# The routes (step 3's choice per scope; see the module docstring)


def kron_factor(block: torch.Tensor, d: int) -> torch.Tensor | None:
    """Y (T, D') if ``block`` (rows (i, a), columns (b, c)) is Y (x) I_d, i.e. block[(i, a), (b, c)] =
    delta_ab Y[i, c]; else None."""
    t, dim = block.shape[0] // d, block.shape[1] // d
    y = block.reshape(t, d, d, dim)[:, 0, 0]
    # Checked on random directions (the structure holds exactly or fails by O(1)): one product
    # instead of comparing every entry.
    gen = torch.Generator().manual_seed(0)
    v = normal_draws(gen, d * dim, 2, dtype=block.dtype, device=block.device)
    want = ValueBlock(y, d) @ v
    got = block @ v
    return y if bool((got - want).norm() <= 1e-12 * max(float(got.norm()), 1e-300)) else None


def _value_extremes(y: torch.Tensor, d: int, verified: int, rtol: float) -> SpectrumSummary:
    """Y (x) I_d: every singular value of Y, d times (exact)."""
    s = svdvals(y)
    smax, smin, n_null, excluded = spectrum_cut(torch.cat([s, s.new_zeros(y.shape[1] - s.numel())]), rtol)
    extra = d * n_null - verified
    notes = [f"{extra} value-block null value(s) beyond the verified ones"] if extra > 0 else []
    return SpectrumSummary(smax, smin, max(verified, d * n_null), notes, excluded)


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
) -> dict[str, SpectrumSummary]:
    """Extremes of every scope in ``nulls`` ("all", or a single block) of one head: each scope's
    columns are its ``ScopeNull.blocks`` of ``jac`` (blocks laid out in ``blocks`` order), then its
    ``dense`` columns. ``factors``: blocks the family gave in factored form (single-block scopes
    use them). The value block's rotation is formed once per head (``_value_rotation``)."""
    factors = factors or {}
    size = d * dim
    y, u, s_y, r_y = _value_rotation(jac, blocks, d, rtol)
    out: dict[str, SpectrumSummary] = {}
    for scope, null in nulls.items():
        sb = null.blocks if null.blocks is not None else (list(blocks) if scope == "all" else [scope])
        basis, extra = null.basis, [] if null.dense is None else [null.dense]
        verified = basis.shape[1] + null.reduced
        if scope == "v" and y is not None:  # exact, whatever reduction the family offers
            out[scope] = _value_extremes(y, d, verified, rtol)
            continue
        a_blocks = [b for b in sb if b != "v"]
        eliminate = y is not None and "v" in sb and bool(a_blocks) and null.value_split and not extra
        if eliminate:
            i_v = sb.index("v")
            v_norm = basis[i_v * size : (i_v + 1) * size].norm(dim=0)
            v_part = v_norm > 0.5 * basis.norm(dim=0)  # each column lies in V or outside V
            eliminate = int(v_part.sum()) == d * (dim - r_y)  # the value block's own nulls are Y's
        if eliminate:
            spans = [(i * size, (i + 1) * size) for i, b in enumerate(sb) if b != "v"]
            keep = torch.cat([torch.arange(a, e, device=basis.device) for a, e in spans])
            null_a = basis[:, ~v_part][keep]  # the null directions outside V, in the other blocks
            factored = all(b in factors for b in a_blocks)
            fs = [factors[b] for b in a_blocks] if factored else []
            head = Head(fs, u, r_y, s_y, null_a, x_real, verified, rtol, method)
            if factored:  # the Gram from the factors, no rows formed
                closed = None
                if null.null_inputs is not None:
                    closed = coordinates.gauge_complement(
                        null.gauge, null.null_inputs, a_blocks, null_a.shape[1], d, dim
                    )
                out[scope] = factored_head(head, closed)
            else:
                out[scope] = formed_head(head, [jac.block(b) for b in a_blocks], d)
            continue
        if scope in factors and sb == [scope] and not extra:  # one factored block
            exact, t, g, left_null = coordinates.factored_scope(factors[scope], basis, d, dim, x_real)
            out[scope] = extremes.solve(exact, t, None, verified, rtol, method, g=g, null=left_null)
            continue
        # every coordinate kept, the null directions regularised (``extremes.solve``)
        null_q = orthonormal_basis(basis)
        if sb and all(b in factors for b in sb):  # the Gram from the factors, no rows formed
            fs = [factors[b] for b in sb]
            rows, t, g = coordinates.factored_kept(
                fs, extra[0] if extra else None, d, x_real, null.dense_product, null.dense_gram
            )
            out[scope] = extremes.solve(rows, t, None, verified, rtol, method, g=g, null=null_q)
            continue
        raw = [jac.block(b) for b in sb] + extra
        t, g = kron_preconditioner(raw[: len(sb)], d, x_real), None
        if extra and not sb and null.dense_product is not None:  # the columns alone, whitened
            r, scaled = whitened(extra[0], null.dense_product, null.dense_gram)  # by its structure
            t.add_dense(r)
            g = gram(scaled)
        elif extra:
            t.add_dense(dense_preconditioner(extra[0], null.dense_gram))
        rows = [torch.cat(raw, 1)] if len(raw) > 1 else raw
        out[scope] = extremes.solve(rows, t, None, verified, rtol, method, g=g, null=null_q)
    return out


class Head(NamedTuple):
    """One head's whole-head problem once the value block is eliminated: the blocks' factors (all
    but V's; none when they are formed), the token rotation [Q_Y | Q_perp] with Y's rank and
    singular values, the null directions outside V, the probe input, the verified null count, the
    cut and the method."""

    fs: list[Factored]
    u: torch.Tensor
    r_y: int
    s_y: torch.Tensor
    null: torch.Tensor
    x: torch.Tensor
    verified: int
    rtol: float
    method: str


def formed_head(head: Head, blocks: list[torch.Tensor], d: int) -> SpectrumSummary:
    """The whole head from its formed columns (``blocks``: every block but V, from forward-mode AD or
    nystrom's Q and K where its landmark correction is nearly as wide as the rows): rows rotated by
    [Q_Y | Q_perp]^T (x) I, J = [[diag(s_Y) (x) I, C], [0, P_perp J_A]], so the value block is
    eliminated exactly and the rest's Gram, of P_perp J_A, has no cancellation; its null directions
    (all outside V) are regularised."""
    u, r_y, n_v = head.u, head.r_y, head.r_y * d
    tops, bottoms = [], []
    for block in blocks:
        both = (u.T @ block.reshape(u.shape[0], -1)).reshape(block.shape[0], -1)
        tops.append(both[:n_v])
        bottoms.append(both[n_v:])
    t = kron_preconditioner(bottoms, d, head.x)
    null = torch.cat([head.null.new_zeros(n_v, head.null.shape[1]), orthonormal_basis(head.null)])
    value = (head.s_y[:r_y].repeat_interleave(d), torch.cat(tops, 1))
    rows = [torch.cat(bottoms, 1)]
    return extremes.solve(rows, t, value, head.verified, head.rtol, head.method, null=null)


def factored_head(
    head: Head,
    closed: GaugeComplement | None = None,
) -> SpectrumSummary:
    """The whole head when every block but V is given as factors (softmax, normalized, nystrom: Q, K),
    every piece from the factors:

    * each block's input side rotated to [V_perp | V_par], V_par the span of the null inputs;
      L_b (x) W_perp preconditions the perp coordinates;
    * when the null space is the gauge and the null inputs (``closed``), the par coordinates are
      replaced by the gauge's complement in closed form, whose columns are Q's factors transformed
      by a Kronecker product (``coordinates.GaugeComplement.factor``: no Householder pass, no
      congruence, and K meets it only on K's perp coordinates), whitened by the Cholesky factor of
      its own block;
    * the value block eliminated as a Schur complement, B^T T^T J_A^T (P_perp (x) I) J_A T B =
      B^T G'_AA B - (C' B)^T (C' B) with C' = (Q_Y^T (x) I) J_A T.

    Any other null space keeps every coordinate and is regularised (``_factored_head_kept``). The
    exact rows (of the check, the refinement and sigma_max) are an operator through the factors,
    never formed; the value coupling C B is, from the Schur complement's pieces."""
    if closed is not None and _spans_null(closed, head.null):
        t_d, h, coupling = _closed_schur(head, closed)
        return _solve_head(head, closed, t_d, h, coupling, preconditioned=False)
    return _factored_head_kept(head)


def _closed_schur(head: Head, closed: GaugeComplement) -> tuple[Preconditioner, torch.Tensor, torch.Tensor]:
    """``factored_head``'s preconditioner T, the value block's Schur complement (preconditioned,
    on the coordinates of ``closed``: the perp ones, then the gauge's complement) and the value
    coupling C B, from the factors."""
    fs, u, r_y, x = head.fs, head.u, head.r_y, head.x
    d = fs[0].left.shape[-1]
    # each block's perp coordinates as separate factors (the layout of ``GaugeComplement``: every
    # block's perp ones, then the complement): every product below lands in that layout
    t_d, perp_fs = Preconditioner(), []
    for f, perp in zip(fs, closed.perp):
        if perp.shape[1]:  # (every input direction may carry a null one: then no perp part)
            lb = coordinates.output_side(f)  # a sum over the inputs: any rotation of them keeps it
            w_perp = input_whitening(x @ perp)
            t_d.add_kron(lb, w_perp)
            perp_fs.append(coordinates.preconditioned(f, lb, perp @ w_perp))
    n_perp = sum(d * f.right.shape[-1] for f in perp_fs)
    # C' = C T on the perp coordinates and C' B on the complement; the Schur complement's pieces
    top_perp = _rows_rotated(perp_fs, u[:, :r_y], d)
    c_perp = t_d.solve(top_perp, left=False)  # C on the perp coordinates (t_d: only theirs yet)
    comp_f = closed.factor(fs)  # the complement's columns, up to ``closed.scale``
    top_c = closed.scale(coordinates.rows_rotated(comp_f, u[:, :r_y]))
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
    basis: GaugeComplement | None,
    t: Preconditioner,
    h: torch.Tensor,
    coupling: torch.Tensor,
    preconditioned: bool,
    null: torch.Tensor | None = None,
) -> SpectrumSummary:
    """The extremes of a whole head from its value block's Schur complement ``h`` (preconditioned
    by ``t`` on the coordinates ``basis``; None: every coordinate kept), the value part
    diag(s_Y) (x) I_d and its ``coupling`` (C, or C T when ``preconditioned``:
    ``extremes._Factor.c_preconditioned``); the exact rows through the factors, those of Q_perp
    and, for sigma_max, [C B; rows] as one operator (``joint``). ``null``: null directions left in
    the coordinates (``extremes.solve``)."""
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
        r_c = shifted_cholesky(h_cc, 1e-10)[0]
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


def _factored_head_kept(head: Head) -> SpectrumSummary:
    """``factored_head`` for a null space without a closed-form complement (normalized attention's:
    its orthogonal gauge, ~d^2 / 2 of the 2 d D' columns): every coordinate keeps its
    Kronecker preconditioner L_b (x) W and the null directions (all outside V) are regularised as in
    ``coordinates.factored_kept``. The value block's Schur complement T^T
    G_AA T - C'^T C' is then one Gram of the preconditioned factors less one of their rotated rows, where
    deflating takes a Householder complement and four congruences by it."""
    fs, u, r_y, null, x = head.fs, head.u, head.r_y, head.null, head.x
    d = fs[0].left.shape[-1]
    t, pre = kept_coordinates(fs, x)
    top = _rows_rotated(pre, u[:, :r_y], d)  # C' = C T
    h = block_grams(pre, None, x)
    h = gram(top, add_to=h, alpha=-1.0)  # in place: no second 4160^2 matrix
    n_v = r_y * d
    # the null directions in the factor's coordinates [V | A]: none has a V part (``value_split``)
    null_q = torch.cat([null.new_zeros(n_v, null.shape[1]), orthonormal_basis(null)])
    return _solve_head(head, None, t, h, top, preconditioned=True, null=null_q)


def _spans_null(basis: GaugeComplement, null: torch.Tensor, probes: int = 2) -> bool:
    """Whether the closed-form basis is orthogonal to the verified null directions (random
    combinations of them: a basis built from a wrong structure would not be)."""
    gen = torch.Generator().manual_seed(0)
    v = null @ normal_draws(gen, null.shape[1], probes, dtype=null.dtype, device=null.device)
    return bool((basis.T @ v).norm() <= nullspace.GAUGE_RTOL * v.norm())


def _rows_rotated(fs: list[Factored], u: torch.Tensor, d: int) -> torch.Tensor:
    """(U^T (x) I_d) [J_1 .. J_n] for factored blocks (possibly none)."""
    if not fs:
        return u.new_zeros(u.shape[1] * d, 0)
    return torch.cat([coordinates.rows_rotated(f, u) for f in fs], 1)
