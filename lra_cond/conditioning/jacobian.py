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

Methods:
* ``gram`` (default): value block eliminated in closed form, preconditioned Gram, Cholesky, block
  Lanczos on the factor and its inverse (``spectrum``); exact to ~1e-8 relative, with a check
  against the exact J: when the Gram lost sigma_min, sigma_min is taken from the exact J by
  preconditioned Rayleigh-Ritz, and the factor is recomputed by Householder QR only if that
  does not settle (or the Gram is not numerically definite).
* ``qr``: the same with the factor from Householder QR (slower, never squares the condition).
* ``dense``: every singular value of every head block by ``svdvals``, null cut at rtol; the
  reference, minutes per layer at the reference shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from lra_cond.conditioning import gauge
from lra_cond.conditioning.extremes import Extremes
from lra_cond.conditioning.families.base import Support
from lra_cond.conditioning.gauge import NullStructure
from lra_cond.conditioning.head_jacobian import HeadJacobian
from lra_cond.conditioning.linearised import LinearisedLayer, linearise
from lra_cond.conditioning.nullspace import ACCEPT_RTOL, group_gain, snap_input, verified_groups
from lra_cond.conditioning.spectrum import NullGroup, ScopeNull, head_spectra
from lra_cond.conditioning.weight_kappa import weight_conditions
from lra_cond.conditioning.whole_head import GaugePart
from lra_cond.errors import UserError
from lra_cond.linalg import RANK_RTOL, normal_draws, span_union, spectrum_cut, svdvals
from lra_cond.models.attention.base import Attention

METHODS = ("gram", "qr", "dense")
SPAN_RTOL = 1e-6  # a group's direction counts when this far from the span of those before it
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
class SpectrumSummary:
    """Extreme non-null singular values of J (or of one block of it)."""

    kappa: float | None
    sigma_max: float | None
    sigma_min: float | None
    n_null: int  # singular values excluded as null
    n_null_expected: int  # dimension of the verified analytic null space
    n_params: int
    # a bound on the largest singular value the cut excluded: J's gain on the deflated directions
    # (``nullspace.group_gain``) or the largest exact value at or below rtol * sigma_max
    null_gain: float = 0.0

    @property
    def separation(self) -> float | None:
        return separation(self.sigma_min, self.null_gain)


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


def _row_components(supports: list[torch.Tensor]) -> list[list[int]]:
    """Indices grouped by overlapping row supports (boolean masks), transitively."""
    members: list[list[int]] = []
    masks: list[torch.Tensor] = []
    for i, rows in enumerate(supports):
        touching = [j for j, mask in enumerate(masks) if bool((mask & rows).any())]
        merged = [k for j in touching for k in members[j]] + [i]
        mask = rows.clone()
        for j in touching:
            mask |= masks[j]
        members = [m for j, m in enumerate(members) if j not in touching] + [sorted(merged)]
        masks = [m for j, m in enumerate(masks) if j not in touching] + [mask]
    return members


def _scope_null(groups: list[NullGroup], size: int, like: torch.Tensor) -> tuple[ScopeNull, list[int]]:
    """One head's verified groups on a scope -> a basis of their span (groups taken smallest first,
    so the largest, e.g. the gauge, is never orthonormalised), and each group's added rank.
    Groups touching disjoint rows span independent subspaces: each set of overlapping ones is taken
    on its own rows (the gauge and the key shifts on Q's and K's, 2/3 of the whole head's)."""
    if not groups:
        return ScopeNull(like.new_zeros(size, 0), True), []
    supports = [g.directions.abs().amax(1) > 0 for g in groups]
    structure = _structure(groups)
    parts, added = [], [0] * len(groups)
    columns: dict[int, tuple[int, int]] = {}  # group -> its columns of the basis
    start = 0
    for members in _row_components(supports):
        rows = torch.stack([supports[i] for i in members]).any(0)
        order = sorted(members, key=lambda i: groups[i].directions.shape[1])
        # the gauge joined last after null inputs alone (``structure``): independent in closed form
        known = structure is not None and groups[order[-1]].unit_gauge
        known = known and gauge.pivot_bound(structure) > 10 * SPAN_RTOL
        sub, added_sorted = span_union([groups[i].directions[rows] for i in order], SPAN_RTOL, known)
        for i, n in zip(order, added_sorted):
            added[i], columns[i], start = n, (start, start + n), start + n
        part = like.new_zeros(size, sub.shape[1])
        part[rows] = sub
        parts.append(part)
    split = all(g.blocks == {"v"} or "v" not in g.blocks for g in groups)
    basis = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    return ScopeNull(
        basis, split, structure=structure, gauge_part=_gauge_part(groups, columns, added, basis)
    ), added


