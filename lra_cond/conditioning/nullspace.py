"""Step 2 of the probe: find and verify J's exact null space, per head and scope (the whole head, or
one block alone).

Candidates:

* **Input null space** (every family). If the probe rows all lie in a subspace (X~ w = 0), any
  direction u w^T of a projection leaves its output unchanged: d directions per block and per null
  vector w. With the augmented input X~ = [X, 1], a LayerNorm's rows give w = [1/gamma, -c] for any
  bias beta (c = beta . (1/gamma)), so this count does not change as beta leaves 0.
* **The family's own symmetries** (``FamilyJacobian.symmetries`` in ``conditioning/families/``): the
  gauge of bilinear scores, key shifts under softmax, normalisation scales, linear attention's
  key/value statistics, ...
* **A family's support** (``FamilyJacobian.support``): blocks that reach the output only through a
  subspace span(P) are replaced by the columns J_S P; the rest of their coordinates is null.

A group is accepted when J applied to two random combinations of it is zero relative to J's
typical gain (``verified_groups``): if J restricted to the group were not zero, a random combination
would be null with probability zero, so two products verify the whole group, for any family. The
same products bound J's largest gain on the group (``group_gain``), which the probe compares with
its cut (rtol * sigma_max) afterwards: one tolerance decides what is null.

``scope_nulls`` assembles each head's verified groups on a scope into a basis of their span
(``ScopeNull``), with their closed forms where the groups are the gauge and input-side directions
(``ScopeNull.gauge`` and ``.null_inputs``: the next step then builds the complement in closed form).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from lra_cond.conditioning.families.base import Support, rows_equal
from lra_cond.conditioning.linearised import HeadJacobian, LinearisedLayer
from lra_cond.linalg import (
    RANK_RTOL,
    normal_draws,
    null_vectors,
    span_union,
)

GAUGE_RTOL = 1e-10  # a group is the gauge (or input-side) when its directions fit that form to this


def row_space(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal bases (span, complement) of the span of ``rows`` (n, D') and of its orthogonal
    complement, from the eigenvectors of rows^T rows (eigenvalues above 1e-10 of the largest)."""
    lam, vecs = torch.linalg.eigh(rows.T @ rows)
    inside = lam > 1e-10 * max(float(lam[-1]), 1e-300)
    return vecs[:, inside], vecs[:, ~inside]


def input_side(directions: torch.Tensor) -> torch.Tensor | None:
    """For one block's directions (m, d, D'): an orthonormal basis W (D', t) when they span exactly
    {u w^T : w in span W} (m = d t independent directions), else None."""
    m, d, dim = directions.shape
    span = row_space(directions.reshape(m * d, dim))[0]
    if m != d * span.shape[1]:
        return None
    flat = directions.reshape(m, -1)
    g = flat @ flat.T
    lam_g = torch.linalg.eigvalsh(g)
    return span if float(lam_g[0]) > 1e-10 * float(lam_g[-1]) else None


def gauge_maps(
    dq: torch.Tensor, dk: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor
) -> torch.Tensor | None:
    """The M_i (m, d, d) when every direction (dq_i, dk_i) is (M_i W_Q, -M_i^T W_K), any number of
    them (part of the gauge: normalized attention's rotations, M antisymmetric), else None."""
    m = dq @ torch.linalg.pinv(w_q)  # (m, d, d): the least-squares M_i
    fit_q = (dq - m @ w_q).norm() <= GAUGE_RTOL * dq.norm()
    fit_k = (dk + m.transpose(1, 2) @ w_k).norm() <= GAUGE_RTOL * max(float(dk.norm()), 1e-300)
    return m if bool(fit_q and fit_k) else None


def is_unit_basis(m: torch.Tensor) -> bool:
    """Whether the M_i are the unit matrices E_ac in ``jac.gauge``'s order (index a d + c): an
    orthonormal set, so each one's distance to the span of the others is 1."""
    d = m.shape[-1]
    eye = torch.eye(d * d, dtype=m.dtype, device=m.device).reshape(d * d, d, d)
    return float((m - eye).norm()) <= 1e-8 * d


