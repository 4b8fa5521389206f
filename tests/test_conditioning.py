"""The attention-Jacobian condition number against an independent dense computation of the same
definition, its continuity in a LayerNorm bias and in linear attention's eps, null-space counts
against the theory, and the init ordering."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from einops import rearrange

from lra_cond.conditioning import cut_separated, jacobian_condition, matrix_condition
from lra_cond.conditioning.families.base import FAMILY_JACOBIANS
from lra_cond.conditioning.families.softmax import SoftmaxJacobian
from lra_cond.init import apply_init
from lra_cond.models.attention import ATTENTIONS, build_attention
from tests.conftest import DEVICES

CUT = 1e-9  # the reference's null cut (float64 null values sit near 1e-15 * sigma_max)
# Family options for tiny probes (Nystrom's default 64 landmarks exceed these sequence lengths).
OPTIONS = {"nystrom": {"num_landmarks": 6}}


def layer_norm(x: torch.Tensor, beta: float = 0.0, seed: int = 0) -> torch.Tensor:
    """LayerNorm with a fixed random gamma and bias beta * b (beta = 0: mean-free rows)."""
    gen = torch.Generator().manual_seed(seed)
    dim = x.shape[-1]
    gamma = 1 + 0.2 * torch.randn(dim, generator=gen, dtype=torch.float64)
    b = torch.randn(dim, generator=gen, dtype=torch.float64)
    return torch.nn.functional.layer_norm(x, (dim,), gamma.to(x.dtype), (beta * b).to(x.dtype))


def reference_spectrum(layer, x, mask=None, biases: bool = True) -> torch.Tensor:  # noqa: ANN001
    """All singular values of d vec(A_real) / d theta, written independently of the library:
    theta = (W_Q, b_Q, W_K, b_K, W_V, b_V) (the biases only if ``biases`` and the layer has them),
    the full (not per-head) Jacobian by torch.autograd.functional.jacobian through the family's
    explicit kernel, float64, eval, linear attention at eps = 0."""
    lay = copy.deepcopy(layer).double().eval()
    if hasattr(lay, "eps"):
        lay.eps = 0.0
    x = x.double()
    h = lay.num_heads
    real = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else ~mask
    projs = (lay.q_proj, lay.k_proj, lay.v_proj)
    with_bias = biases and lay.q_proj.bias is not None

    def forward(*params):  # noqa: ANN002, ANN202
        outs = []
        for i, lin in enumerate(projs):
            w = params[2 * i] if with_bias else params[i]
            b = params[2 * i + 1] if with_bias else (0 if lin.bias is None else lin.bias)
            outs.append(rearrange(x @ w.T + b, "b n (h d) -> b h n d", h=h))
        out = rearrange(lay.kernel_explicit(*outs, mask), "b h n d -> b n (h d)")
        return out[real].reshape(-1)

    params = []
    for lin in projs:
        params.append(lin.weight.detach().clone())
        if with_bias:
            params.append(lin.bias.detach().clone())
    jac = torch.autograd.functional.jacobian(forward, tuple(params))
    full = torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1)
    return torch.linalg.svdvals(full)


def kappa_and_null(s: torch.Tensor) -> tuple[float, int]:
    kept = s[s > CUT * s[0]]
    return float(kept[0] / kept[-1]), int(s.numel() - kept.numel())


def padded(seed: int, batch: int, seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = None
    if batch > 1:
        mask = torch.zeros(batch, seq, dtype=torch.bool)
        mask[1, seq - 5 :] = True  # padded query rows are not outputs; padded keys are masked
    return x, mask


SHAPES = [
    # (dim, heads, head_dim or None, batch, seq): H*d_h = D, H*d_h < D, H*d_h > D
    (8, 2, None, 2, 24),
    (8, 2, 3, 2, 24),
    (6, 3, 4, 1, 30),
]


@pytest.mark.parametrize("family", ATTENTIONS.names())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "D{}H{}d{}".format(*s[:3]))
@pytest.mark.parametrize("inputs", ["raw", "layernorm", "layernorm-bias"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_method_matches_the_independent_jacobian(
    family: str, shape: tuple, inputs: str, bias: bool, device: str
) -> None:
    dim, heads, head_dim, batch, seq = shape
    torch.manual_seed(1)
    options = {"head_dim": head_dim, "dropout": 0.1, "bias": bias, **OPTIONS.get(family, {})}
    layer = build_attention(family, dim, heads, **options)
    x, mask = padded(1, batch, seq, dim)
    if inputs != "raw":
        x = layer_norm(x, beta=0.3 if inputs == "layernorm-bias" else 0.0)
    ref_kappa, ref_null = kappa_and_null(reference_spectrum(layer, x, mask))
    layer, x = layer.to(device), x.to(device)  # the probe computes where the layer lives
    mask = None if mask is None else mask.to(device)
    for method in ("gram", "qr", "dense"):
        res = jacobian_condition(layer, x, mask, method=method, rtol=CUT, per_block=False)
        assert res.reason is None
        assert res.kappa == pytest.approx(ref_kappa, rel=1e-6), method
        assert res.n_null == ref_null, method
        assert res.n_null_expected == ref_null, method  # every null explained by a verified group
        assert res.n_params == 3 * layer.num_heads * layer.head_dim * (dim + bias)


def test_bias_free_layer_is_the_papers_quantity() -> None:
    """Without biases the definition is d A / d (W_Q, W_K, W_V) of A = softmax(X W_Q W_K^T X^T) X W_V:
    for a biased layer the weights-only Jacobian is a different number."""
    torch.manual_seed(2)
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    plain = build_attention("softmax", 8, 2, bias=False)
    k_plain, _ = kappa_and_null(reference_spectrum(plain, x, biases=False))
    assert jacobian_condition(plain, x).kappa == pytest.approx(k_plain, rel=1e-8)
    biased = build_attention("softmax", 8, 2)
    k_weights, _ = kappa_and_null(reference_spectrum(biased, x, biases=False))
    assert jacobian_condition(biased, x).kappa != pytest.approx(k_weights, rel=1e-3)


@pytest.mark.parametrize("family", ATTENTIONS.names())
def test_kappa_is_continuous_in_the_layernorm_bias(family: str) -> None:
    """Fixed weights (default biases), probe input LayerNorm(z) with bias beta * b. With the biases
    held fixed, kappa scaled like 1/beta (9.6e10 at beta = 1e-8 against 7.2e3 at 0)."""
    torch.manual_seed(3)
    layer = build_attention(family, 16, 2, **({"num_landmarks": 16} if family == "nystrom" else {}))
    z = torch.randn(1, 64, 16, dtype=torch.float64)
    betas = (0, 1e-12, 1e-8, 1e-4)
    kappa = {beta: jacobian_condition(layer, layer_norm(z, beta), per_block=False) for beta in betas}
    for beta in (1e-12, 1e-8):
        assert kappa[beta].kappa == pytest.approx(kappa[0].kappa, rel=0.01), beta
    assert 0.5 < kappa[1e-4].kappa / kappa[0].kappa < 2
    assert len({r.n_null for r in kappa.values()}) == 1  # the null count does not jump either
    assert all(r.n_null == r.n_null_expected for r in kappa.values())


def test_linear_attention_kappa_does_not_depend_on_eps() -> None:
    """Measured at eps -> 0: before, H*B singular values sat at ~eps * sigma_max and set kappa."""
    torch.manual_seed(4)
    x = layer_norm(torch.randn(1, 64, 16, dtype=torch.float64), beta=0.1)
    kappas = []
    for eps in (1e-6, 1e-5, 1e-2):
        torch.manual_seed(4)
        kappas.append(jacobian_condition(build_attention("linear", 16, 2, eps=eps), x, per_block=False).kappa)
    assert kappas[1] == pytest.approx(kappas[0], rel=0.01)
    assert kappas[2] == pytest.approx(kappas[0], rel=0.01)
    assert kappas[0] < 1e6  # well below the eps-set values (~1e10) of the old definition


def test_per_block_and_weight_conditions_match_reference() -> None:
    torch.manual_seed(5)
    layer = build_attention("softmax", 8, 2)
    x = layer_norm(torch.randn(1, 30, 8, dtype=torch.float64))
    res = jacobian_condition(layer, x)
    # V alone: A_h = P_h X~ W~_V^hT (X~ = [X, 1]), so J_V's singular values are those of P_h X~, d_h times.
    lay = copy.deepcopy(layer).double()
    q = rearrange(lay.q_proj(x), "b n (h d) -> b h n d", h=2)
    k = rearrange(lay.k_proj(x), "b n (h d) -> b h n d", h=2)
    p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1).detach()
    xa = torch.cat([x[0], torch.ones(30, 1, dtype=torch.float64)], 1)
    s = torch.cat([torch.linalg.svdvals(p[0, h] @ xa) for h in range(2)]).sort(descending=True).values
    kv, nv = kappa_and_null(s)  # P_h X~ (30 x 9) has one null value per head (mean-free X)
    assert res.per_block["v"].kappa == pytest.approx(kv, rel=1e-8)
    assert res.per_block["v"].n_null == 4 * nv  # each null value of P_h X~, d_h times
    w = layer.q_proj.weight.detach()
    sv = torch.linalg.svdvals(w[4:].double())
    assert res.weights["q"]["heads"][1] == pytest.approx(float(sv[0] / sv[-1]), rel=1e-9)
    assert res.weights["v"]["stacked"] == pytest.approx(matrix_condition(layer.v_proj.weight), rel=1e-12)
    sx = torch.linalg.svdvals(xa)  # what the projections read: [X, 1], one null direction
    assert res.kappa_x == pytest.approx(float(sx[0] / sx[-2]), rel=1e-9) and res.n_null_x == 1


def test_null_counts_softmax() -> None:
    """Bias-free layer: H d_h^2 (gauge) on raw inputs, + 3 H d_h on mean-free ones. With biases the
    augmented input [x, 1] adds the key shift along the bias column (H d_h), and a LayerNorm bias
    changes nothing: its rows x~ . [1/gamma, -c] = 0 keep the same input null space."""
    torch.manual_seed(6)
    dim, heads, d = 8, 2, 4
    x = torch.randn(2, 20, dim, dtype=torch.float64)
    plain = build_attention("softmax", dim, heads, bias=False)
    assert jacobian_condition(plain, x, per_block=False).n_null == heads * d * d
    ln = jacobian_condition(plain, layer_norm(x))
    assert ln.n_null == heads * d * d + 3 * heads * d == ln.n_null_expected
    assert {b: s.n_null for b, s in ln.per_block.items()} == {"q": heads * d, "k": heads * d, "v": heads * d}
    biased = build_attention("softmax", dim, heads)
    raw = jacobian_condition(biased, x, per_block=False)
    assert raw.n_null == heads * d * d + heads * d  # gauge + key shift along the bias column
    for beta in (0.0, 0.5):
        res = jacobian_condition(biased, layer_norm(x, beta))
        assert res.n_null == heads * d * d + 4 * heads * d == res.n_null_expected, beta
        assert res.null_groups == {
            "input_null_q": heads * d,
            "input_null_k": heads * d,
            "input_null_v": heads * d,
            "key_shift": heads * d,
            "gauge": heads * d * d,
        }
    # Float32 LayerNorm output is mean-free only to ~1e-7: still the exact count (input snapped).
    assert jacobian_condition(plain, layer_norm(x).float(), per_block=False).n_null == ln.n_null


def test_null_directions_leave_output_unchanged() -> None:
    """The symmetries themselves, on the layer's output (no Jacobian involved): the gauge over
    weights and biases together, the input null direction [1/gamma, -c] of a LayerNorm with a bias,
    and the key shift along the bias column."""
    torch.manual_seed(7)
    layer = build_attention("softmax", 8, 2).double().eval()
    gen = torch.Generator().manual_seed(0)
    gamma = 1 + 0.2 * torch.randn(8, generator=gen, dtype=torch.float64)
    beta = torch.randn(8, generator=gen, dtype=torch.float64)
    x = torch.nn.functional.layer_norm(torch.randn(1, 12, 8, dtype=torch.float64), (8,), gamma, beta)
    c = float(beta @ (1 / gamma))
    base = layer.heads_output(x)
    with torch.no_grad():
        m = torch.randn(4, 4, dtype=torch.float64) + 3 * torch.eye(4, dtype=torch.float64)
        for proj, t in ((layer.q_proj, m), (layer.k_proj, torch.linalg.inv(m).T)):
            proj.weight[:4] = t @ proj.weight[:4]
            proj.bias[:4] = t @ proj.bias[:4]
        for proj in (layer.q_proj, layer.k_proj, layer.v_proj):  # W~ <- W~ + u [1/gamma, -c]^T
            u = torch.randn(8, 1, dtype=torch.float64)
            proj.weight += u @ (1 / gamma)[None]
            proj.bias -= c * u[:, 0]
        layer.k_proj.bias += torch.randn(8, dtype=torch.float64)  # every key shifted alike
    torch.testing.assert_close(layer.heads_output(x), base, rtol=1e-10, atol=1e-12)


class NoSymmetries(SoftmaxJacobian):
    """Softmax attention's Jacobian declaring none of its symmetries (a test double, not registered)."""

    def symmetries(self, inp):  # noqa: ANN001, ANN201
        return {}


