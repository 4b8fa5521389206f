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
   operator (``coordinates``; Grams from a family's per-token factors: ``factored``), along the
   route ``routes`` chooses;
4. find the extreme singular values (``extremes``: a Cholesky factor of the preconditioned Gram,
   block Lanczos on it and on its inverse);
5. check them against the exact J (``extremes``), and apply one cut for the whole probe here.

Methods:
* ``gram`` (default): the steps above; exact to ~1e-8 relative, with the check against the exact J.
* ``qr``: the same with the factor from Householder QR (more flops, never squares the condition).
* ``dense``: every singular value of every head block by ``svdvals``, null cut at rtol; the
  reference the tests hold the others to, at the cost of a full SVD of every head block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lra_cond.conditioning.extremes import Extremes
from lra_cond.conditioning.linearised import HeadJacobian, LinearisedLayer, linearise, weight_conditions
from lra_cond.conditioning.nullspace import (
    scope_nulls,
    snap_input,
)
from lra_cond.conditioning.routes import head_spectra
from lra_cond.errors import UserError
from lra_cond.linalg import RANK_RTOL, spectrum_cut, svdvals
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
    # family's reduced columns (linear attention's K/V statistics support, large on the tiny
    # split) never outlive their scope
    for scope, sb in scopes.items():
        nulls, null_gain_of[scope] = scope_nulls(probe, jacs, sb, w0, group_ranks, scope == "all")
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
