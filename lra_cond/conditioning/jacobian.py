"""Condition number of the attention Jacobian J = d vec(A) / d (W_Q, W_K, W_V).

A is the layer's output before ``out_proj`` (heads concatenated) at the real (unpadded) query rows
of a fixed probe input x (the layer's own input, i.e. after LayerNorm). J is taken with respect to
the weights only (biases held fixed), in float64, dropout off, on the family's explicit math path,
on a deep copy of the layer. J has an exact null space (see ``nullspace``), so kappa is reported
over the non-null spectrum: kappa = sigma_max / sigma_min with sigma_min the smallest singular value
above ``rtol * sigma_max``; ``n_null`` says how many were excluded.

Methods (all build per-head Jacobian blocks: head h's output columns depend only on head h's rows of
W_Q, W_K, W_V, and the Q, K and V parameters of one head share those outputs, so the block is taken
over all three together; their union is J's spectrum. Blocks come from the family's closed form
where one exists (softmax, ``head_jacobian``), else from forward-mode AD):
* ``dense``: exact singular values of every block by ``svdvals``. Null count: singular values
  <= rtol * sigma_max. The reference; minutes per head at D=64, 256 tokens on a 2-core CPU.
* ``qr``: the verified analytic null space (``nullspace``) is deflated, the rest reduced by QR and
  its extremes found by Lanczos on R^T R and on (R^T R)^{-1} (``deflated``). Same numbers as dense
  to ~1e-8 relative (tests: 1e-6) at ~10 s per head there. Null count: the deflated dimension, plus
  any singular value of R still <= rtol * sigma_max (then taken from svdvals(R), exactly).
* ``matrix-free``: Lanczos on the Gram operator J^T J (jvp + vjp), restricted to the orthogonal
  complement of the same null space, so the smallest Ritz value is the smallest non-null
  eigenvalue; J is never formed. Null count: the deflated dimension (plus any Ritz value still
  below rtol^2 * lambda_max, reported in ``notes``). Resolves kappa up to ~1e7 (eigenvalues of
  J^T J carry absolute error ~1e-16 * lambda_max); for memory-bound probes only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.func import vjp

from lra_cond.conditioning.deflated import (
    Extremes,
    deflated_extremes,
    kron_extremes,
    kron_factor,
    spectrum_cut,
    value_eliminated_extremes,
)
from lra_cond.conditioning.head_jacobian import head_jacobian
from lra_cond.conditioning.lanczos import lanczos_extremes
from lra_cond.conditioning.nullspace import NullSpace, build_null_space, snap_input
from lra_cond.conditioning.probe import Probe, make_probe
from lra_cond.conditioning.weights import svdvals, weight_conditions
from lra_cond.errors import UserError
from lra_cond.models.attention.base import Attention

METHODS = ("dense", "qr", "matrix-free")
# Exact null singular values come out of float64 svdvals at ~1e-15 sigma_max; near-symmetries
# (e.g. a LayerNorm bias that has only just left 0) sit at ~1e-10 and are genuine, so are kept.
DEFAULT_RTOL = 1e-11
# Eigenvalues of J^T J carry absolute error ~1e-16 * lambda_max, so singular values below ~1e-8 *
# sigma_max are noise for the matrix-free method: its null cut is max(rtol, MF_RESOLUTION).
MF_RESOLUTION = 1e-7


@dataclass
class SpectrumSummary:
    """Extreme non-null singular values of J (or of one block of it)."""

    kappa: float | None
    sigma_max: float | None
    sigma_min: float | None
    n_null: int  # singular values excluded as null
    n_null_expected: int  # dimension of the verified analytic null space
    n_params: int


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
    reason: str | None = None
    notes: list[str] = field(default_factory=list)

    def block_kappa(self, block: str) -> float | None:
        return self.per_block[block].kappa if block in self.per_block else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _summary_from_values(s: torch.Tensor, rtol: float, expected: int) -> SpectrumSummary:
    smax, smin, n_null = spectrum_cut(s, rtol)
    return SpectrumSummary(smax / smin, smax, smin, n_null, expected, s.numel())


def _dense(probe: Probe, null: NullSpace, rtol: float, jacs: list[torch.Tensor]) -> SpectrumSummary:
    s = torch.cat([svdvals(j) for j in jacs])
    return _summary_from_values(s, rtol, null.dim)


def _head_extremes(
    probe: Probe, null: NullSpace, h: int, jac: torch.Tensor, w0: torch.Tensor, rtol: float
) -> Extremes:
    """One head's extremes: the value block in closed form when it is Kronecker-structured."""
    assert null.bases is not None
    basis, d = null.bases[h], probe.head_dim
    if "v" in probe.blocks:
        i = probe.blocks.index("v")
        w_null = w0 if "input_null_v" in null.groups else w0[:, :0]
        if len(probe.blocks) == 1:
            y = kron_factor(jac, d)
            if y is not None and basis.shape[1] == d * w_null.shape[1]:
                return kron_extremes(y, w_null, d, rtol)
        else:
            cols = slice(i * probe.block_size, (i + 1) * probe.block_size)
            found = value_eliminated_extremes(jac, basis, cols, d, w_null, rtol)
            if found is not None:
                return found
    return deflated_extremes(jac, basis, rtol)