def _gauge_part(
    groups: list[NullGroup], columns: dict[int, tuple[int, int]], added: list[int], basis: torch.Tensor
) -> GaugePart | None:
    """The largest group of the gauge's form that entered the basis whole (every direction
    independent of the others'), and a mask of its columns: its projector has a closed form."""
    fits = [i for i, g in enumerate(groups) if g.maps is not None and added[i] == g.directions.shape[1]]
    if not fits:
        return None
    i = max(fits, key=lambda j: added[j])
    mask = torch.zeros(basis.shape[1], dtype=torch.bool, device=basis.device)
    mask[columns[i][0] : columns[i][1]] = True
    return groups[i].maps, mask


def _structure(groups: list[NullGroup]) -> NullStructure | None:
    """The groups outside V in closed form (``gauge``), or None when one of them has none."""
    inputs: dict[str, list[torch.Tensor]] = {}
    out = NullStructure()
    for g in groups:
        if g.blocks == {"v"}:
            continue
        if g.gauge is not None and out.gauge is None:
            out.gauge = g.gauge
        elif g.input_side is not None:
            inputs.setdefault(next(iter(g.blocks)), []).append(g.input_side)
        else:
            return None
    for b, ws in inputs.items():  # their union (a key shift holds the input's null directions)
        out.inputs[b] = gauge.row_space(torch.cat(ws, 1).T)[0]
    return out


