"""The Jacobian's exact null space: candidate groups, checked numerically.

Candidates per head and scope (the whole head, or one block alone):

* **Input null space** (every family). If the probe rows all lie in a subspace (X~ w = 0), any
  direction u w^T of a projection leaves its output unchanged: d directions per block and per null
  vector w. With the augmented input X~ = [X, 1], a LayerNorm's rows give w = [1/gamma, -c] for any
  bias beta (c = beta . (1/gamma)), so this count does not change as beta leaves 0.
* **The family's own symmetries** (``FamilyJacobian.symmetries`` in ``conditioning/families/``): the
  gauge of bilinear scores, key shifts under softmax, normalisation scales, linear attention's
  key/value statistics, ...

A group is accepted when J applied to two random combinations of it is zero relative to J's
typical gain: if J restricted to the group were not zero, a random combination would be null with
probability zero, so two products verify the whole group, for any family.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lra_cond.conditioning import gauge
from lra_cond.conditioning.families.base import rows_equal
from lra_cond.conditioning.linearised import LinearisedLayer
from lra_cond.conditioning.spectrum import NullGroup
from lra_cond.linalg import RANK_RTOL, normal_draws, null_vectors

ACCEPT_RTOL = 1e-8  # ||J v|| / typical ||J u|| below this: v is a null direction (float64 noise ~1e-15)


def centred_rows(probe: LinearisedLayer) -> torch.Tensor:
    """Real rows minus their sequence's mean (keys of different sequences never mix)."""
    return torch.cat([x - x.mean(0, keepdim=True) for x in probe.sequences() if x.shape[0]])


def snap_input(probe: LinearisedLayer, rtol: float) -> torch.Tensor:
    """Make near-exact input symmetries exact; returns an orthonormal basis w0 of {w : X~ w = 0}.

    Float32 LayerNorm outputs are mean-free only to ~1e-7; without snapping, the "null" values
    would sit at ~1e-7 sigma_max and poison kappa. Directions below ``rtol`` are removed from the
    real rows (a perturbation of relative size <= rtol), first of the per-sequence centred rows
    (key shifts), then of the rows themselves.
    """
    x = probe.x.clone()
    wc = null_vectors(centred_rows(probe), rtol)
    for b in range(x.shape[0]):
        rows = probe.real[b]
        xb = x[b][rows]
        x[b][rows] = xb - ((xb - xb.mean(0, keepdim=True)) @ wc) @ wc.T
    probe.x = x
    w0 = null_vectors(x[probe.real], rtol)
    for b in range(x.shape[0]):
        rows = probe.real[b]
        x[b][rows] = x[b][rows] - (x[b][rows] @ w0) @ w0.T
    probe.x = x
    return null_vectors(x[probe.real], RANK_RTOL)


def _layout(blocks: tuple[str, ...], parts: dict[str, torch.Tensor], d: int, dim: int) -> torch.Tensor:
    """{block: (m, d, D')} -> (len(blocks) * d * D', m) in the scope's layout, zeros elsewhere."""
    m = next(iter(parts.values())).shape[0]
    ref = next(iter(parts.values()))
    z = ref.new_zeros(m, d, dim)
    return torch.cat([parts.get(b, z).reshape(m, -1) for b in blocks], 1).T


def candidates(
    probe: LinearisedLayer, h: int, blocks: tuple[str, ...], w0: torch.Tensor
) -> dict[str, NullGroup]:
    """Every candidate group of head h for a scope over ``blocks``, each with its closed form
    when it has one (``gauge``: input-side on one block, or the gauge of Q and K)."""
    d, dim = probe.head_dim, probe.dim
    out: dict[str, NullGroup] = {}
    if w0.shape[1]:
        for b in blocks:
            directions = _layout(blocks, {b: rows_equal(w0, d)}, d, dim)
            out[f"input_null_{b}"] = NullGroup(f"input_null_{b}", frozenset(b), directions, input_side=w0)
    inp = probe.head_inputs(h, blocks)
    for name, parts in probe.family.symmetries(inp).items():
        parts = {b: p for b, p in parts.items() if p.shape[0]}
        if parts and set(parts) <= set(blocks):
            touched = frozenset(b for b, p in parts.items() if bool(p.abs().max() > 0))
            group = NullGroup(name, touched, _layout(blocks, parts, d, dim))
            if len(touched) == 1:
                group.input_side = gauge.input_side(parts[next(iter(touched))])
            elif touched == {"q", "k"}:
                m = gauge.gauge_maps(parts["q"], parts["k"], inp.w["q"], inp.w["k"])
                if m is not None:
                    group.maps = (m, inp.w["q"], inp.w["k"])
                    if m.shape[0] == d * d:  # the whole gauge
                        group.gauge, group.unit_gauge = (inp.w["q"], inp.w["k"]), gauge.is_unit_basis(m)
            out[name] = group
    return out