def pivot_bound(gauge: tuple[torch.Tensor, torch.Tensor], null_inputs: dict[str, torch.Tensor]) -> float:
    """A lower bound on what ``linalg.span_union``'s independence test measures for a gauge whose M_i
    are an orthonormal set (``is_unit_basis``), joined after the null inputs: each direction's
    distance to the span of the null inputs' directions and of the gauge's before it, over its own
    norm. The test forms the Gram of those directions (~4160 x 1024 per head at the reference
    shape); this bound costs four d x D' SVDs (the gain: docs/benchmarks.md).

    The gauge is L(M) = (M A_Q, -M^T A_K), with ||L(M)|| <= hi ||M||, hi^2 = s_max(A_Q)^2 +
    s_max(A_K)^2. Off the null inputs' {u w^T : w in span W_b} it is (M A'_Q, -M^T A'_K), A'_b =
    A_b (I - W_b W_b^T), of norm >= lo ||M||, lo^2 = s_min(A'_Q)^2 + s_min(A'_K)^2. So that
    distance, over the norm, is at least lo / hi times M_i's distance to the span of the others: 1."""
    lo = hi = 0.0
    for b, a in zip("qk", gauge):
        w = null_inputs.get(b)
        s_proj = torch.linalg.svdvals(a if w is None else a - (a @ w) @ w.T)
        lo, hi = lo + float(s_proj[-1]) ** 2, hi + float(torch.linalg.svdvals(a)[0]) ** 2
    return math.sqrt(lo / hi) if hi > 0 else 0.0


@dataclass
class NullGroup:
    """A verified null group of one head: its name, the blocks it touches, its directions."""

    name: str
    blocks: frozenset[str]
    directions: torch.Tensor  # (head_size of its scope, m)
    # its closed form, when it has one: the null inputs W_b of a one-block input-side group (every
    # u w^T, w in span W_b), or the (W~_Q, W~_K) of the gauge
    input_side: torch.Tensor | None = None
    gauge: tuple[torch.Tensor, torch.Tensor] | None = None
    unit_gauge: bool = False  # the gauge's M_i are the unit matrices (``is_unit_basis``)


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
    # every group outside V in closed form, when each has one (``_closed_forms``): the gauge's
    # (W~_Q, W~_K) if it is among them, and per block an orthonormal basis of its null inputs
    # (every u w^T, w in their span, null); None: some group outside V has no closed form
    gauge: tuple[torch.Tensor, torch.Tensor] | None = None
    null_inputs: dict[str, torch.Tensor] | None = None


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
    when it has one (input-side on one block, or the gauge of Q and K)."""
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
                group.input_side = input_side(parts[next(iter(touched))])
            elif touched == {"q", "k"}:
                m = gauge_maps(parts["q"], parts["k"], inp.w["q"], inp.w["k"])
                if m is not None and m.shape[0] == d * d:  # the whole gauge
                    group.gauge, group.unit_gauge = (inp.w["q"], inp.w["k"]), is_unit_basis(m)
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


SPAN_RTOL = 1e-6  # a group's direction counts when this far from the span of those before it


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
    gauge, null_inputs = _closed_forms(groups)
    parts, added = [], [0] * len(groups)
    for members in _row_components(supports):
        rows = torch.stack([supports[i] for i in members]).any(0)
        order = sorted(members, key=lambda i: groups[i].directions.shape[1])
        # the gauge joined last after null inputs alone (``_closed_forms``): independent in closed form
        known = gauge is not None and groups[order[-1]].unit_gauge
        known = known and pivot_bound(gauge, null_inputs) > 10 * SPAN_RTOL
        sub, added_sorted = span_union([groups[i].directions[rows] for i in order], SPAN_RTOL, known)
        for i, n in zip(order, added_sorted):
            added[i] = n
        part = like.new_zeros(size, sub.shape[1])
        part[rows] = sub
        parts.append(part)
    split = all(g.blocks == {"v"} or "v" not in g.blocks for g in groups)
    basis = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    return ScopeNull(basis, split, gauge=gauge, null_inputs=null_inputs), added


def _closed_forms(
    groups: list[NullGroup],
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
    """The groups outside V in closed form (``ScopeNull.gauge`` and ``.null_inputs``), or
    (None, None) when one of them has none."""
    inputs: dict[str, list[torch.Tensor]] = {}
    gauge = None
    for g in groups:
        if g.blocks == {"v"}:
            continue
        if g.gauge is not None and gauge is None:
            gauge = g.gauge
        elif g.input_side is not None:
            inputs.setdefault(next(iter(g.blocks)), []).append(g.input_side)
        else:
            return None, None
    # their union per block (a key shift holds the input's null directions)
    return gauge, {b: row_space(torch.cat(ws, 1).T)[0] for b, ws in inputs.items()}


@dataclass
class _Reduction:
    """A scope's columns with a family's ``support`` applied: its blocks reach the output only
    through span(P), so they are replaced by the columns J_S P (the rest of their coordinates,
    ``removed`` = n_S - r directions, are null); the scope's other blocks (``kron``) are unchanged."""

    support: Support
    jac: HeadJacobian  # every block's products go through it (no columns formed)
    order: list[str]  # the scope's blocks, in order
    size: int
    kron: list[str] = field(init=False)
    dense: torch.Tensor = field(init=False)  # J_S P

    def __post_init__(self) -> None:
        s = self.support
        self.kron = [b for b in self.order if b not in s.blocks]
        self.dense = s.columns if s.columns is not None else self.jac.columns(s.blocks) @ s.p

    @property
    def removed(self) -> int:
        return self.support.p.shape[0] - self.support.p.shape[1]

    @property
    def n_kron(self) -> int:
        return len(self.kron) * self.size

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:  # v in the reduced layout [kron, dense]
        n = self.n_kron
        out = self.dense @ v[n:]
        return out + self.jac.apply(v[:n], self.kron) if self.kron else out

    def coordinates(self, v: torch.Tensor) -> torch.Tensor:
        """Directions in the original layout -> the reduced layout (their component in span(P);
        the rest is among the removed null directions)."""
        parts = {b: v[i * self.size : (i + 1) * self.size] for i, b in enumerate(self.order)}
        kron = torch.cat([parts[b] for b in self.kron]) if self.kron else v[:0]
        return torch.cat([kron, self.support.p.T @ torch.cat([parts[b] for b in self.support.blocks])])

    def verified(self) -> float | None:
        """J vanishes on the support's complement and the columns are J_S P (two random directions
        each), relative to J's gain: a bound on J's gain on the complement (``group_gain``), or
        None when either fails."""
        p = self.support.p
        gen = torch.Generator().manual_seed(1)
        r = normal_draws(gen, p.shape[0], 2, dtype=p.dtype, device=p.device)
        off = r - p @ (p.T @ r)
        y = normal_draws(gen, p.shape[1], 2, dtype=p.dtype, device=p.device)
        # one pass over J_S (T d x n_S, the largest blocks here) for all three products, through the
        # blocks as the family gave them, J_S's columns never formed
        probes = torch.cat([r, off, p @ y], 1)
        j_r, j_off, j_py = self.jac.apply(probes, self.support.blocks).split(2, 1)
        gain = max(float(j_r.norm() / r.norm()), 1e-300)
        if float(j_off.norm()) > ACCEPT_RTOL * gain * float(off.norm()):
            return None
        diff = self.dense @ y - j_py
        if float(diff.norm()) > ACCEPT_RTOL * gain * float(y.norm()):
            return None
        return group_gain(j_off.norm(dim=0), off.norm(dim=0), self.removed)