@dataclass
class _Reduction:
    """A scope's columns with a family's support applied: blocks in ``support_blocks`` reach the
    output only through span(P), so they are replaced by the columns J_S P (the rest of their
    coordinates, removed = n_S - r directions, are null)."""

    name: str
    kron: list[str]  # the scope's other blocks, unchanged
    support_blocks: list[str]
    p: torch.Tensor  # (n_S, r) orthonormal
    jac: HeadJacobian  # every block's products go through it (no columns formed)
    dense: torch.Tensor  # J_S P
    product: Callable[[torch.Tensor], torch.Tensor] | None  # M -> J_S P M by the family's structure
    gram: Callable[[], torch.Tensor] | None  # () -> ~(J_S P)^T (J_S P) by it (a preconditioner's)
    order: list[str]  # the scope's blocks, in order
    size: int

    @property
    def removed(self) -> int:
        return self.p.shape[0] - self.p.shape[1]

    @property
    def n_kron(self) -> int:
        return len(self.kron) * self.size

    def apply(self, v: torch.Tensor) -> torch.Tensor:  # v in the reduced layout [kron, dense]
        n = self.n_kron
        out = self.dense @ v[n:]
        return out + self.jac.apply(v[:n], self.kron) if self.kron else out

    def _split(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scope's original layout -> (kron rows, support rows)."""
        parts = {b: v[i * self.size : (i + 1) * self.size] for i, b in enumerate(self.order)}
        kron = torch.cat([parts[b] for b in self.kron]) if self.kron else v[:0]
        return kron, torch.cat([parts[b] for b in self.support_blocks])

    def coordinates(self, v: torch.Tensor) -> torch.Tensor:
        """Directions in the original layout -> the reduced layout (their component in span(P);
        the rest is among the removed null directions)."""
        kron, sup = self._split(v)
        return torch.cat([kron, self.p.T @ sup])

    def basis_of(self, basis: torch.Tensor) -> torch.Tensor:
        return basis  # verified groups are already in the reduced layout

    def verified(self) -> float | None:
        """J vanishes on the support's complement and the columns are J_S P (two random directions
        each), relative to J's gain: a bound on J's gain on the complement (``group_gain``), or
        None when either fails."""
        gen = torch.Generator().manual_seed(1)
        r = normal_draws(gen, self.p.shape[0], 2, dtype=self.p.dtype, device=self.p.device)
        off = r - self.p @ (self.p.T @ r)
        y = normal_draws(gen, self.p.shape[1], 2, dtype=self.p.dtype, device=self.p.device)
        # one pass over J_S (T d x n_S, the largest blocks here) for all three products, through the
        # blocks as the family gave them: forming J_S's columns cost ~0.1 s a scope (272 MB)
        probes = torch.cat([r, off, self.p @ y], 1)
        j_r, j_off, j_py = self.jac.apply(probes, self.support_blocks).split(2, 1)
        gain = max(float(j_r.norm() / r.norm()), 1e-300)
        if float(j_off.norm()) > ACCEPT_RTOL * gain * float(off.norm()):
            return None
        diff = self.dense @ y - j_py
        if float(diff.norm()) > ACCEPT_RTOL * gain * float(y.norm()):
            return None
        return group_gain(j_off.norm(dim=0), off.norm(dim=0), self.removed)


def _reduce(jac: HeadJacobian, sb: tuple[str, ...], size: int, support: Support | None) -> _Reduction | None:
    if support is None:
        return None
    kron = [b for b in sb if b not in support.blocks]
    dense = support.columns if support.columns is not None else jac.columns(support.blocks) @ support.p
    return _Reduction(
        support.name,
        kron,
        list(support.blocks),
        support.p,
        jac,
        dense,
        support.product,
        support.gram,
        list(sb),
        size,
    )


def _combine(
    heads: list[Extremes], expected: int, n_params: int, rtol: float, null_gain: float
) -> SpectrumSummary:
    smax = max(e.sigma_max for e in heads)
    kept = [e.sigma_min for e in heads if e.sigma_min > rtol * smax]  # the dense reference's cut
    smin = min(kept)
    n_null = sum(e.n_null for e in heads) + sum(e.sigma_min <= rtol * smax for e in heads)
    cut = [e.sigma_min for e in heads if e.sigma_min <= rtol * smax] + [e.largest_null for e in heads]
    return SpectrumSummary(smax / smin, smax, smin, n_null, expected, n_params, max([null_gain, *cut]))


def _dense_summary(
    jacs: list[HeadJacobian], sb: tuple[str, ...], rtol: float, expected: int, n_params: int
) -> SpectrumSummary:
    """The scope's every singular value by svdvals of each head's columns, cut at rtol (the
    ``dense`` method's definition)."""
    smax, smin, n_null, excluded = spectrum_cut(torch.cat([svdvals(j.columns(sb)) for j in jacs]), rtol)
    return SpectrumSummary(smax / smin, smax, smin, n_null, expected, n_params, excluded)


def _scope_nulls(
    probe: LinearisedLayer,
    jacs: list[HeadJacobian],
    sb: tuple[str, ...],
    w0: torch.Tensor,
    group_ranks: dict[str, int],
    count: bool,
) -> tuple[list[ScopeNull], float]:
    """Every head's verified null space on the scope over blocks ``sb`` (a group is kept only if it
    is null in every head), on the family's support where it gives one. ``group_ranks``: {group:
    directions over all heads}, this scope's counts added when ``count`` (the whole head's scope).
    Also returns a bound on J's largest gain on every direction the scope treats as null."""
    heads = range(probe.num_heads)
    size = probe.block_size
    supports = [probe.family.support(probe.head_inputs(h, sb)) for h in heads]
    reduced = [_reduce(jacs[h], sb, size, s) for h, s in enumerate(supports)]

    def apply(h: int, v: torch.Tensor) -> torch.Tensor:
        return jacs[h].apply(v, sb) if reduced[h] is None else reduced[h].apply(v)

    def transform(h: int, v: torch.Tensor) -> torch.Tensor:
        return v if reduced[h] is None else reduced[h].coordinates(v)

    groups, gains = verified_groups(replace(probe, blocks=sb), sb, w0, apply, transform=transform)
    null_gain = max(gains.values(), default=0.0)
    nulls = []
    for h in heads:
        red = reduced[h]
        width = len(sb) * size if red is None else red.n_kron + red.dense.shape[1]
        null, added = _scope_null(groups[h], width, probe.x)
        if red is not None:
            off_gain = red.verified()
            if off_gain is None:
                raise RuntimeError(f"{type(probe.family).__name__}.support is not a support of J")
            null_gain = max(null_gain, off_gain)
            null = ScopeNull(
                red.basis_of(null.basis), False, red.kron, red.dense, red.removed, red.product, red.gram
            )
            group_ranks[red.name] = group_ranks.get(red.name, 0) + (red.removed if count else 0)
        nulls.append(null)
        if count:
            for g, n in zip(groups[h], added):
                if n:
                    group_ranks[g.name] = group_ranks.get(g.name, 0) + n
    return nulls, null_gain


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
    spectra: list[dict[str, Extremes]] = [{} for _ in heads]
    expected_of: dict[str, int] = {}
    null_gain_of: dict[str, float] = {}
    # One scope at a time, each head's spectrum taken before the next scope's nulls are built: a
    # family's reduced columns (linear attention's K/V statistics support, ~0.5-1 GB a head and
    # scope on the tiny split) never outlive their scope
    for scope, sb in scopes.items():
        nulls, null_gain_of[scope] = _scope_nulls(probe, jacs, sb, w0, group_ranks, scope == "all")
        expected_of[scope] = sum(n.basis.shape[1] + n.reduced for n in nulls)
        if method != "dense":
            for h in heads:
                spectra[h].update(
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
                    )
                )
        del nulls
    for scope, sb in scopes.items():
        expected = expected_of[scope]
        n_params = probe.num_heads * len(sb) * probe.block_size
        if method == "dense":
            summary = _dense_summary(jacs, sb, rtol, expected, n_params)
        else:
            per_head = [sp[scope] for sp in spectra]
            for h, e in enumerate(per_head):
                result.notes += [f"{scope}, head {h}: {n}" for n in e.notes]
            summary = _combine(per_head, expected, n_params, rtol, null_gain_of[scope])
            if summary.null_gain > rtol * summary.sigma_max:
                # one cut for the whole probe: a verified group J does not map under rtol * sigma_max
                # is not null by the spectrum's own test, so the scope's values come from svdvals
                result.notes.append(
                    f"{scope}: J reaches {summary.null_gain / summary.sigma_max:.1e} sigma_max on the "
                    "directions verified as null, above rtol: values taken from svdvals"
                )
                summary = _dense_summary(jacs, sb, rtol, expected, n_params)
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
