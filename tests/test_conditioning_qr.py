"""The fast exact path (method="qr"): the closed-form softmax Jacobian against forward-mode AD, the
deflated QR + Lanczos extremes against full svdvals, and the value-block elimination against the
general path."""

from __future__ import annotations

import pytest
import torch

from lra_cond.conditioning import jacobian_condition
from lra_cond.conditioning.deflated import (
    deflated_extremes,
    kron_factor,
    triangular_extremes,
    value_eliminated_extremes,
)
from lra_cond.conditioning.head_jacobian import jvp_head_jacobian, softmax_head_jacobian
from lra_cond.conditioning.lanczos import lanczos_extremes
from lra_cond.conditioning.nullspace import build_null_space, snap_input
from lra_cond.conditioning.probe import make_probe
from lra_cond.conditioning.weights import svdvals
from lra_cond.init import apply_init
from lra_cond.models.attention import ATTENTIONS, build_attention

OPTIONS = {"nystrom": {"num_landmarks": 4}}


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


def padded_input(seed: int, batch: int, seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, dim, generator=gen, dtype=torch.float64)
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[-1, seq // 2 :] = True
    return x, mask


@pytest.mark.parametrize("blocks", ["qkv", "qk", "kv", "v"])
def test_softmax_closed_form_equals_forward_mode(blocks: str) -> None:
    torch.manual_seed(0)
    layer = build_attention("softmax", 12, 3, head_dim=5)  # H*d_h != D, with biases
    x, mask = padded_input(0, 3, 20, 12)
    probe = make_probe(layer, x, mask, blocks)
    for h in range(3):
        reference = jvp_head_jacobian(probe, h)
        closed = softmax_head_jacobian(probe, h)
        assert closed.shape == reference.shape == (probe.num_tokens * 5, len(blocks) * 5 * 12)
        torch.testing.assert_close(closed, reference, rtol=0, atol=1e-12 * float(reference.abs().max()))


@pytest.mark.parametrize("family", ATTENTIONS.names())
@pytest.mark.parametrize("mean_free", [False, True], ids=["raw", "layernorm"])
def test_qr_method_equals_dense(family: str, mean_free: bool) -> None:
    torch.manual_seed(1)
    layer = build_attention(family, 8, 2, **OPTIONS.get(family, {}))
    x, mask = padded_input(1, 2, 24, 8)
    x = layer_norm(x) if mean_free else x
    dense = jacobian_condition(layer, x, mask, method="dense")
    fast = jacobian_condition(layer, x, mask, method="qr")
    assert fast.method == "qr" and fast.reason is None
    for name in ("kappa", "sigma_max", "sigma_min"):
        assert getattr(fast, name) == pytest.approx(getattr(dense, name), rel=1e-6), name
    assert fast.n_null == dense.n_null
    for b in "qkv":
        assert fast.per_block[b].kappa == pytest.approx(dense.per_block[b].kappa, rel=1e-6), b
        assert fast.per_block[b].n_null == dense.per_block[b].n_null, b


@pytest.mark.parametrize("init", ["default", "conditioned"])
def test_qr_method_equals_dense_on_a_256_token_probe(init: str) -> None:
    """Hundreds of non-null values: the Lanczos runs do not terminate by exhausting the space."""
    torch.manual_seed(2)
    layer = apply_init(build_attention("softmax", 16, 2), init)
    x = layer_norm(torch.randn(1, 256, 16, dtype=torch.float64))
    dense = jacobian_condition(layer, x, method="dense", per_block=False)
    fast = jacobian_condition(layer, x, method="qr", per_block=False)
    assert fast.kappa == pytest.approx(dense.kappa, rel=1e-6)
    assert fast.n_null == dense.n_null == fast.n_null_expected


def test_lanczos_largest_only_stops_on_the_top() -> None:
    values = torch.linspace(1, 2, 400, dtype=torch.float64) ** 6
    res = lanczos_extremes(lambda v: values * v, 400, lambda v: v, tol=1e-10, largest_only=True)
    assert res.converged and res.iterations < 400
    assert float(res.ritz[-1]) == pytest.approx(float(values[-1]), rel=1e-9)


def test_triangular_extremes_counts_a_hidden_null_value() -> None:
    """A null direction the analytic space misses: the exact svdvals fallback counts it."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(60, 40, generator=gen, dtype=torch.float64)
    a[:, 7] = a[:, 3] - 2 * a[:, 11]  # one exact linear dependence
    r = torch.linalg.qr(a, mode="r").R
    s = svdvals(a)
    found = triangular_extremes(r, rtol=1e-11)
    assert found.n_extra_null == 1
    assert found.sigma_max == pytest.approx(float(s[0]), rel=1e-12)
    assert found.sigma_min == pytest.approx(float(s[-2]), rel=1e-9)
    full_rank = triangular_extremes(
        torch.linalg.qr(torch.randn(60, 40, generator=gen, dtype=torch.float64)).R, 1e-11
    )
    assert full_rank.n_extra_null == 0


@pytest.mark.parametrize("family", ATTENTIONS.names())
def test_value_block_is_eliminated_exactly(family: str) -> None:
    torch.manual_seed(4)
    layer = build_attention(family, 8, 2, **OPTIONS.get(family, {}))
    x, mask = padded_input(4, 2, 24, 8)
    probe = make_probe(layer, layer_norm(x), mask, "qkv")
    w0, wc = snap_input(probe, 1e-12)
    null = build_null_space(probe, w0, wc, basis=True)
    jac = jvp_head_jacobian(probe, 1)
    cols = slice(2 * probe.block_size, 3 * probe.block_size)
    assert kron_factor(jac[:, cols], probe.head_dim) is not None  # A_h = P_h V_h for every family
    fast = value_eliminated_extremes(jac, null.bases[1], cols, probe.head_dim, w0, 1e-11)
    general = deflated_extremes(jac, null.bases[1], 1e-11)
    if family == "linear":  # its (S, z) null directions mix K and V: no split, the general path
        assert "linear_statistics" in null.groups and fast is None
        return
    assert fast is not None
    assert fast.sigma_max == pytest.approx(general.sigma_max, rel=1e-9)
    assert fast.sigma_min == pytest.approx(general.sigma_min, rel=1e-6)
    assert fast.n_extra_null == general.n_extra_null


def test_value_elimination_declines_a_nonlinear_value_path() -> None:
    """normalize_v makes A_h nonlinear in V: no Kronecker value block, so the general path is used,
    and qr still equals dense."""
    torch.manual_seed(5)
    layer = build_attention("normalized", 8, 2, normalize_v=True)
    x = layer_norm(torch.randn(1, 30, 8, dtype=torch.float64))
    probe = make_probe(layer, x, None, "qkv")
    snap_input(probe, 1e-12)
    jac = jvp_head_jacobian(probe, 0)
    assert kron_factor(jac[:, 2 * probe.block_size :], probe.head_dim) is None
    dense = jacobian_condition(layer, x, method="dense")
    fast = jacobian_condition(layer, x, method="qr")
    assert fast.kappa == pytest.approx(dense.kappa, rel=1e-6) and fast.n_null == dense.n_null
    assert fast.per_block["v"].kappa == pytest.approx(dense.per_block["v"].kappa, rel=1e-6)


def test_qr_method_takes_the_value_elimination(monkeypatch: pytest.MonkeyPatch) -> None:
    """On softmax with LayerNorm-ed input only the Q and K blocks alone go through the general path."""
    import lra_cond.conditioning.jacobian as jacobian

    widths = []

    def spy(jac: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        widths.append(jac.shape[1])
        return deflated_extremes(jac, *args, **kwargs)

    monkeypatch.setattr(jacobian, "deflated_extremes", spy)
    torch.manual_seed(6)
    layer = build_attention("softmax", 8, 2)
    jacobian_condition(layer, layer_norm(torch.randn(1, 40, 8)), method="qr")
    assert widths == [4 * 8] * 4  # q and k scopes, 2 heads each; "all" and "v" never


def test_layernorm_bias_makes_the_full_gauge_null_again() -> None:
    """x = gamma * xhat + beta: every row has x . (1/gamma) = beta . (1/gamma), so a shift of W_Q along
    1/gamma compensates E b_Q and all H d_h^2 gauge directions are null (plus the key shift): the
    verified count equals the dense count of exact zeros, with no unexplained value."""
    torch.manual_seed(7)
    layer = build_attention("softmax", 8, 2)  # with a query bias
    gen = torch.Generator().manual_seed(7)
    gamma = 1 + 0.1 * torch.randn(8, generator=gen, dtype=torch.float64)
    beta = 1e-3 * torch.randn(8, generator=gen, dtype=torch.float64)
    x = layer_norm(torch.randn(2, 30, 8, generator=gen, dtype=torch.float64)) * gamma + beta
    dense = jacobian_condition(layer, x, method="dense", per_block=False)
    assert dense.null_groups == {"gauge_fixed_bias": 2 * (16 - 4), "key_shift": 8, "gauge_bias_shift": 8}
    assert dense.n_null == dense.n_null_expected == 2 * 16 + 8 and not dense.notes[1:]
    fast = jacobian_condition(layer, x, method="qr", per_block=False)
    assert fast.n_null == dense.n_null and fast.kappa == pytest.approx(dense.kappa, rel=1e-6)


@pytest.mark.parametrize("sequences", [1, 2])
def test_linear_attention_null_space_is_its_key_value_statistics(sequences: int) -> None:
    """Linear attention sees K and V only through each sequence's S = sum phi(k) v^T and
    z = sum phi(k): 2 d D - B (d^2 + d) null directions per head, verified, and all that dense finds."""
    torch.manual_seed(8)
    dim, heads, d = 8, 2, 4
    layer = build_attention("linear", dim, heads)
    x = torch.randn(sequences, 60 // sequences, dim, dtype=torch.float64)
    dense = jacobian_condition(layer, x, method="dense", per_block=False)
    expected = heads * (2 * d * dim - sequences * (d * d + d))
    assert dense.n_null_expected == expected == dense.n_null
    assert set(dense.null_groups) == {"linear_statistics"}
    fast = jacobian_condition(layer, x, method="qr", per_block=False)
    assert fast.n_null == expected and fast.kappa == pytest.approx(dense.kappa, rel=1e-6)