def scope_nulls(
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
    reduced = [None if s is None else _Reduction(s, jacs[h], list(sb), size) for h, s in enumerate(supports)]

    def apply(h: int, v: torch.Tensor) -> torch.Tensor:
        return jacs[h].apply(v, sb) if reduced[h] is None else reduced[h] @ v

    def transform(h: int, v: torch.Tensor) -> torch.Tensor:
        return v if reduced[h] is None else reduced[h].coordinates(v)

    groups, gains = verified_groups(replace(probe, blocks=sb), sb, w0, apply, transform=transform)
    null_gain = 0.0
    nulls = []
    for h in heads:
        red = reduced[h]
        width = len(sb) * size if red is None else red.n_kron + red.dense.shape[1]
        null, added = _scope_null(groups[h], width, probe.x)
        # only a group that adds directions to the basis is deflated: one inside the span of those
        # before it (linear's feature gauge inside Q's null inputs) is not, and its own rounding
        # (its basis is formed less exactly) bounds nothing the cut excludes
        null_gain = max([null_gain, *(gains[g.name] for g, n in zip(groups[h], added) if n)])
        if red is not None:
            off_gain = red.verified()
            if off_gain is None:
                raise RuntimeError(f"{type(probe.family).__name__}.support is not a support of J")
            null_gain = max(null_gain, off_gain)
            sup = red.support  # verified groups are already in the reduced layout
            null = ScopeNull(null.basis, False, red.kron, red.dense, red.removed, sup.product, sup.gram)
            group_ranks[sup.name] = group_ranks.get(sup.name, 0) + (red.removed if count else 0)
        nulls.append(null)
        if count:
            for g, n in zip(groups[h], added):
                if n:
                    group_ranks[g.name] = group_ranks.get(g.name, 0) + n
    return nulls, null_gain
