"""Init schemes: the structure each one promises, checked against independent float64 references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

from lra_cond.errors import UserError
from lra_cond.init import INITS, apply_init
from lra_cond.init.mimetic import mimetic_init
from lra_cond.models.attention import build_attention
from lra_cond.models.encoder import Classifier, EncoderConfig
from lra_cond.training.module import LraModel

ATTN_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight")


def classifier(dim: int = 32, num_heads: int = 2, head_dim: int | None = None, depth: int = 2) -> Classifier:
    cfg = EncoderConfig(vocab_size=16, max_len=24, num_classes=4, dim=dim, depth=depth, num_heads=num_heads)
    cfg.head_dim = head_dim
    return Classifier(cfg)


def attn(model: Classifier, i: int) -> nn.Module:
    return model.encoder.blocks[i].attn


def kappa(w: torch.Tensor) -> float:
    s = torch.linalg.svdvals(w.double())
    return (s.max() / s.min()).item()


def assert_orthonormal_rows(w: torch.Tensor, tol: float = 1e-6) -> None:
    w = w.double()
    eye = torch.eye(w.shape[0], dtype=torch.float64)
    assert (w @ w.T - eye).abs().max().item() < tol


def head_blocks(w: torch.Tensor, num_heads: int) -> list[torch.Tensor]:
    return list(w.chunk(num_heads, dim=0))


def init_with_seed(name: str, seed: int = 0, **kw) -> Classifier:
    torch.manual_seed(seed)
    model = classifier(**kw)
    torch.manual_seed(seed + 1000)
    apply_init(model, name)
    return model


# ---------------------------------------------------------------- conditioned


@pytest.mark.parametrize(("dim", "heads", "head_dim"), [(32, 2, None), (32, 2, 8), (16, 4, 8)])
def test_conditioned_v_is_rectangular_identity(dim: int, heads: int, head_dim: int | None) -> None:
    """H*d_h == D, H*d_h < D and H*d_h > D: W_V == lambda * eye(H*d_h, D), kappa(W_V) == 1."""
    for v_scale in (1.0, 2.5):
        layer = build_attention("softmax", dim, heads, head_dim=head_dim)
        apply_init(layer, "conditioned", v_scale=v_scale)
        w = layer.v_proj.weight.detach()
        inner = heads * layer.head_dim
        expected = torch.zeros(inner, dim)
        for i in range(min(inner, dim)):
            expected[i, i] = v_scale
        assert torch.equal(w, expected)
        assert kappa(w) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(("dim", "heads", "head_dim"), [(32, 2, None), (32, 4, 4), (16, 4, 8)])
def test_conditioned_qk_heads_have_orthonormal_rows(dim: int, heads: int, head_dim: int | None) -> None:
    model = init_with_seed("conditioned", dim=dim, num_heads=heads, head_dim=head_dim)
    for i in range(2):
        for proj in (attn(model, i).q_proj, attn(model, i).k_proj):
            for block in head_blocks(proj.weight.detach(), heads):
                assert_orthonormal_rows(block)


def test_conditioned_draws_differ_across_heads_matrices_layers() -> None:
    model = init_with_seed("conditioned")
    blocks = []
    for i in range(2):
        for proj in (attn(model, i).q_proj, attn(model, i).k_proj):
            blocks += head_blocks(proj.weight.detach(), 2)
    for a in range(len(blocks)):  # 2 layers x (Q, K) x 2 heads: all pairwise different
        for b in range(a + 1, len(blocks)):
            assert (blocks[a] - blocks[b]).abs().max() > 0.1


def test_same_seed_reproduces_and_other_seed_differs() -> None:
    for name in INITS.names():
        if name == "weight-selection":
            continue  # deterministic given its teacher; covered in test_weight_selection.py
        a, b, c = (init_with_seed(name, s).state_dict() for s in (0, 0, 1))
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert any(not torch.equal(a[k], c[k]) for k in a), name


# which attention weights each scheme changes relative to the default init (everything else,
# biases, W_O where untouched, embeddings, MLPs, norms, must equal the default draw exactly)
CHANGES = {
    "conditioned": {"q_proj.weight", "k_proj.weight", "v_proj.weight"},
    "conditioned-joint": {"q_proj.weight", "k_proj.weight", "v_proj.weight"},
    "conditioned-qk": {"q_proj.weight", "k_proj.weight"},
    "conditioned-v": {"v_proj.weight"},
    "identity-all": {"q_proj.weight", "k_proj.weight", "v_proj.weight"},
    "orthogonal-all": {"q_proj.weight", "k_proj.weight", "v_proj.weight"},
    "mimetic": {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"},
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_attention_schemes_touch_only_their_matrices(name: str) -> None:
    ref = init_with_seed("default").state_dict()
    got = init_with_seed(name).state_dict()
    changed = {k.split("attn.", 1)[1] for k in ref if not torch.equal(ref[k], got[k])}
    assert changed == CHANGES[name]


def test_ablation_structures() -> None:
    eye = torch.eye(32)
    ident = init_with_seed("identity-all")
    ortho = init_with_seed("orthogonal-all")
    qk = init_with_seed("conditioned-qk")
    v = init_with_seed("conditioned-v")
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(getattr(attn(ident, i), proj).weight.detach(), eye)
            for block in head_blocks(getattr(attn(ortho, i), proj).weight.detach(), 2):
                assert_orthonormal_rows(block)
        for block in head_blocks(attn(qk, i).q_proj.weight.detach(), 2):
            assert_orthonormal_rows(block)
        assert torch.equal(attn(v, i).v_proj.weight.detach(), eye)
    # orthogonal-all draws V independently of Q and K
    a = attn(ortho, 0)
    assert (a.v_proj.weight - a.q_proj.weight).abs().max() > 0.1


def test_stacked_wq_is_badly_conditioned_under_independent_heads() -> None:
    """The motivation for conditioned-joint (D=64, H=2): median stacked kappa is large."""
    kappas = []
    for seed in range(25):
        torch.manual_seed(seed)
        layer = build_attention("softmax", 64, 2)
        apply_init(layer, "conditioned")
        kappas.append(kappa(layer.q_proj.weight.detach()))
    assert statistics.median(kappas) > 10


# ---------------------------------------------------------------- conditioned-joint


@pytest.mark.parametrize(
    ("dim", "heads", "head_dim", "per_head"),
    [(64, 2, None, True), (32, 2, 8, True), (16, 4, 8, True), (32, 3, 16, False)],
)
def test_conditioned_joint_stacked_kappa_one(
    dim: int, heads: int, head_dim: int | None, per_head: bool
) -> None:
    """n = H*d_h: n == D, n < D, n = 2D (block construction), n = 1.5D (orthonormal columns)."""
    for seed in range(3):
        torch.manual_seed(seed)
        layer = build_attention("softmax", dim, heads, head_dim=head_dim)
        apply_init(layer, "conditioned-joint")
        n = heads * layer.head_dim
        for proj in (layer.q_proj, layer.k_proj):
            w = proj.weight.detach().double()
            assert kappa(w) == pytest.approx(1.0, abs=1e-6)
            if n <= dim:
                assert_orthonormal_rows(w)
            else:  # W^T W = (n/D) I: mean squared row norm 1
                assert (w.T @ w - n / dim * torch.eye(dim, dtype=torch.float64)).abs().max() < 1e-5
            if per_head:
                for block in head_blocks(w, heads):
                    assert_orthonormal_rows(block)
        assert torch.equal(layer.v_proj.weight.detach(), torch.eye(n, dim))
        assert (layer.q_proj.weight - layer.k_proj.weight).abs().max() > 0.1


# ---------------------------------------------------------------- mimetic


def rank_truncation(t: torch.Tensor, r: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(t.double())
    return u[:, :r] @ torch.diag(s[:r]) @ vh[:r]


@pytest.mark.parametrize(("dim", "heads", "head_dim"), [(64, 2, None), (64, 4, None), (16, 4, 8)])
def test_mimetic_factors_are_best_low_rank_fits(dim: int, heads: int, head_dim: int | None) -> None:
    torch.manual_seed(0)
    model = classifier(dim=dim, num_heads=heads, head_dim=head_dim)
    targets = mimetic_init(model)
    assert len(targets) == 2
    d_h = attn(model, 0).head_dim
    for i, tg in enumerate(targets):
        a = attn(model, i)
        wq, wk = a.q_proj.weight.detach().double(), a.k_proj.weight.detach().double()
        assert len(tg.qk) == heads
        for h in range(heads):
            rows = slice(h * d_h, (h + 1) * d_h)
            # torch layout: logits_h = x W_q^{hT} W_k^h x^T, so W_q^{hT} W_k^h is the D x D map
            m = wq[rows].T @ wk[rows]
            assert (m - rank_truncation(tg.qk[h], min(d_h, dim))).abs().max() < 1e-5
        composite = a.v_proj.weight.detach().double().T @ a.out_proj.weight.detach().double().T
        assert (composite - rank_truncation(tg.vo, min(heads * d_h, dim))).abs().max() < 1e-5
        assert a.v_proj.weight.abs().sum(1).min() > 0  # no value coordinate starts dead
    assert (targets[0].qk[0] - targets[0].qk[1]).abs().max() > 0.1  # independent per head
    assert (targets[0].vo - targets[1].vo).abs().max() > 0.1  # and per layer


def test_mimetic_target_statistics() -> None:
    """Fixed seed; D=64 so mean-diagonal noise is alpha/64 ~ 0.01 and std estimates ~2% accurate."""
    dim = 64
    torch.manual_seed(0)
    model = classifier(dim=dim, num_heads=2)
    targets = mimetic_init(model)
    off = ~torch.eye(dim, dtype=torch.bool)
    qk = torch.stack([t for tg in targets for t in tg.qk])  # 4 heads' targets
    assert qk.diagonal(dim1=1, dim2=2).mean().item() == pytest.approx(0.7, abs=0.03)
    assert qk[:, off].std().item() == pytest.approx(0.7 / math.sqrt(dim), rel=0.06)
    for flip, sign in ((-1, -1.0), (1, 1.0)):
        torch.manual_seed(0)
        model = classifier(dim=dim, num_heads=2)
        mimetic_init(model, vo_sign=flip)
        for i in range(2):
            a = attn(model, i)
            # the composite value->output map x -> x W_v^T W_o^T (all heads; H*d_h = D so exact)
            c = a.v_proj.weight.detach().double().T @ a.out_proj.weight.detach().double().T
            assert c.diagonal().mean().item() == pytest.approx(sign * 0.4, abs=0.03)
            assert c[off].std().item() == pytest.approx(0.4 / math.sqrt(dim), rel=0.06)


def test_mimetic_parameters() -> None:
    torch.manual_seed(0)
    model = classifier(dim=64, num_heads=2)
    targets = mimetic_init(model, alpha1=0.0, beta1=1.0, alpha2=0.0, beta2=0.5)
    a = attn(model, 0)
    m = a.q_proj.weight.detach().double()[:32].T @ a.k_proj.weight.detach().double()[:32]
    assert torch.linalg.matrix_rank(m).item() == 32  # rank-32 piece of the identity: a projection
    assert (m @ m - m).abs().max() < 1e-5
    c = a.v_proj.weight.detach().double().T @ a.out_proj.weight.detach().double().T
    assert (c + 0.5 * torch.eye(64, dtype=torch.float64)).abs().max() < 1e-5
    assert torch.equal(targets[0].vo, -0.5 * torch.eye(64, dtype=torch.float64))
    with pytest.raises(UserError, match="vo_sign"):
        apply_init(model, "mimetic", vo_sign=0)


# ---------------------------------------------------------------- baselines


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]


def test_trunc_normal() -> None:
    torch.manual_seed(0)
    model = classifier(dim=64)
    apply_init(model, "trunc-normal")
    ws = [
        *linear_weights(model),
        *(m.weight.detach() for m in model.modules() if isinstance(m, nn.Embedding)),
    ]
    pool = torch.cat([w.flatten() for w in ws]).double()
    assert pool.abs().max().item() <= 0.04 + 1e-7
    assert pool.abs().max().item() > 0.039  # the bound is reached, not a much narrower law
    # closed form: N(0, 1) truncated to [-2, 2] has variance 1 - 2*2*phi(2) / (2*Phi(2) - 1)
    phi = math.exp(-2) / math.sqrt(2 * math.pi)
    mass = math.erf(2 / math.sqrt(2))
    assert pool.std().item() == pytest.approx(0.02 * math.sqrt(1 - 4 * phi / mass), rel=0.03)
    assert all(not m.bias.any() for m in model.modules() if isinstance(m, nn.Linear))
    apply_init(model, "trunc-normal", std=0.1, cutoff=1.0)
    assert max(w.abs().max().item() for w in linear_weights(model)) <= 0.1 + 1e-7
    assert torch.equal(model.encoder.norm.weight.detach(), torch.ones(64))


@pytest.mark.parametrize("distribution", ["uniform", "normal"])
def test_xavier(distribution: str) -> None:
    torch.manual_seed(0)
    model = classifier(dim=64)
    apply_init(model, "xavier", distribution=distribution)
    # weights divided by the Glorot std sqrt(2 / (fan_in + fan_out)) pool to unit variance
    scaled = []
    for w in linear_weights(model):
        std = math.sqrt(2 / sum(w.shape))
        if distribution == "uniform":
            assert w.abs().max().item() <= math.sqrt(3) * std + 1e-7
        scaled.append(w.flatten().double() / std)
    assert torch.cat(scaled).std().item() == pytest.approx(1.0, rel=0.03)
    assert all(not m.bias.any() for m in model.modules() if isinstance(m, nn.Linear))
    assert model.encoder.token_emb.weight.std().item() == pytest.approx(0.02, rel=0.2)  # default kept


def test_default_embeddings() -> None:
    torch.manual_seed(0)
    model = classifier(dim=64)
    apply_init(model, "default")
    assert model.encoder.pos_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)


# ---------------------------------------------------------------- names, parameters, hparams


def one_line_error(fn, *args, **kw) -> str:  # noqa: ANN001
    with pytest.raises(UserError) as info:
        fn(*args, **kw)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_unknown_scheme_lists_valid_names() -> None:
    msg = one_line_error(apply_init, classifier(), "conditoned")
    assert "conditoned" in msg
    for name in INITS.names():
        assert name in msg


def test_bad_parameters_list_valid_ones() -> None:
    msg = one_line_error(apply_init, classifier(), "conditioned", v_scael=2.0)
    assert "v_scael" in msg and "v_scale=1.0" in msg
    msg = one_line_error(apply_init, classifier(), "mimetic", gamma=1)
    assert all(p in msg for p in ("alpha1", "beta1", "alpha2", "beta2", "vo_sign"))
    assert "none" in one_line_error(apply_init, classifier(), "default", std=1.0)
    assert "number" in one_line_error(apply_init, classifier(), "conditioned", v_scale="big")
    assert "checkpoint" in one_line_error(apply_init, classifier(), "weight-selection")
    assert "distribution" in one_line_error(apply_init, classifier(), "xavier", distribution="cauchy")


def test_lra_model_passes_and_records_init_args() -> None:
    model = LraModel(init="conditioned", init_args={"v_scale": 2.0}, dim=32)
    assert model.hparams.init == "conditioned"
    assert model.hparams.init_args == {"v_scale": 2.0}
    assert torch.equal(model.net.encoder.blocks[1].attn.v_proj.weight.detach(), 2.0 * torch.eye(32))
