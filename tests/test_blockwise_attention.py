"""The blockwise CPU softmax kernel (dropout on probabilities) against the plain formula."""

from __future__ import annotations

import math

import pytest
import torch

from lra_cond.models.attention import build_attention
from lra_cond.models.attention.blockwise import (
    SAVED_SCORES,
    _spans,
    block_keep,
    blockwise_attention,
    prefix_lengths,
    quantized_rate,
)
from lra_cond.models.attention.sdpa import SCORE_BUDGET, attend
from lra_cond.models.encoder import padding_mask


def full_keep(seed: int, shape: tuple[int, int, int, int], lengths: list[int], p: float, rows: int):
    """The (B, H, N, N) keep mask the kernel used, assembled from its per-block masks."""
    b_, h, n, m = shape
    keep = torch.zeros(shape, dtype=torch.float64)
    spans = _spans(n, rows)
    for b in range(b_):
        for i, (s, e) in enumerate(spans):
            keep[b, :, s:e, : lengths[b]] = block_keep(seed, b * len(spans) + i, (h, e - s, lengths[b]), p)
    return keep


def formula(q, k, v, lengths, keep=None, p=0.0):  # noqa: ANN001, ANN201
    """dropout(softmax(q k^T / sqrt(d), padded keys masked)) v, written out."""
    n = k.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    pad = torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]
    probs = scores.masked_fill(pad[:, None, None, :], float("-inf")).softmax(-1)
    if keep is not None:
        probs = probs * keep / (1 - quantized_rate(p))
    return probs @ v


def qkv(b=2, h=2, n=37, d=8, dtype=torch.float64, seed=0):  # noqa: ANN001, ANN201
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("padded_queries", [False, True])  # self-attention: padded query rows skipped
@pytest.mark.parametrize("saved", [SAVED_SCORES, 0])  # probabilities kept for the backward, or recomputed
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_forward_and_gradients_match_formula(p, saved, padded_queries):
    q, k, v = qkv()
    # several blocks, one of them partial; padding in sample 1 that ends inside a block (its rows
    # 16:24) and covers whole blocks after it
    lengths, rows = [37, 20], 8
    out = blockwise_attention(
        q, k, v, lengths, dropout_p=p, seed=123, rows=rows, saved=saved, padded_queries=padded_queries
    )
    assert (out.grad_fn.blocks is not None) == (saved > 0)
    keep = full_keep(123, (2, 2, 37, 37), lengths, p, rows) if p else None
    ref = formula(q, k, v, lengths, keep, p)
    if padded_queries:  # the real rows as the formula's (the same masks), the padded ones zero
        ref = ref * (torch.arange(37)[None, :] < torch.tensor(lengths)[:, None])[:, None, :, None]
        assert out[1, :, 20:].abs().max() == 0
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)


def test_gradcheck_with_dropout():
    q, k, v = qkv(b=1, n=7, d=2)
    fn = lambda q, k, v: blockwise_attention(q, k, v, [6], dropout_p=0.25, seed=5, rows=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_dropout_rate_and_seeding():
    keep = block_keep(seed=1, index=0, shape=(4, 256, 1024), p=0.1)
    assert set(keep.unique().tolist()) == {0.0, 1.0}
    dropped = 1 - keep.mean().item()
    assert abs(dropped - quantized_rate(0.1)) < 4 * math.sqrt(0.1 * 0.9 / keep.numel())
    assert abs(quantized_rate(0.1) - 0.1) < 2**-16
    assert torch.equal(keep, block_keep(1, 0, (4, 256, 1024), 0.1))
    assert not torch.equal(keep, block_keep(1, 1, (4, 256, 1024), 0.1))
    assert not torch.equal(keep, block_keep(2, 0, (4, 256, 1024), 0.1))


def test_float32_matches_sdpa_without_dropout():
    q, k, v = (t.detach().float() for t in qkv(n=300, d=16))
    lengths = [300, 123]
    mask = ~padding_mask(torch.tensor(lengths), 300)[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(blockwise_attention(q, k, v, lengths), want, atol=1e-5, rtol=1e-5)


def test_nothing_quadratic_is_saved_for_backward_beyond_the_budget():
    b, h, n, d = 1, 2, 256, 8
    q, k, v = qkv(b, h, n, d)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kept = blockwise_attention(q, k, v, [n], dropout_p=0.1, rows=32)
    # Within its budget the kernel keeps every block's probabilities and mask (h x n x n scores) ...
    assert sum(probs.numel() for probs, _ in kept.grad_fn.blocks.values()) == b * h * n * n
    assert all(keep.dtype == torch.bool for _, keep in kept.grad_fn.blocks.values())
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = blockwise_attention(q, k, v, [n], dropout_p=0.1, rows=32, saved=b * h * n * n - 1)
    # ... beyond it, nothing quadratic: q, k, v and the output only.
    assert out.grad_fn.blocks is None
    assert len(sizes) == 4 and max(sizes) == b * h * n * d
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        formula(q, k, v, [n], torch.ones(b, h, n, n, dtype=torch.float64), 0.1)
    assert max(sizes) >= b * h * n * n  # the plain formula keeps N x N tensors: the hook sees them
    out.sum().backward()


def test_softmax_layer_training_path_is_the_formula_with_its_masks():
    """Integration: the layer routes CPU training with dropout (via ``attend``) through the kernel."""
    torch.manual_seed(0)
    layer = build_attention("softmax", 16, 2, dropout=0.2).double().train()
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    lengths = [40, 25]
    mask = padding_mask(torch.tensor(lengths), 40)
    torch.manual_seed(7)
    out = layer.heads_output(x, mask)
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2**62, (1,)).item())  # the kernel's first draw
    q, k, v = (layer.split_heads(p(x)) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    rows = max(1, SCORE_BUDGET // (2 * 40))  # attend's per-sample block size
    keep = full_keep(seed, (2, 2, 40, 40), lengths, 0.2, rows)
    want = formula(q, k, v, lengths, keep, 0.2).transpose(1, 2).reshape(2, 40, 16)
    # self-attention: the real rows are the formula's, the padded query rows are skipped (zero)
    torch.testing.assert_close(out[0], want[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out[1, :25], want[1, :25], atol=1e-12, rtol=1e-12)
    assert out[1, 25:].abs().max() == 0


def test_prefix_lengths():
    mask = padding_mask(torch.tensor([5, 2, 0]), 5)
    assert prefix_lengths(mask) == [5, 2, 0]
    holed = mask.clone()
    holed[0, 1] = True
    assert prefix_lengths(holed) is None


def test_non_suffix_mask_falls_back_to_checkpointed_chunks():
    q, k, v = qkv(b=1, h=2, n=6, d=3)
    holed = torch.tensor([[False, True, False, False, False, True]])

    def f(q, k, v):  # noqa: ANN001, ANN202
        torch.manual_seed(0)
        return attend(q, k, v, holed, dropout_p=0.3, budget=2 * 2 * 6)

    assert torch.autograd.gradcheck(f, (q, k, v))
    without = attend(q, k, v, holed)
    want = formula_masked(q, k, v, holed)
    torch.testing.assert_close(without, want)
    assert not torch.allclose(f(q, k, v), want)


def formula_masked(q, k, v, pad):  # noqa: ANN001, ANN201
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(pad[:, None, None, :], -math.inf)
    return scores.softmax(-1) @ v