def test_unexplained_null_values_are_counted_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FAMILY_JACOBIANS, "softmax", NoSymmetries)
    torch.manual_seed(8)
    layer = build_attention("softmax", 8, 2)
    x = layer_norm(torch.randn(1, 30, 8, dtype=torch.float64))
    res = jacobian_condition(layer, x, per_block=False)
    ref_kappa, ref_null = kappa_and_null(reference_spectrum(layer, x))
    assert res.n_null_expected == 3 * 2 * 4  # only the input's own null space is verified
    assert res.n_null == ref_null == res.n_null_expected + 2 * 16 + 2 * 4  # + gauge and key shift, counted
    assert res.kappa == pytest.approx(ref_kappa, rel=1e-8)
    assert any("verified symmetries give" in n for n in res.notes)


def test_a_cut_inside_the_spectrum_is_flagged_and_both_methods_measure_its_separation() -> None:
    """With the default rtol the exact nulls sit many decades under sigma_min (a separated cut). With
    rtol between two genuine singular values the cut excludes the smaller: both methods then count
    it as null, report sigma_min / (the largest excluded value) as the independent spectrum gives it,
    and flag the probe when that is under a decade."""
    torch.manual_seed(4)
    layer = build_attention("softmax", 8, 2)
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    s = reference_spectrum(layer, x)
    _, n_null = kappa_and_null(s)
    genuine = s[: s.numel() - n_null]
    for method in ("gram", "dense"):
        res = jacobian_condition(layer, x, method=method, per_block=False)
        assert res.cut_separation > 6 and cut_separated(res.cut_separation), method
    ratios = genuine[-11:-1] / genuine[-10:]  # the bottom ten gaps between neighbours
    k = int(torch.argmin(ratios)) + genuine.numel() - 11  # genuine[k] kept, genuine[k + 1] cut
    assert float(ratios.min()) < 10
    rtol = float((genuine[k] * genuine[k + 1]).sqrt() / s[0])
    for method in ("gram", "dense"):
        res = jacobian_condition(layer, x, method=method, rtol=rtol, per_block=False)
        assert res.kappa == pytest.approx(float(s[0] / genuine[k]), rel=1e-7), method
        assert res.n_null == n_null + genuine.numel() - 1 - k, method
        separation = math.log10(float(genuine[k] / genuine[k + 1]))
        assert res.cut_separation == pytest.approx(separation, rel=1e-5, abs=1e-6), method
        assert not cut_separated(res.cut_separation), method


