"""The fast exact path: every family's closed-form head Jacobian against forward-mode AD, the
spectrum routine's pieces (value elimination, preconditioner, the Cholesky check and its QR
fallback, block Lanczos) against plain computations, and the per-family null spaces."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lra_cond import linalg
from lra_cond.conditioning import coordinates, extremes, jacobian_condition, nullspace
from lra_cond.conditioning.coordinates import Preconditioner
from lra_cond.conditioning.extremes import top_eigenpair
from lra_cond.conditioning.linearised import linearise
from lra_cond.init import apply_init
from lra_cond.models.attention import ATTENTIONS, build_attention

FAMILY_VARIANTS = [
    ("softmax", {}),
    ("normalized", {}),
    ("normalized", {"normalize_v": True}),
    ("linear", {}),
    ("nystrom", {"num_landmarks": 5}),
    ("nystrom", {"num_landmarks": 3, "conv_kernel": 0}),  # fewer landmarks than d_h, no conv skip
    ("nystrom", {"num_landmarks": 16, "pinv_iterations": 3, "conv_kernel": 5}),  # empty landmarks
]


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


def padded_input(seed: int, batch: int, seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, dim, generator=gen, dtype=torch.float64)
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[-1, seq // 2 :] = True
    return x, mask


@pytest.mark.parametrize("family,options", FAMILY_VARIANTS, ids=lambda v: str(v))
@pytest.mark.parametrize("blocks", ["qkv", "qk", "kv", "q", "v"])
def test_closed_form_equals_forward_mode(family: str, options: dict, blocks: str) -> None:
    torch.manual_seed(0)
    layer = build_attention(family, 12, 3, head_dim=5, **options)  # H*d_h != D, with biases
    x, mask = padded_input(0, 3, 20, 12)
    probe = linearise(layer, layer_norm(x) + 0.1, mask, blocks)
    for h in range(3):
        closed = probe.head_jacobian(h)
        reference = probe.ad_head_jacobian(h)
        assert closed.shape == reference.shape == (probe.num_tokens * 5, len(blocks) * 5 * 13)
        torch.testing.assert_close(closed, reference, rtol=0, atol=1e-12 * float(reference.abs().max()))


@pytest.mark.parametrize("family", ["softmax", "normalized", "linear", "nystrom"])
@pytest.mark.parametrize("closed_form", [True, False], ids=["closed-form", "forward-mode"])
def test_head_jacobian_operator_equals_its_dense_matrix(family: str, closed_form: bool) -> None:
    """J v through the blocks as the family gave them (factors, the value block as Y, dense blocks)
    and the columns formed on demand equal the whole dense matrix's."""
    torch.manual_seed(3)
    layer = build_attention(family, 8, 2, **({"num_landmarks": 2} if family == "nystrom" else {}))
    x, mask = padded_input(3, 2, 12, 8)
    probe = linearise(layer, layer_norm(x) + 0.1, mask, "qkv")
    op = probe.head_jacobian_operator(1, closed_form)
    full = probe.ad_head_jacobian(1)
    size = op.size
    assert op.shape == full.shape
    if closed_form:  # nystrom's Q and K as factors too: 2 landmarks for 12 and 6 tokens
        assert set(op.factors) == {"q", "k"} - ({"k"} if family == "linear" else set())
        assert op.value_factor() is not None
    v = torch.randn(full.shape[1], 3, dtype=torch.float64)
    tol = {"rtol": 0, "atol": 1e-12 * float(full.abs().max())}
    torch.testing.assert_close(op.apply(v, ("q", "k", "v")), full @ v, **tol)
    torch.testing.assert_close(op.apply(v[size:], ("k", "v")), full[:, size:] @ v[size:], **tol)
    torch.testing.assert_close(
        op.columns(["q", "v"]), torch.cat([full[:, :size], full[:, 2 * size :]], 1), **tol
    )
    torch.testing.assert_close(op.block("k"), full[:, size : 2 * size], **tol)
    torch.testing.assert_close(op.dense(), full, **tol)


def test_nystrom_takes_its_factors_only_where_its_landmarks_are_few() -> None:
    """Nystrom's Q and K are per-token factors plus a landmark correction E = F (x) I_d of rank m d
    per sequence: factored where that rank is at most 0.57 of the rows (one long sequence, few
    landmarks; sequences of 2 m tokens, half the rows), formed where the sequences are short (each
    of ~m tokens: the correction is nearly as wide as the rows); kappa and the per-block values
    equal the dense reference's either way."""
    from lra_cond.conditioning.families.base import TokenMixing

    torch.manual_seed(5)
    layer = build_attention("nystrom", 8, 2, num_landmarks=4)
    for x, is_factored in (
        (layer_norm(torch.randn(1, 40, 8, dtype=torch.float64)), True),
        (layer_norm(torch.randn(4, 8, 8, dtype=torch.float64)), True),
        (layer_norm(torch.randn(6, 5, 8, dtype=torch.float64)), False),
    ):
        probe = linearise(layer, x, None, "qkv")
        factors = probe.head_jacobian_operator(0).factors
        assert set(factors) == ({"q", "k"} if is_factored else set())
        assert all(isinstance(f.low_rank[0], TokenMixing) for f in factors.values())
        fast, dense = jacobian_condition(layer, x), jacobian_condition(layer, x, method="dense")
        assert fast.n_null == fast.n_null_expected == dense.n_null
        assert fast.kappa == pytest.approx(dense.kappa, rel=1e-8)
        for b in "qkv":
            assert fast.per_block[b].kappa == pytest.approx(dense.per_block[b].kappa, rel=1e-8), b


def test_every_family_has_a_closed_form() -> None:
    """A family without one falls back to forward-mode AD, ~50x slower at the reference shape."""
    x = torch.randn(1, 30, 8, dtype=torch.float64)
    for family in ATTENTIONS.names():
        layer = build_attention(family, 8, 2, **({"num_landmarks": 4} if family == "nystrom" else {}))
        probe = linearise(layer, x, None, "qkv")
        assert probe.family.parts(probe.head_inputs(0)) is not None, family


