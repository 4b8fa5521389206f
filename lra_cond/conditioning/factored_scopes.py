"""Scopes whose blocks all come as a family's factors: every Gram from the factors
(``factored``: T d^2 D'^2 per pair of blocks, no rows formed), the exact rows an operator
(``DeflatedRows``). A single block with its input-side null directions deflated
(``factored_scope``), or blocks with every coordinate kept and their few null directions
regularised (``factored_kept``); each block's preconditioned factors and Gram are formed once per
probe and shared with the whole head (``block_alone``, ``kept_coordinates``)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch

from lra_cond.conditioning import factored
from lra_cond.conditioning.deflation import DeflatedRows, Deflation, deflation, input_rotation
from lra_cond.conditioning.families.base import Factored
from lra_cond.conditioning.preconditioner import Preconditioner, input_whitening, whitened
from lra_cond.linalg import gram, orthonormal_basis


def block_grams(fs1: list[Factored], fs2: list[Factored] | None, like: torch.Tensor) -> torch.Tensor:
    """[J_1 .. J_n]^T [J'_1 .. J'_m] for factored blocks (any input widths), every pair through the
    factors; ``fs2`` None: the Gram of ``fs1`` (each off-diagonal pair once)."""
    sym = fs2 is None
    fs2 = fs1 if fs2 is None else fs2
    off1, off2 = ([0, *accumulate(f.left.shape[-1] * f.right.shape[-1] for f in fs)] for fs in (fs1, fs2))
    g = like.new_empty(off1[-1], off2[-1])
    for i, fi in enumerate(fs1):
        rows = slice(off1[i], off1[i + 1])
        for j in range(i if sym else 0, len(fs2)):
            cols = slice(off2[j], off2[j + 1])
            g[rows, cols] = _self_gram(fi) if sym and j == i else factored.cross_gram(fi, fs2[j])
            if sym and j != i:
                g[cols, rows] = g[rows, cols].T
    return g


def _self_gram(f: Factored) -> torch.Tensor:
    """J^T J of a factored block, kept in its cache: the preconditioned factors of a block with
    every coordinate kept are shared by its scopes (``_kept_factor``), so the whole head and the
    block alone read the same Gram."""
    if "self_gram" not in f.cache:
        f.cache["self_gram"] = factored.cross_gram(f, f)
    return f.cache["self_gram"]


def _cross_grams(pre: list[Factored], columns: torch.Tensor | None = None) -> torch.Tensor:
    """[J_1 .. J_n | D]^T [J_1 .. J_n | D] for factored blocks J_b and optional dense columns D,
    every block J_b^T J_b' and J_b^T D through the factors."""
    g = block_grams(pre, None, pre[0].left)
    if columns is None:
        return g
    across = torch.cat([factored.apply_t(f, columns, f.left.shape[-1]) for f in pre])
    # filled in place: nested cats copied every ~300 MB block twice (0.23 s a head, tiny split)
    n = g.shape[0]
    out = g.new_empty(n + columns.shape[1], n + columns.shape[1])
    out[:n, :n], out[:n, n:], out[n:, :n], out[n:, n:] = g, across, across.T, gram(columns)
    return out


def kept_coordinates(
    fs: list[Factored], d: int, x: torch.Tensor
) -> tuple[Preconditioner, list[Factored], Deflation]:
    """Factored blocks with every coordinate kept: their Kronecker preconditioner L_b (x) W, the
    preconditioned factors, and the identity ``Deflation`` of their coordinates."""
    dim = x.shape[1]
    t, pre = Preconditioner(), []
    for f in fs:
        lb, w, p = _kept_factor(f, x)
        t.add_kron(lb, w)
        pre.append(p)
    return t, pre, deflation(x.new_zeros(len(fs) * d * dim, 0), d, dim, len(fs))


def _kept_factor(f: Factored, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Factored]:
    """(L_b, W, the factors of J (L_b (x) W)) of a block with every coordinate kept, formed once
    per probe input (kept in its cache): the whole head and the block alone share them, and with
    them the block's Gram (``_self_gram``)."""
    cached = f.cache.get("kept")
    if cached is None or cached[0] is not x:
        lb, w = factored.output_side(f), input_whitening(x)
        f.cache["kept"] = cached = (x, lb, w, factored.preconditioned(f, lb, w))
    return cached[1:]