def test_a_verified_group_above_the_cut_is_not_deflated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A declared group that passes the numerical check (J v under 1e-8 of J's gain) but on which J is
    not under rtol * sigma_max is, by the cut's own test, not null: the probe then takes that scope
    from svdvals and says so, so kappa and n_null equal the dense reference's."""
    from lra_cond.conditioning.linearised import linearise

    torch.manual_seed(6)
    layer = build_attention("softmax", 8, 2)
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    probe = linearise(layer, x, None, "qkv")
    tilted = []  # per head: an exact null direction tilted towards the smallest genuine one
    for h in range(2):
        _, s, vh = torch.linalg.svd(probe.head_jacobian(h), full_matrices=True)
        genuine = int((s > 1e-13 * s[0]).sum())
        # gain 1e-11 sigma_max: accepted by the check, excluded by no cut at rtol 1e-13
        tilt = 1e-11 * float(s[0] / s[genuine - 1])
        tilted.append(vh[-1] + tilt * vh[genuine - 1])

    class Tilted(SoftmaxJacobian):  # a test double, not registered
        def symmetries(self, inp):  # noqa: ANN001, ANN201
            groups = super().symmetries(inp)
            if inp.blocks == ("q", "k", "v"):
                v = tilted[inp.h].reshape(3, 1, inp.d, inp.dim)
                groups["tilted"] = {b: v[i] for i, b in enumerate("qkv")}
            return groups

    dense = jacobian_condition(layer, x, method="dense", per_block=False)
    monkeypatch.setitem(FAMILY_JACOBIANS, "softmax", Tilted)
    res = jacobian_condition(layer, x, per_block=False)
    assert res.null_groups.get("tilted") == 2  # it passed the numerical check in both heads
    assert any("above rtol: values taken from svdvals" in n for n in res.notes)
    assert res.kappa == pytest.approx(dense.kappa, rel=1e-9) and res.n_null == dense.n_null


def test_a_group_inside_the_span_of_others_does_not_bound_the_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified group that adds no direction to the deflated basis (it lies within SPAN_RTOL of the
    span of the groups before it, as linear's feature gauge does of Q's null inputs) is not deflated,
    so its own gain, here 1e-11 sigma_max from a less exact basis, must not send the scope to
    svdvals: kappa and n_null still equal the dense reference's, from the fast path."""
    from lra_cond.conditioning import nullspace
    from lra_cond.conditioning.linearised import linearise

    torch.manual_seed(6)
    layer = build_attention("softmax", 8, 2)
    x = layer_norm(torch.randn(1, 40, 8, dtype=torch.float64))
    probe = linearise(layer, x, None, "qkv")
    tilts = []  # per head: a genuine direction scaled to gain 1e-11 sigma_max
    for h in range(2):
        _, s, vh = torch.linalg.svd(probe.head_jacobian(h), full_matrices=True)
        genuine = int((s > 1e-13 * s[0]).sum())
        tilts.append(1e-11 * float(s[0] / s[genuine - 1]) * vh[genuine - 1])

    class Redundant(SoftmaxJacobian):  # a test double, not registered
        def symmetries(self, inp):  # noqa: ANN001, ANN201
            groups = super().symmetries(inp)
            if inp.blocks == ("q", "k", "v"):  # the key shifts again, one of them tilted
                shifts = groups["key_shift"]["k"]
                v = torch.zeros(3, *shifts.shape, dtype=shifts.dtype)
                v[1] = shifts
                v[:, 0] += float(shifts[0].norm()) * tilts[inp.h].reshape(3, inp.d, inp.dim)
                groups["redundant"] = {b: v[i] for i, b in enumerate("qkv")}
            return groups

    gains: dict[str, float] = {}
    verified = nullspace.verified_groups

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        kept, found = verified(*args, **kwargs)
        gains.update(found)
        return kept, found

    dense = jacobian_condition(layer, x, method="dense", per_block=False)
    monkeypatch.setitem(FAMILY_JACOBIANS, "softmax", Redundant)
    monkeypatch.setattr(nullspace, "verified_groups", spy)
    res = jacobian_condition(layer, x, per_block=False)
    assert gains["redundant"] > 1e-13 * res.sigma_max  # it passed the check, above the cut
    assert "redundant" not in res.null_groups  # and added no direction
    assert not any("svdvals" in n for n in res.notes)
    assert res.kappa == pytest.approx(dense.kappa, rel=1e-8) and res.n_null == dense.n_null
    assert res.null_gain < 1e-13 * res.sigma_max


def test_probe_too_small_says_so() -> None:
    layer = build_attention("softmax", 8, 2)
    res = jacobian_condition(layer, torch.randn(2, 11, 8))  # 22 tokens < 3 * (8 + 1)
    assert res.kappa is None and "too small" in res.reason and "27" in res.reason
    assert res.weights["q"]["stacked"] > 0  # weight conditions need no probe


@pytest.mark.parametrize("family", ATTENTIONS.names())
def test_probe_creates_its_tensors_on_the_inputs_device(family: str) -> None:
    """Every tensor the probe makes lives on its inputs' device (CUDA bugs found on a GPU: index
    tensors built on the CPU). Under torch's default device ``meta`` any tensor made without one
    lands there and meets the CPU inputs, so this catches them on a CPU-only machine."""
    torch.manual_seed(4)
    layer = build_attention(family, 8, 2, **OPTIONS.get(family, {}))
    x = layer_norm(torch.randn(3, 24, 8, dtype=torch.float64), beta=0.3)
    mask = torch.arange(24)[None, :] >= torch.tensor([24, 19, 3])[:, None]  # one sequence shorter than d
    expected = jacobian_condition(layer, x, mask)
    with torch.device("meta"):
        got = jacobian_condition(layer, x, mask)
    assert got.kappa == expected.kappa and got.n_null == expected.n_null == expected.n_null_expected
    for block, summary in expected.per_block.items():
        assert got.per_block[block].kappa == summary.kappa, block


def test_callers_layer_untouched() -> None:
    torch.manual_seed(9)
    layer = build_attention("linear", 8, 2, dropout=0.5).train()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    jacobian_condition(layer, torch.randn(1, 30, 8))
    assert layer.training and not layer.explicit and layer.eps == 1e-6
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def test_conditioned_init_is_better_conditioned_than_default() -> None:
    """Paper-style claim, checked: at init (seed 0) kappa(conditioned) < kappa(default), softmax."""
    kappas = {}
    x = layer_norm(torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    for init in ("default", "conditioned"):
        torch.manual_seed(0)
        layer = apply_init(build_attention("softmax", 16, 2), init)
        kappas[init] = jacobian_condition(layer, x, per_block=False).kappa
    assert kappas["conditioned"] < kappas["default"], kappas


def test_svdvals_of_a_scope_on_its_support_are_the_full_columns_values() -> None:
    """A scope that falls back to svdvals takes them from its reduced columns [J_kron | J_S P] and
    the support's removed directions as exact zeros (J_S = J_S P P^T, P orthonormal): the same
    sigma_max, sigma_min and null count as svdvals of every formed column, on linear attention's
    whole head and its K block alone (with and without a support reduction in the scope)."""
    from lra_cond.conditioning.jacobian import _dense_summary
    from lra_cond.conditioning.linearised import linearise
    from lra_cond.conditioning.nullspace import scope_nulls, snap_input

    torch.manual_seed(3)
    layer = build_attention("linear", 8, 2)
    x = layer_norm(torch.randn(2, 24, 8, dtype=torch.float64))
    probe = linearise(layer, x, None, "qkv")
    jacs = [probe.head_jacobian_operator(h) for h in range(probe.num_heads)]
    w0 = snap_input(probe, 1e-10)
    for sb in [("q", "k", "v"), ("k",), ("q",)]:
        nulls, _ = scope_nulls(probe, jacs, sb, w0, {}, False)
        assert (nulls[0].dense is not None) == (sb != ("q",))  # Q alone has no support
        full = _dense_summary(jacs, sb, 1e-13, 0, 0)
        reduced = _dense_summary(jacs, sb, 1e-13, 0, 0, nulls)
        assert reduced.sigma_max == pytest.approx(full.sigma_max, rel=1e-12), sb
        assert reduced.sigma_min == pytest.approx(full.sigma_min, rel=1e-9), sb
        assert reduced.n_null == full.n_null and (sb == ("q",) or nulls[0].reduced > 0), sb
