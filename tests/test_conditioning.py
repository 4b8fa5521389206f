"""Attention-Jacobian condition numbers against an independent dense computation, null-space
counts against the theory, matrix-free against dense, and the init ordering."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from einops import rearrange

from lra_cond.conditioning import jacobian_condition, matrix_condition
from lra_cond.conditioning.jacobian import MF_RESOLUTION
from lra_cond.init import apply_init
from lra_cond.models.attention import ATTENTIONS, build_attention

CUT = 1e-9
# Family options for tiny probes (Nystrom's default 64 landmarks exceed these sequence lengths).
OPTIONS = {
    "nystrom": {"num_landmarks": 4}
}  # the reference's own null cut (float64 null values sit near 1e-15 * sigma_max)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """LayerNorm at init (gamma 1, beta 0): mean-free rows."""
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


def reference_spectrum(layer, x, mask=None) -> torch.Tensor:  # noqa: ANN001
    """All singular values of d vec(A_real) / d (W_Q, W_K, W_V), written independently of the
    library: full (not per-head) Jacobian by torch.autograd.functional.jacobian on a hand-written
    forward through the family's explicit kernel, float64, eval."""

    lay = copy.deepcopy(layer).double().eval()
    x = x.double()
    h = lay.num_heads
    real = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else ~mask

    def proj(w, lin):  # noqa: ANN001, ANN202
        out = x @ w.T + (0 if lin.bias is None else lin.bias)
        return rearrange(out, "b n (h d) -> b h n d", h=h)

    def forward(wq, wk, wv):  # noqa: ANN001, ANN202
        q, k, v = proj(wq, lay.q_proj), proj(wk, lay.k_proj), proj(wv, lay.v_proj)
        out = rearrange(lay.kernel_explicit(q, k, v, mask), "b h n d -> b n (h d)")
        return out[real].reshape(-1)

    ws = tuple(getattr(lay, f"{b}_proj").weight.detach().clone() for b in "qkv")
    jac = torch.autograd.functional.jacobian(forward, ws)
    full = torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1)
    return torch.linalg.svdvals(full)


def kappa_and_null(s: torch.Tensor) -> tuple[float, int]:
    kept = s[s > CUT * s[0]]
    return float(kept[0] / kept[-1]), int(s.numel() - kept.numel())


SHAPES = [
    # (dim, heads, head_dim or None, batch, seq): H*d_h = D, H*d_h < D, H*d_h > D
    (8, 2, None, 2, 16),
    (8, 2, 3, 2, 16),
    (6, 3, 4, 1, 24),
]


@pytest.mark.parametrize("family", ATTENTIONS.names())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "D{}H{}d{}".format(*s[:3]))
@pytest.mark.parametrize("mean_free", [False, True], ids=["raw", "layernorm"])
def test_dense_matches_independent_jacobian(family: str, shape: tuple, mean_free: bool) -> None:
    dim, heads, head_dim, batch, seq = shape
    torch.manual_seed(1)
    layer = build_attention(family, dim, heads, head_dim=head_dim, dropout=0.1, **OPTIONS.get(family, {}))
    x = torch.randn(batch, seq, dim, dtype=torch.float64)
    x = layer_norm(x) if mean_free else x
    mask = None
    if batch > 1:
        mask = torch.zeros(batch, seq, dtype=torch.bool)
        mask[1, seq - 3 :] = True  # padded query rows are not outputs; padded keys are masked
    ref_kappa, ref_null = kappa_and_null(reference_spectrum(layer, x, mask))
    res = jacobian_condition(layer, x, mask, method="dense", rtol=CUT)
    assert res.reason is None
    assert res.kappa == pytest.approx(ref_kappa, rel=1e-6)
    assert res.n_null == ref_null
    assert res.n_params == 3 * layer.num_heads * layer.head_dim * dim


def test_per_block_and_weight_conditions_match_reference() -> None:
    torch.manual_seed(2)
    layer = build_attention("softmax", 8, 2)
    x = layer_norm(torch.randn(1, 30, 8, dtype=torch.float64))
    res = jacobian_condition(layer, x)
    # V alone: A_h = P_h X W_V^hT, so J_V's singular values are those of P_h X (each d_h times).
    lay = copy.deepcopy(layer).double()
    q = rearrange(lay.q_proj(x), "b n (h d) -> b h n d", h=2)
    k = rearrange(lay.k_proj(x), "b n (h d) -> b h n d", h=2)
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), -1).detach()
    s = torch.cat([torch.linalg.svdvals(p[0, h] @ x[0]) for h in range(2)]).sort(descending=True).values
    kv, nv = kappa_and_null(s)
    assert res.per_block["v"].kappa == pytest.approx(kv, rel=1e-6)
    assert res.per_block["v"].n_null == 4 * nv  # each null value of P_h X, d_h times
    w = layer.q_proj.weight.detach()
    sv = torch.linalg.svdvals(w[4:].double())
    assert res.weights["q"]["heads"][1] == pytest.approx(float(sv[0] / sv[-1]), rel=1e-9)
    assert res.weights["v"]["stacked"] == pytest.approx(matrix_condition(layer.v_proj.weight), rel=1e-12)