def test_a_family_without_a_closed_form_is_measured_through_forward_mode_ad(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The base ``FamilyJacobian`` (no closed form, no symmetry declared): every head block from
    forward-mode AD, the value block eliminated from the whole head's formed rows, the null space
    regularised in every scope; kappa, n_null and the per-block values equal dense, the undeclared
    gauge counted from exact svdvals."""
    from lra_cond.conditioning.families.base import FAMILY_JACOBIANS, FamilyJacobian

    torch.manual_seed(4)
    layer = build_attention("softmax", 8, 2)
    x, mask = padded_input(2, 2, 20, 8)
    x = layer_norm(x) + 0.2 * torch.randn(8, dtype=torch.float64)
    dense = jacobian_condition(layer, x, mask, method="dense")
    regularised = []
    real_solve = extremes.solve

    def spy(rows, t, value, *args, null=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        regularised.append((value is not None, null is not None))
        return real_solve(rows, t, value, *args, null=null, **kwargs)

    monkeypatch.setitem(FAMILY_JACOBIANS, "softmax", FamilyJacobian)
    monkeypatch.setattr(extremes, "solve", spy)
    fast = jacobian_condition(layer, x, mask)
    # per head, the whole head (V eliminated), then Q and K alone (V alone is exact: no solve)
    assert regularised == [(True, True)] * 2 + [(False, True)] * 4
    assert fast.n_null == dense.n_null > fast.n_null_expected  # the gauge, found by svdvals
    assert fast.kappa == pytest.approx(dense.kappa, rel=1e-8)
    for b in "qkv":
        assert fast.per_block[b].kappa == pytest.approx(dense.per_block[b].kappa, rel=1e-8), b
        assert fast.per_block[b].n_null == dense.per_block[b].n_null, b


@pytest.mark.parametrize("sequences", [1, 2])
def test_linear_attention_null_space_is_its_key_value_statistics(sequences: int) -> None:
    """K and V enter only through each sequence's (S, z), up to a common scale at eps -> 0: per head
    at least 2 d D' - B (d^2 + d - 1) null directions, all verified, and nothing else is null."""
    torch.manual_seed(1)
    dim, heads = 16, 2
    d, dim_a = dim // heads, dim + 1
    layer = build_attention("linear", dim, heads)
    x = layer_norm(torch.randn(sequences, 64, dim, dtype=torch.float64))
    res = jacobian_condition(layer, x, per_block=False)
    stats = heads * (2 * d * dim_a - sequences * (d * d + d - 1))
    assert res.null_groups["key_value_statistics"] >= stats - 2 * heads * d  # input nulls overlap
    assert res.n_null == res.n_null_expected
    dense = jacobian_condition(layer, x, method="dense", per_block=False, rtol=1e-9)
    assert dense.n_null == res.n_null and res.kappa == pytest.approx(dense.kappa, rel=1e-6)


def test_nystrom_with_few_landmarks_is_exact() -> None:
    """m <= d_h landmarks: extra symmetries (scores invisible through the landmark inputs) are
    verified; what they do not explain is counted from exact svdvals, never hidden."""
    torch.manual_seed(2)
    layer = build_attention("nystrom", 16, 2, num_landmarks=4)
    x = layer_norm(torch.randn(1, 60, 16, dtype=torch.float64))
    res = jacobian_condition(layer, x, per_block=False)
    dense = jacobian_condition(layer, x, method="dense", per_block=False)
    assert res.kappa == pytest.approx(dense.kappa, rel=1e-6)
    assert res.n_null == dense.n_null
    assert "few_landmarks" in res.null_groups and res.n_null_expected > 2 * 64 + 5 * 2 * 8


def test_value_block_is_eliminated_in_closed_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Softmax: the whole-head scope takes the value elimination (a diagonal value part in the
    factor) and agrees with the general path and with dense."""
    torch.manual_seed(3)
    layer = build_attention("softmax", 8, 2)
    x, mask = padded_input(3, 2, 30, 8)
    x = layer_norm(x)
    seen = []
    real_solve = extremes.solve

    def spy(rows, t, value, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(value is not None)
        return real_solve(rows, t, value, *args, **kwargs)

    monkeypatch.setattr(extremes, "solve", spy)
    fast = jacobian_condition(layer, x, mask, per_block=False)
    assert seen == [True, True]  # one whole-head scope per head, both eliminated
    dense = jacobian_condition(layer, x, mask, method="dense", per_block=False)
    assert fast.kappa == pytest.approx(dense.kappa, rel=1e-8)


def test_whole_head_from_factors_equals_the_dense_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Softmax's Q and K come as factors: the whole head's Gram is formed from them (Schur
    complement for the value block, deflation by congruence) and its exact rows are an operator;
    same values as the route through the dense rows, and as dense."""
    import lra_cond.conditioning.jacobian as jacobian_module

    torch.manual_seed(6)
    layer = build_attention("softmax", 8, 2)
    with torch.no_grad():
        layer.q_proj.bias.normal_()
    x, mask = padded_input(5, 2, 30, 8)
    x = layer_norm(x) + 0.3 * torch.randn(8, dtype=torch.float64)  # a LayerNorm bias: key shift too
    taken = []
    real_head = jacobian_module.factored_head

    def spy(*args):  # noqa: ANN002, ANN202
        taken.append(True)
        return real_head(*args)

    monkeypatch.setattr(jacobian_module, "factored_head", spy)
    fast = jacobian_condition(layer, x, mask, per_block=False)
    assert taken == [True, True]
    real_spectra = jacobian_module.head_spectra
    monkeypatch.setattr(jacobian_module, "head_spectra", lambda *a, **k: real_spectra(*a[:-1], None, **k))
    rows = jacobian_condition(layer, x, mask, per_block=False)
    dense = jacobian_condition(layer, x, mask, method="dense", per_block=False)
    assert len(taken) == 2 and fast.n_null == rows.n_null == dense.n_null
    assert fast.kappa == pytest.approx(rows.kappa, rel=1e-9)
    assert fast.kappa == pytest.approx(dense.kappa, rel=1e-8)


@pytest.mark.parametrize(
    "family,blocks,dim,heads,factored_blocks",
    [("linear", "qkv", 8, 2, 1), ("softmax", "qk", 16, 4, 2)],
    ids=["linear-q-factored-with-support-columns", "softmax-qk-factored"],
)
def test_kept_scope_from_factors_equals_the_dense_rows(
    family: str, blocks: str, dim: int, heads: int, factored_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scope with few null directions whose blocks all come as factors, next to a family's dense
    columns or not (linear attention's whole head: Q factored, K/V as statistics columns; softmax
    on Q and K alone with few gauge directions): its Gram is formed from the factors and its exact
    rows are an operator; same values as the route through the formed rows, and as dense."""
    import lra_cond.conditioning.jacobian as jacobian_module

    torch.manual_seed(9)
    layer = build_attention(family, dim, heads)
    x, mask = padded_input(9, 2, 30, dim)
    x = layer_norm(x) + 0.2 * torch.randn(dim, dtype=torch.float64)
    taken = []
    real_kept = coordinates.factored_kept

    def spy(fs, columns, *args):  # noqa: ANN001, ANN002, ANN202
        taken.append((len(fs), columns is not None))
        rows, t, g = real_kept(fs, columns, *args)
        formed = rows[0].dense()  # the operator's rows, formed: its products and Gram agree
        v = torch.randn(formed.shape[1], 3, dtype=formed.dtype)
        y = torch.randn(formed.shape[0], 3, dtype=formed.dtype)
        torch.testing.assert_close(rows[0] @ v, formed @ v, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(rows[0].T @ y, formed.T @ y, rtol=1e-12, atol=1e-12)
        pre = formed @ t
        torch.testing.assert_close(g, pre.T @ pre, rtol=1e-10, atol=1e-10 * float(g.abs().max()))
        return rows, t, g

    monkeypatch.setattr(coordinates, "factored_kept", spy)
    fast = jacobian_condition(layer, x, mask, blocks=blocks, per_block=False)
    assert taken == [(factored_blocks, family == "linear")] * heads  # linear: Q, next to K/V columns
    real_spectra = jacobian_module.head_spectra
    monkeypatch.setattr(jacobian_module, "head_spectra", lambda *a, **k: real_spectra(*a[:-1], None, **k))
    rows = jacobian_condition(layer, x, mask, blocks=blocks, per_block=False)
    dense = jacobian_condition(layer, x, mask, blocks=blocks, method="dense", per_block=False)
    assert len(taken) == heads and fast.n_null == rows.n_null == dense.n_null
    assert not [n for n in fast.notes if "lost sigma_min" in n]  # the factor passed its check
    assert fast.kappa == pytest.approx(rows.kappa, rel=1e-9)
    assert fast.kappa == pytest.approx(dense.kappa, rel=1e-8)


def spoil_every_cholesky(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Cholesky factor the spectrum routine forms gets random upper-triangular noise of 1e-4
    of its smallest pivot."""
    real = extremes._triangular
    gen = torch.Generator().manual_seed(0)

    def noise(like: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return 1e-4 * scale * torch.randn(like.shape, generator=gen, dtype=like.dtype)

    def spoiled(rows, t, use_qr, g=None, reg=None):  # noqa: ANN001, ANN202
        r, route, factored_gram = real(rows, t, use_qr, g, reg)
        if route == "cholesky":
            r = r + noise(r, r.diagonal().abs().min()).triu()
            factored_gram = r.T @ r  # the Gram this factor factors
        return r, route, factored_gram

    monkeypatch.setattr(extremes, "_triangular", spoiled)


@pytest.mark.parametrize("family", ["softmax", "nystrom", "linear"])
def test_a_cholesky_that_lost_sigma_min_is_refined_on_the_exact_j(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Cholesky factor off by 1e-4 of its smallest pivot (random; a Gram's rounding errors are
    absolute, so they spoil sigma_min, not sigma_max) fails every check; Rayleigh-Ritz on the exact J,
    preconditioned by that factor, recovers sigma_min: equal to dense to 1e-8."""
    torch.manual_seed(4)
    layer = build_attention(family, 8, 2, **({"num_landmarks": 6} if family == "nystrom" else {}))
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    dense = jacobian_condition(layer, x, method="dense")
    spoil_every_cholesky(monkeypatch)
    refined = jacobian_condition(layer, x)
    assert any("refined on the exact J" in n for n in refined.notes)
    assert not any("Householder QR" in n for n in refined.notes)
    # the spoiled factor moves sigma_max by ~1e-6 too (a real Gram's does not): the refinement
    # takes it from the exact J as well
    assert refined.sigma_min == pytest.approx(dense.sigma_min, rel=1e-8)
    for b in "qkv":
        assert refined.per_block[b].sigma_min == pytest.approx(dense.per_block[b].sigma_min, rel=1e-8), b
        # (a block with kappa ~ 70 has its pivots, and so the noise, ~1e-2 of sigma_max: its
        # sigma_max vector is off by ~1e-4, the Rayleigh quotient by ~1e-8)
        assert refined.per_block[b].kappa == pytest.approx(dense.per_block[b].kappa, rel=1e-7), b
    assert refined.kappa == pytest.approx(dense.kappa, rel=1e-8)


@pytest.mark.parametrize("family", ["normalized", "linear"])
def test_a_check_too_coarse_to_vouch_leads_to_the_exact_j(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the check's own rounding level exceeds its tolerance (kappa above ~1e6; here forced by
    a coarse EPS), a spoiled factor passes the check: sigma_min is then taken from the exact J all
    the same (before: a linear-attention head at kappa 2.4e9 kept a sigma_min 1.8e-4 off)."""
    torch.manual_seed(4)
    layer = build_attention(family, 8, 2)
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    dense = jacobian_condition(layer, x, method="dense")
    spoil_every_cholesky(monkeypatch)
    monkeypatch.setattr(extremes, "EPS", 1e-3)  # every check's rounding level is far above its tolerance
    refined = jacobian_condition(layer, x)
    assert not any("lost sigma_min" in n for n in refined.notes)  # the check saw nothing
    assert refined.sigma_min == pytest.approx(dense.sigma_min, rel=1e-8)
    for b in "qk":
        assert refined.per_block[b].sigma_min == pytest.approx(dense.per_block[b].sigma_min, rel=1e-8), b


@pytest.mark.parametrize("family", ["softmax", "normalized"])
def test_a_schur_complement_gram_that_does_not_refine_is_formed_from_the_exact_rows(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole head's Gram from factors is a Schur complement (it cancels): when the refinement
    on the exact J does not settle from it (forced here), the next factor is the Cholesky factor of
    the exact rows' Gram, not Householder QR, and gives the dense values."""
    torch.manual_seed(4)
    layer = build_attention(family, 8, 2)
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    dense = jacobian_condition(layer, x, method="dense", per_block=False)
    real, calls = extremes._refined_sigma_min, []

    def first_fails(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return None if len(calls) == 1 else real(*args, **kwargs)

    monkeypatch.setattr(extremes, "_refined_sigma_min", first_fails)
    redone = jacobian_condition(layer, x, per_block=False)
    assert any("recomputed by the Gram of the exact rows" in n for n in redone.notes)
    assert not any("Householder QR" in n for n in redone.notes)
    assert redone.sigma_min == pytest.approx(dense.sigma_min, rel=1e-8)
    assert redone.kappa == pytest.approx(dense.kappa, rel=1e-8)


@pytest.mark.parametrize("family", ["softmax", "normalized"])
def test_a_factored_head_applies_its_exact_rows_as_one_operator(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole head's value coupling and rows, applied as one operator through the factors
    (J u and J^T y), equal the two applied apart and the formed matrix."""
    from dataclasses import replace

    torch.manual_seed(2)
    layer = build_attention(family, 8, 2)
    x = layer_norm(torch.randn(1, 30, 8, dtype=torch.float64))
    factors, real = [], extremes._factor_extremes

    def spy(factor):  # noqa: ANN001, ANN202
        factors.append(factor)
        return real(factor)

    monkeypatch.setattr(extremes, "_factor_extremes", spy)
    jacobian_condition(layer, x, per_block=False)
    joint = [f for f in factors if f.joint is not None]
    assert len(joint) == 2  # one per head
    gen = torch.Generator().manual_seed(0)
    for f in joint:
        apart, dense = replace(f, joint=None), f.dense()
        # the formed matrix's columns: the factor's coordinates, less any regularised null
        # directions (normalized's head: its orthogonal gauge; none in V) by their complement
        basis = torch.eye(f.n, dtype=torch.float64)
        if f.null is not None:
            assert family == "normalized" and not bool(f.null[: f.n_v].any())
            comp = coordinates.complement(*torch.geqrf(f.null[f.n_v :]))
            basis = torch.block_diag(basis[: f.n_v, : f.n_v], comp)
            torch.testing.assert_close(basis.T @ basis, torch.eye(basis.shape[1], dtype=torch.float64))
            assert float((f.null.T @ basis).abs().max()) < 1e-12
        u = torch.randn(dense.shape[1], 3, generator=gen, dtype=torch.float64)
        y = torch.randn(dense.shape[0], 3, generator=gen, dtype=torch.float64)
        full = basis @ u
        torch.testing.assert_close(f.exact @ full, apart.exact @ full, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(f.exact @ full, dense @ u, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(f.exact.T @ y, apart.exact.T @ y, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(basis.T @ (f.exact.T @ y), dense.T @ y, rtol=1e-10, atol=1e-10)


def test_the_refinement_may_move_by_the_factor_s_measured_error() -> None:
    """The refined sigma_min is kept when it is within REFINE_AGREE of the factor's, or within twice
    the factor's error the check measured along its sigma_min vector: a factor whose sigma_min is
    3e-3 high is rejected unless its measured error is ~1.5e-3, and is then refined to the exact
    value (an SVD)."""
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(60, 20, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(20, 20, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -4, 20, dtype=torch.float64)
    a = u @ torch.diag(s) @ v.T
    t = Preconditioner()
    t.add_dense(torch.eye(20, dtype=torch.float64))
    r = torch.linalg.qr(a, mode="r").R
    factor = extremes._Factor(None, None, r, t, [a])
    start = v[:, -1] + 1e-3 * v[:, -2]  # close to the sigma_min vector, as a factor's would be
    high = float(s[-1]) * (1 + 3e-3)
    assert extremes._refined_sigma_min(factor, start, high) is None
    refined = extremes._refined_sigma_min(factor, start, high, error=1.5e-3)
    assert refined == pytest.approx(float(s[-1]), rel=1e-10)
    assert extremes._refined_sigma_min(factor, start, float(s[-1]) * (1 + 5e-4)) == pytest.approx(refined)


def test_the_factor_is_r_as_an_operator() -> None:
    """A factor with a value part, R = [[diag(rv), C], [0, R' T^{-1}]]: R @ u, R.T @ w, R.solve,
    R.T.solve and the inverse Gram against R formed."""
    gen = torch.Generator().manual_seed(8)
    eye = torch.eye(5, dtype=torch.float64)
    rv = torch.rand(3, generator=gen, dtype=torch.float64) + 0.5
    c = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    r = torch.triu(torch.randn(5, 5, generator=gen, dtype=torch.float64)) + 5 * eye
    r_t = torch.triu(torch.randn(5, 5, generator=gen, dtype=torch.float64)) + 5 * eye
    t = Preconditioner()
    t.add_dense(r_t)  # T = r_t^{-1}
    factor = extremes._Factor(rv, c, r, t, [r])
    formed = torch.zeros(8, 8, dtype=torch.float64)
    formed[:3, :3], formed[:3, 3:], formed[3:, 3:] = torch.diag(rv), c, r @ r_t
    u = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(factor @ u, formed @ u)
    torch.testing.assert_close(factor.T @ u, formed.T @ u)
    torch.testing.assert_close(factor.solve(u), torch.linalg.solve(formed, u))
    torch.testing.assert_close(factor.T.solve(u), torch.linalg.solve(formed.T, u))
    torch.testing.assert_close(factor.inverse_gram(u), torch.linalg.solve(formed.T @ formed, u))


@pytest.mark.parametrize(
    "family,options,per_block",
    [
        ("softmax", {}, False),
        ("normalized", {}, False),
        ("nystrom", {"num_landmarks": 6}, False),
        ("nystrom", {"num_landmarks": 6}, True),
    ],
    ids=["softmax", "normalized", "nystrom", "nystrom-blocks-alone-shared"],
)
def test_a_factored_head_gram_equals_its_formed_rows_gram(
    family: str, options: dict, per_block: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole head's Schur-complement Gram, assembled from the blocks' factors (nystrom: its
    pieces as congruences of Q's Gram alone, and of K's when K's own scope follows, else from K's
    perp piece's factors), equals the Gram of its exact rows formed and preconditioned, to the
    cancellation's rounding. Only sigma_min's refinement on the exact J would otherwise notice a
    wrong piece (a preconditioner's error)."""
    torch.manual_seed(5)
    layer = build_attention(family, 8, 2, **options)
    x = layer_norm(torch.randn(1, 30, 8, dtype=torch.float64))
    given, real = [], extremes.solve

    def spy(rows, t, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if kwargs.get("refine") and args[0] is not None:  # a whole head's (K's own scope refines too)
            given.append((rows, t, kwargs["g"].clone()))  # (regularised in place when factored)
        return real(rows, t, *args, **kwargs)

    monkeypatch.setattr(extremes, "solve", spy)
    jacobian_condition(layer, x, per_block=per_block)
    assert len(given) == 2  # one per head, both from the factors
    for rows, t, g in given:
        # in the head's own coordinates (A^T A = T^-T G T^-1): the preconditioner's whitening of a
        # nearly null complement amplifies either side's rounding alike
        raw = t.solve(t.solve(g, left=False).T, left=False)
        formed = sum(linalg.gram(r.dense()) for r in rows)
        torch.testing.assert_close(raw, formed, rtol=0, atol=1e-12 * float(formed.abs().max()))


@pytest.mark.parametrize("family", ["softmax", "nystrom"])
def test_a_cholesky_that_fails_the_check_is_redone_by_qr(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(4)
    layer = build_attention(family, 8, 2, **({"num_landmarks": 6} if family == "nystrom" else {}))
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    base = jacobian_condition(layer, x)
    monkeypatch.setattr(extremes, "CHECK_RTOL", -1.0)  # every check fails
    monkeypatch.setattr(extremes, "_refined_sigma_min", lambda *args, **kwargs: None)  # and the refinement
    redone = jacobian_condition(layer, x)
    assert any("recomputed by Householder QR" in n for n in redone.notes)
    assert redone.kappa == pytest.approx(base.kappa, rel=1e-8)
    for b in "qk":
        assert redone.per_block[b].kappa == pytest.approx(base.per_block[b].kappa, rel=1e-8)


@pytest.mark.parametrize("decades", [9, 11])
def test_a_gram_that_is_not_definite_is_shifted_and_refined_on_the_exact_j(decades: int) -> None:
    """A Gram that rounding made indefinite (A unpreconditioned at kappa 1e9: kappa(G) = 1e18) is
    factored shifted by its rounding's bound, and sigma_min is refined on the exact A, a block at a
    time: equal to svdvals' within eps kappa. Where more values lie below the shift than the block
    holds (1e11: ~25 of 80) and the refinement does not settle, Householder QR gives them."""
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(300, 80, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(80, 80, generator=gen, dtype=torch.float64))
    a = u @ torch.diag(torch.logspace(0, -decades, 80, dtype=torch.float64)) @ v.T
    t = Preconditioner()
    t.add_dense(torch.ones(80, dtype=torch.float64))  # T = I
    assert int(torch.linalg.cholesky_ex(linalg.gram(a))[1])  # not definite in float64
    out = extremes.solve([a], t, None, 0, 1e-14, "gram")
    s = torch.linalg.svdvals(a)
    assert out.sigma_min == pytest.approx(float(s[-1]), rel=1e-7)
    assert out.sigma_max == pytest.approx(float(s[0]), rel=1e-10)
    if decades == 9:
        assert out.notes == ["the Gram is not numerically positive definite: shifted, refined on the exact J"]
    else:
        assert out.notes == [
            "the Gram's shifted Cholesky factor was not refined on the exact J: recomputed by Householder QR"
        ]


@pytest.mark.parametrize("family", ["softmax", "linear"])
def test_a_gram_that_is_not_definite_is_factored_by_qr_with_a_note(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Gram whose Cholesky breaks down even shifted goes to Householder QR of its rows, the same
    values, and the scope says so (~10x a Cholesky's time)."""
    torch.manual_seed(4)
    layer = build_attention(family, 8, 2)
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    base = jacobian_condition(layer, x)
    assert not any("not numerically positive definite" in n for n in base.notes)
    real = torch.linalg.cholesky_ex

    def breaks_down(a: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        r, info = real(a, *args, **kwargs)
        return r, torch.ones_like(info)  # as LAPACK reports a non-positive pivot

    monkeypatch.setattr(torch.linalg, "cholesky_ex", breaks_down)
    redone = jacobian_condition(layer, x)
    said = [n for n in redone.notes if "not numerically positive definite: factored by Householder QR" in n]
    assert said and all(n.split(":")[0].endswith(("head 0", "head 1")) for n in said)
    assert redone.kappa == pytest.approx(base.kappa, rel=1e-8)
    for b in "qkv":
        assert redone.per_block[b].kappa == pytest.approx(base.per_block[b].kappa, rel=1e-8)


def test_qr_method_equals_gram_on_a_256_token_probe() -> None:
    """Hundreds of non-null values: Lanczos does not terminate by exhausting the space."""
    for init in ("default", "conditioned"):
        torch.manual_seed(5)
        layer = apply_init(build_attention("softmax", 16, 2), init)
        x = layer_norm(torch.randn(1, 256, 16, dtype=torch.float64))
        fast = jacobian_condition(layer, x, per_block=False)
        qr = jacobian_condition(layer, x, method="qr", per_block=False)
        dense = jacobian_condition(layer, x, method="dense", per_block=False)
        assert fast.kappa == pytest.approx(dense.kappa, rel=1e-7)
        assert qr.kappa == pytest.approx(dense.kappa, rel=1e-7)
        assert fast.n_null == dense.n_null == fast.n_null_expected


def test_preconditioner_pieces_are_consistent() -> None:
    """T, T^T, T^{-1}, T^{-T}, a @ T and a @ T^{-1} of a Kronecker block, a dense block and a
    diagonal (Jacobi) one, against the formed T."""

    gen = torch.Generator().manual_seed(6)
    lb = torch.randn(3, 3, generator=gen, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
    w = torch.randn(4, 4, generator=gen, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    r = torch.triu(torch.randn(5, 5, generator=gen, dtype=torch.float64))
    r = r + 5 * torch.eye(5, dtype=torch.float64)
    s = torch.rand(3, generator=gen, dtype=torch.float64) + 0.5
    t = Preconditioner()
    t.add_kron(lb, w)
    t.add_dense(r)
    t.add_dense(s)  # a Jacobi block, T = diag(1/s)
    dense = torch.block_diag(torch.kron(lb, w), torch.linalg.inv(r), torch.diag(1 / s))
    v = torch.randn(20, 2, generator=gen, dtype=torch.float64)
    a = torch.randn(6, 20, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(t @ v, dense @ v)
    torch.testing.assert_close(t.T @ v, dense.T @ v)
    torch.testing.assert_close(t.solve(v), torch.linalg.solve(dense, v))
    torch.testing.assert_close(t.T.solve(v), torch.linalg.solve(dense.T, v))
    torch.testing.assert_close(t.T.T @ v, dense @ v)
    torch.testing.assert_close(a @ t, a @ dense)
    torch.testing.assert_close(t.solve(a, left=False), a @ torch.linalg.inv(dense))


def test_gram_is_a_transpose_a() -> None:
    a = torch.randn(50, 700, dtype=torch.float64)
    torch.testing.assert_close(linalg.gram(a), a.T @ a)
    # diagonal panels in panels, two panels (none narrower than 384 columns), one, one product below 512
    for n in (4200, 1024, 700, 300):
        b, c = torch.randn(40, n, dtype=torch.float64), torch.randn(n, n, dtype=torch.float64)
        sym = c + c.T
        out = linalg.gram(b, add_to=sym.clone(), alpha=0.5)
        torch.testing.assert_close(out, sym + 0.5 * b.T @ b)


def test_scope_null_takes_groups_on_disjoint_rows_apart() -> None:
    """Groups touching disjoint rows are spanned apart on their own rows: the same span and the same
    rank per group as one span over every row (a dependent direction still counts once)."""
    from lra_cond.conditioning.nullspace import _scope_null
    from lra_cond.linalg import span_union

    gen = torch.Generator().manual_seed(0)

    def on(rows: slice, m: int) -> torch.Tensor:
        out = torch.zeros(30, m, dtype=torch.float64)
        out[rows] = torch.randn(rows.stop - rows.start, m, generator=gen, dtype=torch.float64)
        return out

    a, b, d = on(slice(0, 10), 3), on(slice(10, 20), 2), on(slice(20, 30), 4)
    c = torch.cat(
        [a @ torch.ones(3, 1, dtype=torch.float64) + b[:, :1], on(slice(0, 20), 5)], 1
    )  # 1 dependent
    groups = [nullspace.NullGroup(n, frozenset("q"), g) for n, g in zip("abcd", (a, b, c, d))]
    null, added = _scope_null(groups, 30, a)
    assert added == [3, 2, 5, 4] and null.basis.shape == (30, 14)
    whole, _ = span_union([a, b, d, c])
    project = lambda m: m @ torch.linalg.pinv(m)  # noqa: E731
    torch.testing.assert_close(project(null.basis), project(whole), rtol=0, atol=1e-10)


def test_block_lanczos_finds_the_top_eigenpair() -> None:
    values = torch.linspace(1, 2, 400, dtype=torch.float64) ** 6
    basis = torch.linalg.qr(torch.randn(400, 400, dtype=torch.float64)).Q
    op = basis @ torch.diag(values) @ basis.T
    value, vector, applications, converged = top_eigenpair(lambda v: op @ v, 400, lambda v: v, tol=1e-10)
    assert converged and applications * 4 < 400  # a Krylov space far smaller than the size
    assert value == pytest.approx(float(values[-1]), rel=1e-9)
    assert abs(float(vector @ basis[:, -1])) == pytest.approx(1.0, abs=1e-6)


def test_block_lanczos_resolves_a_cluster_from_its_start_directions() -> None:
    """A d-fold top eigenvalue split by a small perturbation (the value block's s_Y (x) I_d split by
    the coupling): started from the unperturbed cluster's directions, far fewer steps, same value."""
    gen = torch.Generator().manual_seed(0)
    n, cluster = 600, 32
    basis = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q
    values = torch.cat([torch.ones(cluster), torch.linspace(0.01, 0.9, n - cluster)]).double()
    e = torch.randn(n, n, generator=gen, dtype=torch.float64)
    e = (e + e.T) / torch.linalg.matrix_norm(e + e.T, 2) * 0.01
    op = basis @ torch.diag(values) @ basis.T + e
    exact = float(torch.linalg.eigvalsh(op)[-1])
    plain, _, plain_steps, plain_converged = top_eigenpair(lambda v: op @ v, n, lambda v: v, tol=1e-10)
    started, _, started_steps, started_converged = top_eigenpair(
        lambda v: op @ v, n, lambda v: v, tol=1e-10, start=basis[:, :cluster]
    )
    assert plain_converged and started_converged
    assert plain == pytest.approx(exact, rel=1e-9) and started == pytest.approx(exact, rel=1e-9)
    assert started_steps * 2 < plain_steps  # measured 17 against 79 (block 4)


def test_normalized_attention_symmetric_gauge() -> None:
    """(E W_Q, -E W_K), E symmetric, changes q^.k^ only through the norms: null when q^^T E q^ and
    k^^T E k^ share one value per sequence, d(d+1)/2 - 2T more directions (here 136 - 120 = 16)."""
    torch.manual_seed(7)
    layer = build_attention("normalized", 16, 1)
    x = layer_norm(torch.randn(1, 60, 16, dtype=torch.float64))
    res = jacobian_condition(layer, x, per_block=False)
    dense = jacobian_condition(layer, x, method="dense", per_block=False)
    assert res.null_groups["symmetric_gauge"] == 16
    assert res.n_null == res.n_null_expected == dense.n_null
    assert res.kappa == pytest.approx(dense.kappa, rel=1e-6)


@pytest.mark.parametrize("lengths", [(52, 1), (52, 2), (52, 3), (50, 1, 2)])
def test_normalized_attention_symmetric_gauge_on_short_sequences(lengths: tuple[int, ...]) -> None:
    """A sequence of one key puts no condition on E (its softmax is 1 whatever the scores), one of
    two keys one per query (s_i1 (a_i - b_1) = s_i2 (a_i - b_2)) where the shared c_b asked three:
    136 unknowns, 2 T - B conditions from the sequences of 3+ tokens, 2 from each of two, minus E = I
    (the two scales'). Before, each short sequence left one null to svdvals."""
    torch.manual_seed(7)
    layer = build_attention("normalized", 16, 1)
    x = layer_norm(torch.randn(len(lengths), max(lengths), 16, dtype=torch.float64))
    mask = torch.arange(max(lengths))[None, :] >= torch.tensor(lengths)[:, None]
    res = jacobian_condition(layer, x, mask)
    dense = jacobian_condition(layer, x, mask, method="dense")
    long = [n for n in lengths if n > 2]
    conditions = 2 * sum(long) - len(long) + 2 * lengths.count(2)
    assert res.null_groups["symmetric_gauge"] == 16 * 17 // 2 - conditions - 1
    assert res.n_null == res.n_null_expected == dense.n_null, res.notes
    assert res.kappa == pytest.approx(dense.kappa, rel=1e-7)
    for b in "qkv":
        assert res.per_block[b].n_null == res.per_block[b].n_null_expected == dense.per_block[b].n_null, b


@pytest.mark.parametrize("family", ["softmax", "normalized", "linear"])
def test_factored_blocks_give_the_dense_per_block_values(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block given as per-token factors has its Gram formed from them; same values as dense."""
    torch.manual_seed(8)
    layer = build_attention(family, 8, 2)
    x, mask = padded_input(8, 2, 30, 8)
    x = layer_norm(x) + 0.1
    taken = []
    real = coordinates.factored_scope

    def spy(*args):  # noqa: ANN002, ANN202
        out = real(*args)
        taken.append("regularised" if out[3] is not None else "deflated")
        return out

    monkeypatch.setattr(coordinates, "factored_scope", spy)
    fast = jacobian_condition(layer, x, mask)
    dense = jacobian_condition(layer, x, mask, method="dense")
    # softmax and normalized factor Q and K (normalized's K with a low-rank correction), linear
    # its query-local Q. Normalized's q_scale and k_scale are not input-side: its blocks keep
    # every coordinate and the null directions are regularised
    want = {"softmax": ["deflated"] * 4, "normalized": ["regularised"] * 4, "linear": ["deflated"] * 2}
    assert taken == want[family]
    for b in "qkv":
        assert fast.per_block[b].kappa == pytest.approx(dense.per_block[b].kappa, rel=1e-7), b
        assert fast.per_block[b].n_null == dense.per_block[b].n_null, b


def test_linear_attention_feature_gauge() -> None:
    """Features whose queries keep one sign over the probe: phi(q) -> (I + E) phi(q) with (S, z) ->
    (I - E^T)(S, z) is realised by the parameters for E on the always-positive features (|L|^2)
    and on the diagonal of the always-non-positive ones (|N|): all of them verified and deflated."""
    torch.manual_seed(0)
    layer = build_attention("linear", 12, 1)
    with torch.no_grad():
        layer.q_proj.bias[:4] += 3.0  # features 0-3: queries always positive
        layer.q_proj.bias[4:6] -= 3.0  # features 4-5: always negative
    x = layer_norm(torch.randn(1, 60, 12, dtype=torch.float64))
    res = jacobian_condition(layer, x, per_block=False)
    dense = jacobian_condition(layer, x, method="dense", per_block=False)
    assert res.null_groups["feature_gauge"] == 4 * 4 + 2
    assert res.n_null == res.n_null_expected == dense.n_null
    assert res.kappa == pytest.approx(dense.kappa, rel=1e-6)


def _one_token_below_zero(layer: torch.nn.Module, x: torch.Tensor, feature: int) -> None:
    """Set the query bias of ``feature`` so that its query is positive at every token but one."""
    with torch.no_grad():
        q = x[0] @ layer.q_proj.weight[feature].double()
        low, second = torch.sort(q).values[:2]
        layer.q_proj.bias[feature] = float(-(low + second) / 2)


@pytest.mark.parametrize("regime", ["all_positive", "one_token_below", "all_negative", "mixed"])
def test_linear_attention_null_space_is_complete(regime: str) -> None:
    """dA_i = 0 whenever dphi_i = (E + c_i I) phi_i with (S, z) -> (I - E^T)(S, z) + mu (S, z): every
    exact null of the dense J is verified in the regimes that make such (W_Q, E, c) exist: queries
    of one sign (phi affine where q > 0, phi' = phi where q <= 0), a feature that leaves its sign at
    one token (one condition on its row of E), all queries negative (c_i any affine function of
    x_i), several sequences (only combinations the shared K/V parameters reach)."""
    torch.manual_seed(3)
    layer = build_attention("linear", 12, 2)
    x = layer_norm(torch.randn(2 if regime == "mixed" else 1, 40, 12, dtype=torch.float64))
    with torch.no_grad():
        shift = {"all_positive": 3.0, "one_token_below": 3.0, "all_negative": -3.0, "mixed": 0.0}[regime]
        layer.q_proj.bias += shift
        if regime == "mixed":
            layer.q_proj.bias[:3] += 3.0
    if regime == "one_token_below":
        _one_token_below_zero(layer, x, 0)
        _one_token_below_zero(layer, x, 7)
    res = jacobian_condition(layer, x)
    dense = jacobian_condition(layer, x, method="dense")
    assert res.null_groups.get("feature_gauge", 0) > 0
    assert res.n_null == res.n_null_expected == dense.n_null, res.notes
    assert res.kappa == pytest.approx(dense.kappa, rel=1e-6)
    for b in "qkv":
        assert res.per_block[b].n_null == res.per_block[b].n_null_expected == dense.per_block[b].n_null, b
    # the count is the spectrum's, not the cut's: a wide gap between the nulls and the rest
    probe = linearise(layer, x, None, "qkv")
    for h in range(2):
        s = torch.linalg.svdvals(probe.head_jacobian(h))
        s = s / s[0]
        nulls = s[s <= 1e-13]
        assert nulls.numel() and float(s[s > 1e-13].min()) > 1e3 * float(nulls.max()), h


@pytest.mark.parametrize(
    ("lengths", "shift"), [((40, 2), 0.0), ((40, 6), 0.0), ((30, 20, 3), 3.0), ((40, 3), -3.0)]
)
def test_linear_attention_short_sequences_leave_statistics_unseen(
    lengths: tuple[int, ...], shift: float
) -> None:
    """A probe sequence with no more tokens than the head dimension (6 here) leaves most of its
    (S, z) unseen by its own queries (their features do not span R^d, or pin every dz), and its
    queries' dphi free: every exact null of the dense J is verified, with a long sequence next to
    it, several, and query features of one sign (feature gauge on top). Before, 5-11 nulls a head
    were left to svdvals (the monitor's fallback on ListOps probes ending in a short example)."""
    torch.manual_seed(0)
    layer = build_attention("linear", 12, 2)
    with torch.no_grad():
        layer.q_proj.bias[:3] += shift
    x = layer_norm(torch.randn(len(lengths), max(lengths), 12, dtype=torch.float64))
    mask = torch.arange(max(lengths))[None, :] >= torch.tensor(lengths)[:, None]
    res = jacobian_condition(layer, x, mask)
    dense = jacobian_condition(layer, x, mask, method="dense")
    assert res.null_groups["unseen_statistics"] > 2 * len(lengths)  # more than each scale
    assert res.n_null == res.n_null_expected == dense.n_null, res.notes
    assert res.kappa == pytest.approx(dense.kappa, rel=1e-7)
    for b in "qkv":
        assert res.per_block[b].n_null == res.per_block[b].n_null_expected == dense.per_block[b].n_null, b
        assert res.per_block[b].kappa == pytest.approx(dense.per_block[b].kappa, rel=1e-7), b


@pytest.mark.parametrize("iterations", [1, 3, 6, 12])
def test_pinv_output_jacobian_equals_reverse_mode(iterations: int) -> None:
    """Nystrom's pinv iteration differentiated in closed form (through A's SVD) equals
    torch.func.jacrev of the iteration itself: also where the norms' maxima tie (the scale's gradient
    is shared as torch's amax shares it), with repeated singular values, for a singular A, and where
    the iteration has converged on some singular values and not on others (a recursion that tracks
    only e = 1 - sigma g, or only sigma g, is off by ~3e-11 there at 12 iterations)."""
    from lra_cond.conditioning.families.nystrom import pinv_output_jacobian
    from lra_cond.models.attention.nystrom import iterative_pinv

    gen = torch.Generator().manual_seed(iterations)
    a = torch.softmax(torch.randn(7, 7, generator=gen, dtype=torch.float64), -1)
    tied = torch.full((5, 5), 0.2, dtype=torch.float64) + 0.01 * torch.eye(5, dtype=torch.float64)
    spread = torch.randn(6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64).mul(3.0).exp()
    spread = spread / spread.sum(-1, keepdim=True).mean()  # kappa 3.4e3: sigma_min unconverged
    singular = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    for mat in (a, tied, spread, singular):
        right = torch.randn(mat.shape[0], 4, generator=gen, dtype=torch.float64)
        reference = torch.func.jacrev(lambda m, r=right: iterative_pinv(m, iterations) @ r)(mat)
        got = pinv_output_jacobian(mat, right, iterations)  # [r, r', c, t]: reference's [r', c, r, t]
        torch.testing.assert_close(
            got, reference.permute(2, 0, 1, 3), rtol=0, atol=1e-13 * float(reference.abs().max())
        )


@pytest.mark.parametrize("blocks", [["k"], ["v"], ["k", "v"]])
@pytest.mark.parametrize("sequences", [1, 3])
def test_linear_statistics_jacobian_equals_reverse_mode(blocks: list[str], sequences: int) -> None:
    """Linear attention's (S, z)-Jacobian in closed form (diagonal blocks per row of W_K or W_V, one
    coupled block for both) equals torch.func.jacrev of the statistics."""
    from lra_cond.conditioning.families.linear import _statistics_blocks
    from lra_cond.models.attention.linear import feature_map

    torch.manual_seed(sequences)
    layer = build_attention("linear", 12, 2)
    x = layer_norm(torch.randn(sequences, 9, 12, dtype=torch.float64)) + 0.2
    inp = linearise(layer, x, None, "qkv").head_inputs(1)
    d, dim = inp.d, inp.dim

    def statistics(flat: torch.Tensor) -> torch.Tensor:
        w = dict(inp.w, **dict(zip(blocks, flat.reshape(len(blocks), d, dim))))
        out = []
        for xs in inp.xs:
            phi_k, v = feature_map(xs @ w["k"].T), xs @ w["v"].T
            out.append(torch.cat([(phi_k.T @ v).reshape(-1), phi_k.sum(0)]))
        return torch.cat(out)

    reference = torch.func.jacrev(statistics)(torch.cat([inp.w[b].reshape(-1) for b in blocks]))
    n_params, parts, v_x = _statistics_blocks(inp, blocks)  # columns in input coordinates x V_x
    rows_x = torch.cat(inp.xs)  # V_x spans the rows (the LayerNorm's null direction left out)
    assert v_x.shape == (dim, int(torch.linalg.matrix_rank(rows_x))) < (dim, dim)
    torch.testing.assert_close(rows_x @ v_x @ v_x.T, rows_x, rtol=0, atol=1e-12)
    expand = torch.kron(torch.eye(len(blocks) * d, dtype=torch.float64), v_x)
    closed = reference.new_zeros(reference.shape[0], n_params)
    for rows, cols, mat in parts:
        closed[rows[:, None], cols[None, :]] = mat
    assert n_params == len(blocks) * d * v_x.shape[1]
    tol = {"rtol": 0, "atol": 1e-12 * float(reference.abs().max())}
    torch.testing.assert_close(closed, reference @ expand, **tol)
    torch.testing.assert_close(closed @ expand.T, reference, **tol)  # G vanishes off the rows' span


@pytest.mark.parametrize("sequences", [1, 3])
def test_coupled_statistics_block_factor_spans_its_row_space(sequences: int) -> None:
    """The coupled K/V block of one probe sequence is wide and of full row rank: its factor is
    G^T = Q R with Q orthonormal, spanning the row space the SVD gives, and min_norm solves
    G theta = t with theta in that row space (least squares against lstsq). Several sequences make
    it tall: of full column rank, the basis is the identity."""
    from lra_cond.conditioning.families.linear import _factor, _statistics_blocks

    torch.manual_seed(sequences)
    layer = build_attention("linear", 12, 2)
    x = layer_norm(torch.randn(sequences, 9, 12, dtype=torch.float64)) + 0.2
    inp = linearise(layer, x, None, "qkv").head_inputs(1)
    ((_, _, g),) = _statistics_blocks(inp, ["k", "v"])[1]
    q, r, span, sv = _factor(g)
    assert sv is None  # full rank, no SVD
    if g.shape[0] > g.shape[1]:
        assert q is None and span is not None
        torch.testing.assert_close(span.coordinates(g), r, rtol=0, atol=1e-13 * float(g.abs().max()))
        return
    assert span is None and q.shape == (g.shape[1], g.shape[0])
    eye = torch.eye(q.shape[1], dtype=torch.float64)
    torch.testing.assert_close(q.T @ q, eye, rtol=0, atol=1e-14)
    torch.testing.assert_close(q @ r, g.T, rtol=0, atol=1e-14 * float(g.abs().max()))
    vh = torch.linalg.svd(g, full_matrices=False)[2]
    torch.testing.assert_close(q @ (q.T @ vh.T), vh.T, rtol=0, atol=1e-12)  # the same row space
    t = torch.randn(g.shape[0], 2, dtype=torch.float64)
    theta = q @ torch.linalg.solve_triangular(r.T, t, upper=False)  # min_norm's formula
    least_squares = torch.linalg.lstsq(g, t, driver="gelsd").solution  # the minimum-norm solution
    torch.testing.assert_close(theta, least_squares, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("blocks", [("k",), ("v",), ("k", "v")])
@pytest.mark.parametrize("sequences", [1, 3])
def test_linear_support_gram_equals_the_formed_columns_gram(blocks: tuple[str, ...], sequences: int) -> None:
    """The Gram linear attention's support gives through the statistics' own (for the dense
    columns' preconditioner) equals the Gram of J_S P formed from the head's Jacobian columns."""
    torch.manual_seed(sequences)
    layer = build_attention("linear", 12, 2)
    x = layer_norm(torch.randn(sequences, 9, 12, dtype=torch.float64)) + 0.2
    probe = linearise(layer, x, None, "qkv")
    support = probe.family.support(probe.head_inputs(1, blocks))
    assert support is not None and support.gram is not None
    formed = probe.head_jacobian_operator(1).columns(list(blocks)) @ support.p  # J_S P, formed
    reference = formed.T @ formed
    got = support.gram()
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12 * float(reference.abs().max()))


def test_a_tall_statistics_block_of_full_column_rank_takes_householder_qr() -> None:
    """A tall block (several probe sequences) of full column rank: R upper triangular, U (kept as
    reflectors) orthonormal with mat = U R, and min_norm / residual equal least squares; a
    rank-deficient one is left to the SVD."""
    from lra_cond.conditioning.families.linear import _factor, _Statistics

    gen = torch.Generator().manual_seed(2)
    mat = torch.randn(90, 40, generator=gen, dtype=torch.float64) @ torch.diag(
        torch.logspace(0, -4, 40, dtype=torch.float64)
    )
    basis, r, span, sv = _factor(mat)
    assert sv is None and basis is None  # its basis is the identity, never formed
    assert span is not None and span.u is None and torch.equal(r, torch.triu(r))
    u = span.project(torch.eye(90, dtype=torch.float64))  # U U^T, through the reflectors
    torch.testing.assert_close(u @ u, u, rtol=0, atol=1e-14)  # an orthogonal projector ...
    torch.testing.assert_close(u @ mat, mat, rtol=0, atol=1e-14)  # ... onto range(mat)
    torch.testing.assert_close(span.coordinates(mat), r, rtol=0, atol=1e-14)  # U^T mat = R
    st = _Statistics(
        torch.ones(90, dtype=torch.float64),
        40,
        [(torch.arange(90), torch.arange(40), mat)],
        torch.eye(1, dtype=torch.float64),
    )
    assert torch.equal(st.p, torch.eye(40, dtype=torch.float64)) and torch.equal(st.gp, mat)  # G P = G
    t = torch.randn(90, 3, generator=gen, dtype=torch.float64)
    theta = torch.linalg.lstsq(mat, t).solution
    torch.testing.assert_close(st.min_norm(t), theta, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(st.residual(t), t - mat @ theta, rtol=1e-9, atol=1e-12)
    deficient = mat.clone()
    deficient[:, 7] = deficient[:, 3] - 2 * deficient[:, 5]
    basis, r, span, sv = _factor(deficient)
    assert sv is not None and basis.shape[1] == 39  # the SVD's rank


def test_a_scopes_reduced_columns_are_freed_before_the_next_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe takes its scopes (the whole head, then each block) one after the other: a family's
    support columns (linear attention's K/V statistics, ~0.5-1 GB a head and scope on the tiny
    split) are gone before the next scope's spectra run, and kappa is what it was."""
    import gc
    import weakref

    from lra_cond.conditioning import jacobian as jacobian_module
    from lra_cond.conditioning.families.linear import LinearJacobian

    torch.manual_seed(0)
    layer = build_attention("linear", 8, 2)
    x = layer_norm(torch.randn(1, 48, 8, dtype=torch.float64))
    before = jacobian_condition(layer, x)
    assert before.reason is None
    made: list[tuple[tuple[str, ...], weakref.ref]] = []  # (the scope's blocks, its support columns)
    real_support = LinearJacobian.support

    def support(self: LinearJacobian, inp):  # noqa: ANN001, ANN202
        out = real_support(self, inp)
        if out is not None:
            made.append((tuple(inp.blocks), weakref.ref(out.columns)))
        return out

    seen = []
    real_spectra = jacobian_module.head_spectra

    def spectra(jac, blocks, d, dim, x_real, nulls, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        gc.collect()
        seen.append((set(nulls), {b for b, ref in made if ref() is not None}))
        return real_spectra(jac, blocks, d, dim, x_real, nulls, *args, **kwargs)

    monkeypatch.setattr(LinearJacobian, "support", support)
    monkeypatch.setattr(jacobian_module, "head_spectra", spectra)
    after = jacobian_condition(layer, x)
    scope_blocks = {"all": ("q", "k", "v"), "q": ("q",), "k": ("k",), "v": ("v",)}
    assert {b for b, _ in made} == {("q", "k", "v"), ("k",), ("v",)}  # a support on three scopes
    assert [s for s, _ in seen] == [{"all"}, {"all"}, {"q"}, {"q"}, {"k"}, {"k"}, {"v"}, {"v"}]
    for (scope,), alive in seen:
        assert alive <= {scope_blocks[scope]}, (scope, alive)
    assert after.kappa == before.kappa
    assert all(after.per_block[b].kappa == r.kappa for b, r in before.per_block.items())


def test_the_value_rotation_is_formed_once_per_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe takes its scopes one after the other; the head's value factor Y and its full SVD
    (T x T: 1.3 s at 4096 tokens) are formed once per head for all of them."""
    from lra_cond.conditioning.linearised import HeadJacobian

    torch.manual_seed(0)
    layer = build_attention("softmax", 8, 2)
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    calls: dict[int, int] = {}
    real = HeadJacobian.value_factor

    def counted(self: HeadJacobian) -> torch.Tensor | None:
        calls[id(self)] = calls.get(id(self), 0) + 1
        return real(self)

    monkeypatch.setattr(HeadJacobian, "value_factor", counted)
    res = jacobian_condition(layer, x)
    assert set(res.per_block) == {"q", "k", "v"}  # four scopes a head
    assert sorted(calls.values()) == [1, 1]  # two heads, once each


@pytest.mark.parametrize("kappa", [1e1, 1e4, 1e8])
def test_triangular_condition_estimates_kappa_from_below(kappa: float) -> None:
    """The estimate of kappa(R) is a lower bound within a factor of 10 (against svdvals), for an
    R whose spectrum spreads evenly over kappa; an exactly singular R gives inf."""
    gen = torch.Generator().manual_seed(3)
    n = 200
    left = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q
    right = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q
    a = left @ torch.diag(torch.logspace(0, -math.log10(kappa), n, dtype=torch.float64)) @ right.T
    r = torch.linalg.qr(a).R
    s = torch.linalg.svdvals(r)
    exact = float(s[0] / s[-1])
    estimate = linalg.triangular_condition(r)
    assert exact / 10 <= estimate <= exact * (1 + 1e-9)
    singular = r.clone()
    singular[5, 5] = 0.0
    assert linalg.triangular_condition(singular) == math.inf


@pytest.mark.parametrize("rank", [40, 37])
def test_null_vectors_of_a_wide_matrix_equal_the_svd_null_space(rank: int) -> None:
    """A wide matrix of full row rank takes the complement of its row space by QR, one of lower
    rank (rows dependent to ~1e-16: the QR factor's kappa is ~1e16) the SVD's cut: either way an
    orthonormal basis of the same space as svd's right vectors below rtol, m null on it."""
    gen = torch.Generator().manual_seed(6)
    m = torch.randn(40, rank, generator=gen, dtype=torch.float64) @ torch.randn(
        rank, 55, generator=gen, dtype=torch.float64
    )
    null = linalg.null_vectors(m)
    _, s, vh = torch.linalg.svd(m, full_matrices=True)
    expected = vh[rank:].T  # s[rank:] ~1e-15 of s[0]: below RANK_RTOL
    assert null.shape == (55, 55 - rank)
    torch.testing.assert_close(null.T @ null, torch.eye(55 - rank, dtype=torch.float64), rtol=0, atol=1e-13)
    torch.testing.assert_close(null @ (null.T @ expected), expected, rtol=0, atol=1e-12)
    assert float((m @ null).abs().max()) <= 1e-12 * float(s[0])


@pytest.mark.parametrize("kappa,max_condition", [(3.0, 1e3), (1e5, 1e3), (1e5, 1e6), (1e9, 1e6)])
def test_orthonormal_basis_spans_the_columns_to_its_promised_orthonormality(
    kappa: float, max_condition: float
) -> None:
    """One Cholesky-QR pass where the columns' estimated kappa allows (orthonormal to ~eps kappa^2),
    Householder QR otherwise (kappa above the bound, or a Gram Cholesky cannot factor): orthonormal
    within eps * min(kappa, max_condition)^2, and spanning exactly the columns (projector check)."""
    gen = torch.Generator().manual_seed(4)
    n, k = 600, 60
    left = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64)).Q
    right = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64)).Q
    m = left @ torch.diag(torch.logspace(0, -math.log10(kappa), k, dtype=torch.float64)) @ right.T
    q = linalg.orthonormal_basis(m, max_condition)
    eps = torch.finfo(torch.float64).eps
    bound = 10 * eps * min(kappa, max_condition) ** 2 + 1e-13
    assert float((q.T @ q - torch.eye(k, dtype=torch.float64)).abs().max()) <= bound
    fit = torch.linalg.lstsq(q, m).solution  # span(q) = span(m): m = q X, to m's own rounding
    assert float((q @ fit - m).abs().max()) <= 1e-13
    assert linalg.orthonormal_basis(m[:, :0]).shape == (n, 0)  # no columns (a scope without nulls)


@pytest.mark.parametrize("kappa", [1e1, 5e4, 2e6])
def test_statistics_block_factor_is_an_orthonormal_row_basis(kappa: float) -> None:
    """A full-row-rank statistics block's factor (Cholesky QR twice): Q orthonormal to ~eps and
    mat^T = Q R with R upper triangular, also near the first pass's certificate (kappa 2e6: that
    pass is off by ~eps kappa^2 ~ 1e-3), spanning the SVD's row space; a rank-deficient block
    takes the SVD."""
    from lra_cond.conditioning.families.linear import _factor

    gen = torch.Generator().manual_seed(0)
    left = torch.linalg.qr(torch.randn(40, 40, generator=gen, dtype=torch.float64)).Q
    right = torch.linalg.qr(torch.randn(150, 40, generator=gen, dtype=torch.float64)).Q
    mat = left @ torch.diag(torch.logspace(0, -math.log10(kappa), 40, dtype=torch.float64)) @ right.T
    q, r, u, s = _factor(mat)
    assert u is None and s is None and r is not None
    torch.testing.assert_close(q.T @ q, torch.eye(40, dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(q @ r, mat.T, rtol=0, atol=1e-14)
    assert torch.equal(r, torch.triu(r))
    # the row space itself is known to ~eps kappa (by any method, the SVD's too)
    span_tol = max(1e-12, 10 * torch.finfo(torch.float64).eps * kappa)
    torch.testing.assert_close(q @ q.T, right @ right.T, rtol=0, atol=span_tol)
    deficient = mat.clone()
    deficient[-1] = deficient[0]
    basis, r, u, s = _factor(deficient)
    assert r is None and basis.shape[1] == 39


def test_single_blocks_regularise_their_null_space(monkeypatch: pytest.MonkeyPatch) -> None:
    """Normalized attention's Q and K alone keep every coordinate and regularise their null
    directions (the scale is not input-side); the values equal dense, and a null direction the
    family does not declare (here K's scale) is still counted from exact svdvals, never hidden."""
    from lra_cond.conditioning.families.base import FAMILY_JACOBIANS
    from lra_cond.conditioning.families.normalized import NormalizedJacobian

    class NoKeyScale(NormalizedJacobian):  # not registered: a test double
        def symmetries(self, inp):  # noqa: ANN001, ANN201
            return {n: g for n, g in super().symmetries(inp).items() if n != "k_scale"}

    torch.manual_seed(5)
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    regularised = []
    real_solve = extremes.solve

    def spy(rows, t, value, *args, null=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        regularised.append(null is not None)
        return real_solve(rows, t, value, *args, null=null, **kwargs)

    monkeypatch.setattr(extremes, "solve", spy)
    # scope by scope, each head: the whole head (its orthogonal gauge has no closed-form complement:
    # few directions, regularised), then Q and K; without its scale, K's declared nulls are all
    # input-side (the key shift) and are deflated instead
    for family, k_kept in ((NormalizedJacobian, True), (NoKeyScale, False)):
        monkeypatch.setitem(FAMILY_JACOBIANS, "normalized", family)
        layer = build_attention("normalized", 8, 2)
        regularised.clear()
        fast = jacobian_condition(layer, x)
        dense = jacobian_condition(layer, x, method="dense")
        assert regularised == [True, True] * 2 + [k_kept] * 2
        for b in "qk":
            assert fast.per_block[b].kappa == pytest.approx(dense.per_block[b].kappa, rel=1e-8), b
            assert fast.per_block[b].n_null == dense.per_block[b].n_null, b
    assert fast.per_block["k"].n_null == fast.per_block["k"].n_null_expected + 2  # one per head
    assert any("k, head 0" in n and "svdvals" in n for n in fast.notes)


def test_factored_products_equal_the_dense_block() -> None:
    """J v, J^T y, the cross Grams, the row rotation, the output side and the preconditioned
    factors from per-token factors equal the same products of the formed (T d) x (d D') blocks,
    for both factor kinds, with and without a low-rank correction (built here entry by entry)."""
    from lra_cond.conditioning.families.base import Factored, TokenMixing

    gen = torch.Generator().manual_seed(0)
    t, d, p, r = 7, 3, 4, 5

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def corrected(f: Factored) -> Factored:
        return Factored(f.kind, f.left, f.right, (randn(t, d, r), randn(r, d, p)))

    def mixed(f: Factored, m: int = 2) -> Factored:  # E = F (x) I_d, rank m d
        return Factored(f.kind, f.left, f.right, (TokenMixing(randn(t, m), d), randn(m * d, d, p)))

    def naive(f: Factored) -> torch.Tensor:  # every entry [i, a, b, c] from its definition
        j = torch.zeros(t, d, d, p, dtype=torch.float64)
        for i, a, b, c in itertools.product(range(t), range(d), range(d), range(p)):
            if f.kind == "query_local":
                j[i, a, b, c] = f.left[i, a, b] * f.right[i, c]
            else:
                j[i, a, b, c] = f.left[i, b] * f.right[i, a, c]
            if f.low_rank is not None and isinstance(f.low_rank[0], TokenMixing):
                mix, z = f.low_rank  # E[(i, a), (m, a')] = F[i, m] delta_aa'
                j[i, a, b, c] += sum(mix.f[i, m] * z[m * d + a, b, c] for m in range(mix.f.shape[1]))
            elif f.low_rank is not None:
                e, z = f.low_rank[0].dense(), f.low_rank[1]
                j[i, a, b, c] += sum(e[i, a, m] * z[m, b, c] for m in range(e.shape[-1]))
        return j.reshape(t * d, d * p)

    plain = [
        Factored("query_local", randn(t, d, d), randn(t, p)),
        Factored("outer", randn(t, d), randn(t, d, p)),
    ]
    blocks = plain + [corrected(f) for f in plain] + [mixed(f) for f in plain]
    dense = [naive(b) for b in blocks]
    assert (dense[2] - dense[0]).abs().max() > 0.1  # the corrections change the blocks
    assert (dense[4] - dense[0]).abs().max() > 0.1
    mix = blocks[4].low_rank[0]  # a token mixing's entries: F[i, m] where a == a'
    e = torch.einsum("im,ab->iamb", mix.f, torch.eye(d, dtype=torch.float64)).reshape(t, d, -1)
    torch.testing.assert_close(mix.dense(), e, rtol=0, atol=0)
    v, y, u = randn(d * p, 2), randn(t * d, 2), randn(t, 3)
    lb, w = randn(d, d), randn(p, p)
    for f, j in zip(blocks, dense):
        torch.testing.assert_close(f.dense().reshape(t * d, -1), j, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(f @ v, j @ v, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(f.T @ y, j.T @ y, rtol=1e-12, atol=1e-12)
        want = (u.T @ j.reshape(t, -1)).reshape(3 * d, d * p)
        torch.testing.assert_close(coordinates.rows_rotated(f, u), want, rtol=1e-12, atol=1e-12)
        for g, k in zip(blocks, dense):
            torch.testing.assert_close(coordinates.cross_gram(f, g), j.T @ k, rtol=1e-12, atol=1e-12)
        pre = coordinates.preconditioned(f, lb, w).dense().reshape(t * d, -1)
        torch.testing.assert_close(pre, j @ torch.kron(lb, w), rtol=1e-12, atol=1e-12)
        # blocks of different input widths (a rotated block's perp and par coordinates)
        narrow, w_narrow = coordinates.preconditioned(f, lb, w[:, :3]), torch.kron(lb, w[:, :3])
        for g, k in zip(blocks, dense):
            got = coordinates.cross_gram(narrow, g)
            torch.testing.assert_close(got, (j @ w_narrow).T @ k, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(coordinates.cross_gram(g, narrow), got.T, rtol=1e-12, atol=1e-12)
        out = coordinates.output_side(f)  # whitens sum over rows and c of J[., (b, c)] J[., (b', c)]
        side = torch.einsum("nbc,nec->be", j.reshape(-1, d, p), j.reshape(-1, d, p))
        torch.testing.assert_close(out.T @ side @ out, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-9)
        # the correction's products, once formed for f (here by its output side), are carried
        # into its preconditioned factors rather than formed again
        if f.low_rank is not None:
            carried = coordinates.preconditioned(f, lb, w[:, :3])
            assert "correction_of" in carried.cache  # formed when first asked
            for g, k in zip([*blocks, carried], [*dense, j @ w_narrow]):
                got = coordinates.cross_gram(carried, g)
                torch.testing.assert_close(got, (j @ w_narrow).T @ k, rtol=1e-12, atol=1e-12)


def test_mixing_cross_products_equal_the_dense_corrections() -> None:
    """E^T E' m of both kinds of correction (token mixing F (x) I_d, a dense E), with each other and
    with themselves, and add_to + alpha E^T E' m, equal the products of their dense matrices."""
    from lra_cond.conditioning.families.base import DenseMixing, TokenMixing

    gen = torch.Generator().manual_seed(4)
    t, m, d, k = 9, 3, 2, 5
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    token, token2 = TokenMixing(randn(t, m), d), TokenMixing(randn(t, m), d)
    dense, dense2 = DenseMixing(randn(t, d, m * d)), DenseMixing(randn(t, d, m * d))
    flat = {id(e): e.dense().reshape(t * d, -1) for e in (token, token2, dense, dense2)}
    v, base = randn(m * d, k), randn(m * d, k)
    for e, e2 in itertools.product((token, dense), (token, token2, dense, dense2)):
        want = flat[id(e)].T @ flat[id(e2)] @ v
        torch.testing.assert_close(e.cross(e2, v), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            e.cross(e2, v, add_to=base, alpha=0.5), base + 0.5 * want, rtol=1e-12, atol=1e-12
        )


@pytest.mark.parametrize("same", [True, False])
def test_sum_over_inputs_contracts_rows_and_inputs(same: bool) -> None:
    """sum_j,c a[j, (b, c)] b[j, (e, c)] in chunks of rows (a row count no chunk divides) equals the
    einsum over the (r, d, p) views."""

    gen = torch.Generator().manual_seed(2)
    r, d, p = 150, 4, 7
    a = torch.randn(r, d * p, generator=gen, dtype=torch.float64)
    b = a if same else torch.randn(r, d * p, generator=gen, dtype=torch.float64)
    want = torch.einsum("jbc,jec->be", a.view(r, d, p), b.view(r, d, p))
    torch.testing.assert_close(coordinates.sum_over_inputs(a, b, d, rows=64), want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("output_side", [True, False], ids=["o-and-m", "m-only"])
def test_kron_products_equal_the_dense_kronecker_product(output_side: bool) -> None:
    """kron_right (in chunks of rows: a row count no chunk divides) equals the product with the dense
    Kronecker matrix O (x) M, M rectangular."""
    gen = torch.Generator().manual_seed(3)
    n, d, p, q = 150, 4, 7, 5
    a = torch.randn(n, d * p, generator=gen, dtype=torch.float64)
    o = torch.randn(d, d, generator=gen, dtype=torch.float64) if output_side else None
    m = torch.randn(p, q, generator=gen, dtype=torch.float64)
    kron = torch.kron(torch.eye(d, dtype=torch.float64) if o is None else o, m)
    torch.testing.assert_close(linalg.kron_right(a, o, m, d, rows=64), a @ kron, rtol=1e-13, atol=1e-13)


def test_factored_cat_keeps_each_sequence_correction_in_its_own_rows() -> None:
    """Two sequences' corrected blocks stacked: the correction is block diagonal, so the stacked
    block's rows are each sequence's own rows."""
    from lra_cond.conditioning.families.base import Factored, TokenMixing

    gen = torch.Generator().manual_seed(1)
    d, p = 2, 3

    def block(t: int, r: int) -> Factored:
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        return Factored("outer", randn(t, d), randn(t, d, p), (randn(t, d, r), randn(r, d, p)))

    parts = [block(4, 4), block(3, 2)]
    want = torch.cat([f.dense() for f in parts])
    torch.testing.assert_close(Factored.cat(parts).dense(), want, rtol=1e-12, atol=1e-12)

    def mixed(t: int, m: int) -> Factored:  # E = F (x) I_d (Nystrom's landmarks), m per sequence
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        return Factored(
            "outer", randn(t, d), randn(t, d, p), (TokenMixing(randn(t, m), d), randn(m * d, d, p))
        )

    parts = [mixed(4, 3), mixed(3, 2)]
    stacked = Factored.cat(parts)
    assert stacked.low_rank[0].f.shape == (7, 5)
    want = torch.cat([f.dense() for f in parts])
    torch.testing.assert_close(stacked.dense(), want, rtol=1e-12, atol=1e-12)