def factored_kept(
    fs: list[Factored],
    columns: torch.Tensor | None,
    d: int,
    x: torch.Tensor,
    product: Callable[[torch.Tensor], torch.Tensor] | None = None,
    columns_gram: Callable[[], torch.Tensor] | None = None,
) -> tuple[list[DeflatedRows], Preconditioner, torch.Tensor]:
    """A scope with few null directions (every coordinate kept, the nulls regularised) whose blocks
    all come as factors, next to optional dense columns (a family's support columns, e.g. linear
    attention's whole head): its exact rows as an operator, its preconditioner (L_b (x) W per
    block, R_D for the columns) and the preconditioned Gram from the factors (``_cross_grams``:
    T d^2 D'^2 per pair of blocks and T d (d + D') r_D against the columns, where the formed rows'
    Gram costs T d n^2). No cancellation: the same sums as the formed rows' Gram, in another order."""
    t, pre, identity = kept_coordinates(fs, d, x)
    scaled = None
    if columns is not None:
        r, scaled = whitened(columns, product, columns_gram)
        t.add_dense(r)
    rows = [DeflatedRows(fs, None, d, identity, columns)]
    return rows, t, _cross_grams(pre, scaled)


def block_alone(
    f: Factored, v: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Factored | None, torch.Tensor]:
    """Block f alone with its input side restricted to ``v`` (D', p orthonormal: the complement of
    its null inputs): (v, W, the factors of J (L_b (x) v W), their Gram), formed once (kept in its
    cache): the block's own scope (``factored_scope``) and the whole head's pieces of that block
    (``whole_head._closed_grams``) share it. The factors are None once the whole head no longer
    reads them (``release_whole_head_parts``)."""
    cached = f.cache.get("alone")
    if cached is None or cached[0] is not v:
        w = input_whitening(x @ v)
        pre = factored.preconditioned(f, factored.output_side(f), v @ w)
        f.cache["alone"] = (v, w, pre, factored.cross_gram(pre, pre))
    return f.cache["alone"]


def release_whole_head_parts(f: Factored) -> None:
    """Drop from the cache of a block whose Gram alone its whole head formed or shared
    (``block_alone``) what only that head reads, once it no longer does (before the
    head's solve): the correction's products (E^T B, V) and the preconditioned factors of the
    block alone. The Gram alone, its input side and the output side
    stay for the block's own scope, which reads nothing else (other blocks' caches, e.g. normalized
    attention's K, are read again by their own scopes). Measured at the reference shape (nystrom,
    ~100 MB a block; with the head's pieces freed before its solve): peak resident 2.31-2.43 ->
    1.83-1.90 GB, minor faults 445-483k -> 333-338k per probe, kappa unchanged, time within the
    noise (six probes each, alternating: 11.8-15.7 against 12.2-14.7 s)."""
    if "alone" not in f.cache:
        return
    f.cache.pop("correction", None)
    v, w, _, g = f.cache["alone"]
    f.cache["alone"] = (v, w, None, g)


def factored_scope(
    f: Factored, null: torch.Tensor, d: int, dim: int, x: torch.Tensor
) -> tuple[list[DeflatedRows], Preconditioner, torch.Tensor, torch.Tensor | None]:
    """A single block given as factors: its exact rows (an operator), Kronecker preconditioner and
    preconditioned Gram formed from the factors (``factored``) and the null directions left to
    regularise. When every null direction is input-side (u w^T: the par
    coordinates entirely null) they are deflated by rotating the input side (None left); otherwise
    the whole block is kept (``factored_kept``) and all of them are returned (an orthonormal basis)."""
    v_perp, v_par, k = input_rotation(null, d, dim)
    if k != d * v_par.shape[1]:
        return (*factored_kept([f], None, d, x), orthonormal_basis(null))
    # the par input coordinates carry null directions only (J vanishes there), so the output side
    # over v_perp is the block's own (shared with the whole head's scope); the block alone on them,
    # its input side rotated and whitened, may have been formed for the whole head (``block_alone``)
    cached = f.cache.get("alone")
    if cached is not None and cached[0].shape == v_perp.shape and _same_span(cached[0], v_par):
        v_perp = cached[0]
    v_perp, w, _, g = block_alone(f, v_perp, x)
    t = Preconditioner()
    t.add_kron(factored.output_side(f), w)
    on_perp = Deflation([v_perp], [v_par], v_par.new_zeros(d * v_par.shape[1], 0), d)
    return [DeflatedRows([f], None, d, on_perp)], t, g, None


def _same_span(v: torch.Tensor, v_par: torch.Tensor) -> bool:
    """Whether ``v`` (orthonormal) spans the orthogonal complement of ``v_par`` (sizes checked by
    the caller)."""
    return bool((v.T @ v_par).abs().max() <= 1e-12) if v_par.numel() else True