def _qr(
    probe: Probe, null: NullSpace, rtol: float, jacs: list[torch.Tensor], w0: torch.Tensor
) -> SpectrumSummary:
    heads = [_head_extremes(probe, null, h, j, w0, rtol) for h, j in enumerate(jacs)]
    smax = max(e.sigma_max for e in heads)
    smin = min(e.sigma_min for e in heads if e.sigma_min > rtol * smax)  # same cut as dense
    extra = sum(e.n_extra_null for e in heads)
    # a head whose whole spectrum sits below rtol * (another head's sigma_max): at least one null more
    extra += sum(e.sigma_min <= rtol * smax for e in heads)
    return SpectrumSummary(smax / smin, smax, smin, null.dim + extra, null.dim, probe.num_params)


def _matrix_free(probe: Probe, null: NullSpace, rtol: float, tol: float, max_iter: int) -> tuple:
    f = probe.function()
    theta = probe.theta()
    _, vjp_fn = vjp(f, theta)

    def gram(v: torch.Tensor) -> torch.Tensor:
        return vjp_fn(probe.jvp(theta, v))[0]

    hs = probe.head_size

    def project(v: torch.Tensor) -> torch.Tensor:
        parts = v.reshape(probe.num_heads, hs)
        out = [p - c @ (c.T @ p) if c.shape[1] else p for p, c in zip(parts, null.bases)]
        return torch.cat(out)

    n = theta.numel()
    # Power-iteration-free floor: run once to get lambda_max, then the floor follows from rtol.
    res = lanczos_extremes(gram, n, project, theta.dtype, theta.device, tol=tol, max_iter=max_iter)
    lam_max = float(res.ritz[-1])
    floor = max(rtol, MF_RESOLUTION) ** 2 * lam_max
    below = int((res.ritz <= floor).sum())
    if below:
        res = lanczos_extremes(gram, n, project, theta.dtype, theta.device, tol, floor, max_iter)
        below = int((res.ritz <= floor).sum())
    above = res.ritz[res.ritz > floor]
    smax, smin = math.sqrt(float(above[-1])), math.sqrt(float(above[0]))
    summary = SpectrumSummary(smax / smin, smax, smin, null.dim + below, null.dim, n)
    notes = []
    if below:
        notes.append(
            f"{below} distinct undeflated null eigenvalue(s) found by Lanczos (multiplicity unknown); "
            "n_null counts each once"
        )
    if smin < 10 * MF_RESOLUTION * smax:
        notes.append("sigma_min is near the matrix-free resolution (1e-7 sigma_max); use method='dense'")
    if not res.converged:
        notes.append(f"Lanczos did not converge to tol={tol} in {res.iterations} iterations")
    return summary, notes, res.iterations


def _too_small(probe: Probe) -> str | None:
    t, dim = probe.num_tokens, probe.dim
    need = len(probe.blocks) * dim
    if t < need:
        return (
            f"probe too small to be full rank: {t} real tokens < {len(probe.blocks)}*D = {need} "
            f"(J has {t * probe.head_dim} rows per head for {probe.head_size} parameters); use a larger probe"
        )
    return None


