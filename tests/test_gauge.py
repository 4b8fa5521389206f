"""The gauge's complement in closed form (``conditioning/coordinates.py``) against the dense null space it
replaces: an orthonormal basis of exactly its orthogonal complement, the same kappa as the
Householder deflation, and groups recognised only when they have that form."""

from __future__ import annotations

import pytest
import torch

from lra_cond.conditioning import coordinates, jacobian_condition, nullspace
from lra_cond.conditioning.families import base as jac
from lra_cond.linalg import null_vectors
from lra_cond.models.attention import build_attention


def _null_basis(w_q: torch.Tensor, w_k: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The gauge and every u w^T (w in W_b) on [Q | K], densely: (2 d D', m)."""
    d, dim = w_q.shape
    g = jac.gauge(w_q, w_k)
    cols = [torch.cat([g["q"].reshape(d * d, -1), g["k"].reshape(d * d, -1)], 1).T]
    for i, w in enumerate(inputs):
        side = jac.rows_equal(w, d).reshape(-1, d * dim)
        zero = torch.zeros_like(side)
        cols.append(torch.cat([side, zero] if i == 0 else [zero, side], 1).T)
    return torch.cat(cols, 1)


@pytest.mark.parametrize("t_q,t_k", [(0, 0), (1, 2), (2, 1)])
def test_the_closed_form_is_an_orthonormal_basis_of_the_null_space_s_complement(t_q: int, t_k: int) -> None:
    gen = torch.Generator().manual_seed(t_q + 3 * t_k)
    d, dim = 3, 7
    w_q, w_k = (torch.randn(d, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    inputs = [torch.linalg.qr(torch.randn(dim, t, generator=gen, dtype=torch.float64)).Q for t in (t_q, t_k)]
    null = _null_basis(w_q, w_k, inputs)
    k = torch.linalg.matrix_rank(null).item()
    assert k == d * d + d * (t_q + t_k)
    closed = coordinates.gauge_complement((w_q, w_k), {"q": inputs[0], "k": inputs[1]}, ["q", "k"], k, d, dim)
    assert closed is not None
    eye = torch.eye(d, dtype=torch.float64)
    on_q = torch.einsum("bj,ci,ij->bcij", closed.u[1], eye, closed.alpha).reshape(d * d, d * d)
    on_k = torch.einsum("bi,cj,ij->bcij", closed.u[0], eye, closed.beta).reshape(d * d, d * d)
    comp = torch.cat([on_q, on_k])  # its columns formed, against the object that never forms them
    v, y = (torch.randn(n, 4, generator=gen, dtype=torch.float64) for n in (d * d, 2 * d * d))
    torch.testing.assert_close(closed.columns(v), comp @ v, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(closed.columns_t(y), comp.T @ y, rtol=1e-13, atol=1e-13)
    # the whole basis, against one assembled from the formed columns: [perp_Q, perp_K | rows (x) comp]
    n_perp = sum(d * p.shape[1] for p in closed.perp)
    u = torch.randn(closed.n, 4, generator=gen, dtype=torch.float64)
    par = comp @ u[n_perp:]
    formed, col = [], 0
    for i, (perp, rows) in enumerate(zip(closed.perp, closed.rows)):
        wp = d * perp.shape[1]
        on_perp = torch.einsum("cj,ajk->ack", perp, u[col : col + wp].reshape(d, -1, 4))
        on_rows = torch.einsum("cj,ajk->ack", rows, par[i * d * d : (i + 1) * d * d].reshape(d, d, 4))
        formed.append((on_perp + on_rows).reshape(-1, 4))
        col += wp
    formed = torch.cat(formed)
    torch.testing.assert_close(closed @ u, formed, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(closed.T @ formed, u, rtol=1e-12, atol=1e-12)
    b = closed @ torch.eye(closed.n, dtype=torch.float64)  # the basis in the blocks' layout
    assert b.shape == (2 * d * dim, 2 * d * dim - k)
    assert torch.allclose(b.T @ b, torch.eye(b.shape[1], dtype=torch.float64), atol=1e-13)
    assert (b.T @ null).abs().max() < 1e-13 * null.abs().max()
    # the complement's columns of J from Q's columns alone: on a random "Jacobian" that sees
    # (W_Q, W_K) only through Omega = W~_Q^T W~_K off the null inputs (so the gauge and every null
    # input are null), scale(J_Q (U_K (x) Vh_Q^T)) equals J comp, and gram its Gram
    t = 5
    p_q, p_k = (torch.eye(dim, dtype=torch.float64) - w @ w.T for w in inputs)
    phi = torch.randn(t * d, dim * dim, generator=gen, dtype=torch.float64)

    def moved(d_omega: torch.Tensor) -> torch.Tensor:  # J's response to dOmega (.., dim, dim)
        return phi @ (p_q @ d_omega @ p_k).reshape(-1, dim * dim).T

    unit = torch.eye(d * dim, dtype=torch.float64).reshape(-1, d, dim)
    j_q = moved(unit.transpose(1, 2) @ w_k)  # dOmega = dW_Q^T W_K
    j_k = moved(w_q.T @ unit)  # dOmega = W_Q^T dW_K
    assert (torch.cat([j_q, j_k], 1) @ null).abs().max() < 1e-12 * j_q.abs().max()
    comp_cols = torch.cat([j_q, j_k], 1) @ b[:, n_perp:]
    # ``factor``'s columns, densely (kron of transposed views fails in torch: copies)
    on_q = j_q @ torch.kron(closed.u[1].contiguous(), closed.rows[0].contiguous())
    assert torch.allclose(closed.scale(on_q), comp_cols, atol=1e-12 * comp_cols.abs().max())
    want = comp_cols.T @ comp_cols
    assert torch.allclose(closed.gram(on_q.T @ on_q), want, atol=1e-12 * want.abs().max())


def test_a_null_input_among_the_gauge_s_own_is_left_to_the_dense_deflation() -> None:
    gen = torch.Generator().manual_seed(0)
    d, dim = 3, 7
    w_q, w_k = (torch.randn(d, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    w = w_q[:1].T / w_q[0].norm()  # a row of W_Q itself is a null input: the forms overlap
    assert coordinates.gauge_complement((w_q, w_k), {"q": w}, ["q", "k"], d * d + d, d, dim) is None
    # another group
    assert coordinates.gauge_complement((w_q, w_k), {}, ["q", "k"], d * d + 1, d, dim) is None
    assert coordinates.gauge_complement(None, {}, ["q", "k"], d * d, d, dim) is None


def _span_union_pivots(gauge_cols: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """What ``span_union`` tests for the gauge joined after ``other``: each gauge direction's
    distance to span(other) and the gauge's before it, over its own norm (Cholesky pivots), densely."""
    q = torch.linalg.qr(other).Q if other.shape[1] else other
    projected = gauge_cols - q @ (q.T @ gauge_cols)
    scaled = projected / gauge_cols.norm(dim=0)
    return torch.linalg.cholesky(scaled.T @ scaled).diagonal()


@pytest.mark.parametrize("t_q,t_k,squeeze", [(0, 0, 1.0), (1, 2, 1.0), (2, 1, 1e-3), (2, 2, 1e-6)])
def test_pivot_bound_is_below_every_pivot_span_union_would_measure(
    t_q: int, t_k: int, squeeze: float
) -> None:
    """``nullspace.pivot_bound`` (which lets ``span_union`` skip its independence test for the gauge) is a
    lower bound on those pivots, for well- and ill-conditioned W_Q, W_K (row 0 of both squeezed) and
    any null inputs; the squeeze drives both toward 0 together."""
    gen = torch.Generator().manual_seed(2)
    d, dim = 4, 9
    w_q, w_k = (torch.randn(d, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    w_q[0] *= squeeze  # with W_K's: L(E_00) = (E_00 W_Q, -E_00 W_K) shrinks (one alone keeps L injective)
    w_k[0] *= squeeze
    inputs = [null_vectors(torch.randn(dim - t, dim, generator=gen, dtype=torch.float64)) for t in (t_q, t_k)]
    basis = _null_basis(w_q, w_k, inputs)
    pivots = _span_union_pivots(basis[:, : d * d], basis[:, d * d :])
    bound = nullspace.pivot_bound((w_q, w_k), {b: w for b, w in zip("qk", inputs) if w.shape[1]})
    assert 0 < bound <= float(pivots.min()) * (1 + 1e-9)
    assert bound > 0.01 if squeeze == 1.0 else bound < 0.01


def test_a_gauge_proven_independent_skips_the_test_with_the_same_null_basis(monkeypatch) -> None:
    """``_scope_null`` with the gauge's independence proven (``pivot_bound``) skips the Gram test on
    the gauge's directions and returns exactly what the test would have (same basis, same ranks)."""
    import lra_cond.linalg as linalg
    from lra_cond.conditioning.nullspace import _scope_null

    gen = torch.Generator().manual_seed(3)
    d, dim = 3, 7
    w_q, w_k = (torch.randn(d, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    w = null_vectors(torch.randn(dim - 1, dim, generator=gen, dtype=torch.float64))
    cols = _null_basis(w_q, w_k, [w])
    g = jac.gauge(w_q, w_k)
    unit = nullspace.gauge_maps(g["q"], g["k"], w_q, w_k)
    assert unit is not None and nullspace.is_unit_basis(unit)
    groups = [
        nullspace.NullGroup("gauge", frozenset("qk"), cols[:, : d * d], gauge=(w_q, w_k), unit_gauge=True),
        nullspace.NullGroup("input_null_q", frozenset("q"), cols[:, d * d :], input_side=w),
    ]
    tested = []
    original = linalg._independent
    monkeypatch.setattr(
        linalg, "_independent", lambda m, rtol: tested.append(m.shape[1]) or original(m, rtol)
    )
    fast, fast_added = _scope_null(groups, 2 * d * dim, w_q)
    assert d * d not in tested  # the gauge's test was skipped
    monkeypatch.setattr(nullspace, "pivot_bound", lambda gauge, null_inputs: 0.0)
    slow, slow_added = _scope_null(groups, 2 * d * dim, w_q)
    assert d * d in tested  # and taken without the proof
    assert fast_added == slow_added == [d * d, d]
    assert torch.equal(fast.basis, slow.basis)


def test_groups_are_recognised_only_in_their_closed_form() -> None:
    gen = torch.Generator().manual_seed(1)
    d, dim = 3, 6
    w_q, w_k = (torch.randn(d, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    g = jac.gauge(w_q, w_k)
    assert nullspace.gauge_maps(g["q"], g["k"], w_q, w_k) is not None
    mixed = torch.randn(d * d, d * d, generator=gen, dtype=torch.float64)  # another basis of it
    flat = torch.einsum("mn,nbc->mbc", mixed, g["q"]), torch.einsum("mn,nbc->mbc", mixed, g["k"])
    assert nullspace.gauge_maps(*flat, w_q, w_k) is not None
    assert nullspace.is_unit_basis(nullspace.gauge_maps(g["q"], g["k"], w_q, w_k))
    assert not nullspace.is_unit_basis(nullspace.gauge_maps(*flat, w_q, w_k))  # a gauge, another basis
    nudged = g["k"] + 1e-6 * torch.randn(g["k"].shape, generator=gen)
    assert nullspace.gauge_maps(g["q"], nudged, w_q, w_k) is None
    assert nullspace.gauge_maps(g["q"], -g["k"], w_q, w_k) is None  # (M W_Q, +M^T W_K): not a gauge
    orth = jac.orthogonal_gauge(w_q, w_k)  # a part of the gauge (M antisymmetric): d (d - 1) / 2 maps
    part = nullspace.gauge_maps(orth["q"], orth["k"], w_q, w_k)
    assert part is not None and part.shape[0] == d * (d - 1) // 2 < d * d
    w = null_vectors(torch.randn(4, dim, generator=gen, dtype=torch.float64))  # (dim, 2)
    side = nullspace.input_side(jac.rows_equal(w, d))
    assert side is not None and side.shape == (dim, 2)
    assert torch.allclose(side @ side.T, w @ w.T, atol=1e-13)  # the same span
    assert nullspace.input_side(jac.rows_equal(w, d)[:-1]) is None  # one u w^T missing
    assert nullspace.input_side(jac.scale(w_q)) is None  # W_Q itself: not of that form


@pytest.mark.parametrize(
    "family,options",
    [
        ("softmax", {}),
        ("nystrom", {"num_landmarks": 12}),
        ("nystrom", {"num_landmarks": 16, "pinv_iterations": 3, "conv_kernel": 5}),
    ],
    ids=lambda v: str(v),
)
def test_the_closed_form_gives_the_householder_deflation_s_kappa(
    family: str, options: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Biases and a LayerNorm bias give null inputs on Q and K (and a key shift on K) beside the
    gauge: the closed form takes the whole head and gives the same values as the dense deflation
    (``coordinates.gauge_complement`` returning None) and as dense."""
    torch.manual_seed(3)
    layer = build_attention(family, 16, 2, **options)
    with torch.no_grad():
        layer.q_proj.bias.normal_()
        layer.k_proj.bias.normal_()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 64, 16, generator=gen, dtype=torch.float64)
    x = torch.nn.functional.layer_norm(x, (16,)) + 0.3 * torch.randn(16, generator=gen, dtype=torch.float64)
    taken = []
    real = coordinates.gauge_complement

    def spy(*args):  # noqa: ANN002, ANN202
        taken.append(real(*args))
        return taken[-1]

    monkeypatch.setattr(coordinates, "gauge_complement", spy)
    closed = jacobian_condition(layer, x)
    assert len(taken) == 2 and all(c is not None for c in taken)
    monkeypatch.setattr(coordinates, "gauge_complement", lambda *args: None)
    householder = jacobian_condition(layer, x)
    dense = jacobian_condition(layer, x, method="dense")
    assert closed.n_null == householder.n_null == dense.n_null == closed.n_null_expected
    assert closed.kappa == pytest.approx(householder.kappa, rel=1e-9)
    assert closed.kappa == pytest.approx(dense.kappa, rel=1e-7)
    for b in "qkv":  # the whole head takes a block's own pieces from its Gram alone: ~1e-9 apart
        assert closed.per_block[b].kappa == pytest.approx(householder.per_block[b].kappa, rel=1e-8)
        assert closed.per_block[b].kappa == pytest.approx(dense.per_block[b].kappa, rel=1e-8)