def verified_groups(
    probe: LinearisedLayer,
    blocks: tuple[str, ...],
    w0: torch.Tensor,
    apply: Callable[[int, torch.Tensor], torch.Tensor],
    seed: int = 0,
    transform: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[list[NullGroup]], dict[str, float]]:
    """Per head, the candidate groups that ``apply(h, V)`` (= J_h V in the scope's layout) maps to
    zero; and {kept group: a bound on J's largest gain on it, over all heads} (``group_gain``).
    ``transform(h, V)`` maps candidates to the layout ``apply`` takes (a family's reduced
    coordinates); a group that vanishes there lies among the directions the reduction removed."""
    gen = torch.Generator().manual_seed(seed)
    heads = range(probe.num_heads)
    cands = [candidates(probe, h, blocks, w0) for h in heads]
    if transform is not None:
        for h in heads:
            for name, g in list(cands[h].items()):
                mapped = transform(h, g.directions)
                if mapped is g.directions:  # no reduction: the group as it is
                    continue
                if float(mapped.norm()) <= 1e-10 * float(g.directions.norm()):
                    del cands[h][name]
                else:
                    cands[h][name] = NullGroup(g.name, g.blocks, mapped)  # reduced: no closed form
    size = len(blocks) * probe.head_dim * probe.dim
    zero = torch.zeros(size, 1, dtype=torch.float64, device=probe.x.device)
    sizes = [transform(h, zero).shape[0] if transform else size for h in heads]
    names = [n for n in dict.fromkeys(n for c in cands for n in c) if all(n in c for c in cands)]
    # One product per head: a random direction (J's typical gain) and two random combinations
    # of every group, side by side.
    norms = []
    for h in heads:
        probes = [normal_draws(gen, sizes[h], 1, dtype=torch.float64, device=probe.x.device)]
        for name in names:
            g = cands[h][name].directions
            probes.append(g @ normal_draws(gen, g.shape[1], 2, dtype=torch.float64, device=g.device))
        v = torch.cat(probes, 1)
        norms.append((apply(h, v).norm(dim=0), v.norm(dim=0)))
    reference = max(float(out[0] / inp[0]) for out, inp in norms) if norms else 0.0
    kept: list[list[NullGroup]] = [[] for _ in heads]
    gains: dict[str, float] = {}
    for j, name in enumerate(names):
        cols = slice(1 + 2 * j, 3 + 2 * j)
        if all(bool((out[cols] <= ACCEPT_RTOL * reference * inp[cols]).all()) for out, inp in norms):
            for h in heads:
                kept[h].append(cands[h][name])
            gains[name] = max(
                group_gain(out[cols], inp[cols], cands[h][name].directions.shape[1])
                for h, (out, inp) in enumerate(norms)
            )
    return kept, gains


def group_gain(out: torch.Tensor, inp: torch.Tensor, m: int) -> float:
    """A bound on J's largest gain over an m-dimensional group from random combinations v of it
    (||J v|| = ``out``, ||v|| = ``inp``): sqrt(m) times their largest ratio. For orthonormal
    directions E ||J v||^2 = ||J G||_F^2 >= sigma_max(J G)^2 while E ||v||^2 = m, so the ratio reads
    the group's root-mean-square gain, which sqrt(m) lifts to at least its largest (in expectation)."""
    return math.sqrt(m) * float((out / inp.clamp_min(1e-300)).max())