def test_null_counts_softmax() -> None:
    """H d_h^2 (gauge) on raw Gaussian inputs; + 3 H d_h on mean-free (LayerNorm-ed) inputs;
    with a fixed query bias the gauge keeps only M with M b_Q = b_Q: H (d_h^2 - d_h)."""
    torch.manual_seed(3)
    dim, heads, d = 8, 2, 4
    layer = build_attention("softmax", dim, heads, bias=False)
    x = torch.randn(2, 20, dim, dtype=torch.float64)
    raw = jacobian_condition(layer, x, per_block=False)
    assert raw.n_null == heads * d * d == raw.n_null_expected
    ln = jacobian_condition(layer, layer_norm(x))
    assert ln.n_null == heads * d * d + 3 * heads * d == ln.n_null_expected
    assert {b: s.n_null for b, s in ln.per_block.items()} == {"q": heads * d, "k": heads * d, "v": heads * d}
    biased = build_attention("softmax", dim, heads)
    assert jacobian_condition(biased, x, per_block=False).n_null == heads * (d * d - d)
    # Float32 LayerNorm output is mean-free only to ~1e-7: still the exact count (input snapped).
    assert jacobian_condition(layer, layer_norm(x.float()), per_block=False).n_null == ln.n_null


def test_null_directions_leave_output_unchanged() -> None:
    """The symmetries themselves, checked on the layer's output (no Jacobian involved)."""
    torch.manual_seed(4)
    layer = build_attention("softmax", 8, 2, bias=False).double().eval()
    x = layer_norm(torch.randn(1, 12, 8, dtype=torch.float64))
    base = layer.heads_output(x)
    with torch.no_grad():
        m = torch.randn(4, 4, dtype=torch.float64) + 3 * torch.eye(4, dtype=torch.float64)
        layer.q_proj.weight[:4] = m @ layer.q_proj.weight[:4]
        layer.k_proj.weight[:4] = torch.linalg.inv(m).T @ layer.k_proj.weight[:4]
        for proj in (layer.q_proj, layer.k_proj, layer.v_proj):  # W <- W + u 1^T on mean-free rows
            proj.weight += torch.randn(8, 1, dtype=torch.float64) @ torch.ones(1, 8, dtype=torch.float64)
    torch.testing.assert_close(layer.heads_output(x), base, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", ATTENTIONS.names())
def test_matrix_free_within_one_percent_of_dense(family: str) -> None:
    torch.manual_seed(5)
    layer = build_attention(family, 6, 2, **OPTIONS.get(family, {}))
    x = layer_norm(torch.randn(2, 132, 6, dtype=torch.float64))
    mask = torch.zeros(2, 132, dtype=torch.bool)
    mask[1, 128:] = True  # 260 real tokens
    # Matrix-free resolves singular values down to MF_RESOLUTION * sigma_max (eigenvalues of J^T J carry
    # ~1e-16 absolute error); compare with dense at that cut (linear attention has near-null values
    # at ~1e-11 that only dense can see).
    dense = jacobian_condition(layer, x, mask, method="dense", per_block=False, rtol=MF_RESOLUTION)
    free = jacobian_condition(layer, x, mask, method="matrix-free", per_block=False)
    assert free.n_tokens >= 256
    assert free.kappa == pytest.approx(dense.kappa, rel=0.01)
    assert free.sigma_max == pytest.approx(dense.sigma_max, rel=0.01)
    if family == "softmax":  # all null directions are known symmetries, deflated exactly
        assert free.n_null == dense.n_null == jacobian_condition(layer, x, mask, per_block=False).n_null


def test_matrix_free_per_block_agrees() -> None:
    torch.manual_seed(6)
    layer = build_attention("softmax", 6, 2)
    x = torch.randn(1, 40, 6, dtype=torch.float64)
    dense = jacobian_condition(layer, x, blocks="qk")
    free = jacobian_condition(layer, x, blocks="qk", method="matrix-free")
    for b in "qk":
        assert free.per_block[b].kappa == pytest.approx(dense.per_block[b].kappa, rel=0.01)
    assert set(free.per_block) == {"q", "k"}


def test_probe_too_small_says_so() -> None:
    layer = build_attention("softmax", 8, 2)
    res = jacobian_condition(layer, torch.randn(2, 11, 8))  # 22 tokens < 3 * 8
    assert res.kappa is None and "too small" in res.reason and "24" in res.reason
    assert res.weights["q"]["stacked"] > 0  # weight conditions need no probe


def test_callers_layer_untouched() -> None:
    torch.manual_seed(7)
    layer = build_attention("softmax", 8, 2, dropout=0.5).train()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    jacobian_condition(layer, torch.randn(1, 30, 8))
    assert layer.training and not layer.explicit
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