def jacobian_condition(
    layer: Attention,
    x: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    method: str = "dense",
    blocks: str = "qkv",
    rtol: float = DEFAULT_RTOL,
    per_block: bool = True,
    input_rtol: float | None = None,
    tol: float = 1e-3,
    max_iter: int = 1500,
) -> JacobianCondition:
    """Condition number of one attention layer's Jacobian with respect to its q/k/v weights.

    Args:
        layer: any attention layer (``lra_cond.models.attention.Attention``); never modified.
        x: the layer's input (after LayerNorm), (batch, seq, D) or (seq, D).
        key_padding_mask: (batch, seq), True at padded positions; padded query rows are not outputs.
        method: ``dense`` (exact, small probes), ``qr`` (deflated QR + Lanczos, exact to ~1e-8; the
            monitor's default) or ``matrix-free`` (Lanczos on J^T J, J never formed).
        blocks: which weights J is taken with respect to, e.g. ``qkv`` (default) or ``qk``.
        rtol: singular values <= rtol * sigma_max are null (dense); matrix-free also deflates the
            verified analytic null space.
        per_block: also report kappa of each block alone (Q, K, V).
        input_rtol: input directions with relative singular value below this are treated as exact
            null directions of x (and removed); default 100 * eps of x's dtype (float32 LayerNorm
            outputs are mean-free only to ~1e-7).
        tol: Lanczos residual tolerance relative to the eigenvalue (matrix-free).
        max_iter: Lanczos iteration cap (matrix-free).
    """
    if method not in METHODS:
        raise UserError(f"unknown method '{method}'; valid methods: {', '.join(METHODS)}")
    if not 0 < rtol < 1:
        raise UserError(f"rtol must be in (0, 1), got {rtol}")
    if input_rtol is None:
        input_rtol = max(100 * torch.finfo(x.dtype).eps, 1e-12) if x.is_floating_point() else 1e-12
    probe = make_probe(layer, x, key_padding_mask, blocks)
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
        weights=weight_conditions(probe.layer, probe.blocks),
    )
    reason = _too_small(probe)
    if reason:
        result.reason = reason
        return result
    w0, wc = snap_input(probe, input_rtol)
    n0 = w0.shape[1]
    if n0:
        result.notes.append(f"input rows span {probe.dim - n0} of {probe.dim} dimensions (e.g. mean-free)")

    scopes = [("all", probe)]
    if per_block:
        scopes += [(b, replace(probe, blocks=(b,))) for b in probe.blocks]
    iterations = []
    head_jacs: list[torch.Tensor] = []
    for name, p in scopes:
        null = build_null_space(p, w0, wc, basis=method != "dense")
        if method in ("dense", "qr"):
            if name == "all":
                head_jacs = [head_jacobian(p, h) for h in range(p.num_heads)]
                jacs = head_jacs
            else:  # a block's columns of the per-head Jacobians (head layout: [q | k | v] blocks)
                i, size = probe.blocks.index(name), probe.block_size
                jacs = [j[:, i * size : (i + 1) * size] for j in head_jacs]
            summary = _dense(p, null, rtol, jacs) if method == "dense" else _qr(p, null, rtol, jacs, w0)
            if summary.n_null != null.dim:
                result.notes.append(
                    f"{name}: {summary.n_null} singular values below rtol but the verified symmetries "
                    f"give {null.dim}"
                )
        else:
            summary, notes, its = _matrix_free(p, null, rtol, tol, max_iter)
            result.notes += [f"{name}: {n}" for n in notes]
            iterations.append(its)
        if name == "all":
            result.kappa, result.sigma_max = summary.kappa, summary.sigma_max
            result.sigma_min = summary.sigma_min
            result.n_null, result.n_null_expected = summary.n_null, summary.n_null_expected
            result.null_groups = null.groups
        else:
            result.per_block[name] = summary
    if iterations:
        result.notes.append(f"Lanczos iterations: {iterations}")
    return result
