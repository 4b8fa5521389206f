"""Gram matrices of Jacobian blocks given as per-token factors, without forming the blocks.

A block's rows (i, a) for token i and columns (b, c) (a d x D' weight, row-major) come from the
family as ``Factored`` (``conditioning/families/base.py``): token i's d x (d p) row block is
``query_local``: J_i[a, (b, c)] = G_i[a, b] x_i[c], or ``outer``: J_i[a, (b, c)] = q_i[b] R_i[a, c].
Every product here is a sum over tokens of d x p pieces, so it costs T d^2 p^2 flops where the
dense block's costs T d (d p)^2, and keeps nothing of size T x d x d p. A block's low-rank
correction E Z (rank r) adds products through its r columns: ~T d p r + (d p)^2 r.
"""

from __future__ import annotations

import torch

from lra_cond.conditioning.families.base import Factored, Mixing, TokenMixing
from lra_cond.linalg import kron_right


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
    return apply_t(base, mix.flat, base.left.shape[-1]).T


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
        out = out + mix.rotated(u).apply(zc.reshape(zc.shape[0], -1))
    return out


def apply(f: Factored, v: torch.Tensor, d: int) -> torch.Tensor:
    """J v for v (d p, k), as (T d, k): per token d x d and d x p products, never the block."""
    t, p, k = f.left.shape[0], f.right.shape[-1], v.shape[1]
    v3 = v.reshape(d, p, k)
    if f.kind == "query_local":  # G_i (V x_i): W[i, b] = sum_c x_i[c] V[b, c]
        w = torch.einsum("ic,bck->ibk", f.right, v3)
        out = (f.left @ w).reshape(t * d, k)
    else:
        w = torch.einsum("ib,bck->ick", f.left, v3)  # R_i (V^T q_i)
        out = (f.right @ w).reshape(t * d, k)
    if f.low_rank is not None:
        mix, z = f.low_rank
        out = out + mix.apply(z.reshape(z.shape[0], -1) @ v)
    return out


def apply_t(f: Factored, y: torch.Tensor, d: int) -> torch.Tensor:
    """J^T y for y (T d, k), as (d p, k)."""
    t, k = f.left.shape[0], y.shape[1]
    y3 = y.reshape(t, d, k)
    if f.kind == "query_local":  # sum_i x_i[c] (G_i^T y_i)[b]
        out = torch.einsum("ic,ibk->bck", f.right, f.left.transpose(1, 2) @ y3).reshape(-1, k)
    else:
        out = torch.einsum("ib,ick->bck", f.left, f.right.transpose(1, 2) @ y3).reshape(-1, k)
    if f.low_rank is not None:
        mix, z = f.low_rank
        out = out + z.reshape(z.shape[0], -1).T @ mix.apply_t(y)
    return out
