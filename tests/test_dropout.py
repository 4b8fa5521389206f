"""The encoder's Dropout: its keep-rate and scaling against the rate it states, its masks against
a direct reading of the random words it draws, and eval mode against torch's nn.Dropout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lra_cond.models.dropout import Dropout, keep_mask, quantized_rate


def run(layer: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    x = x.detach().requires_grad_()
    out = layer(x)
    (grad,) = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), x)
    return out, grad, torch.rand(4)  # the last: where the generator was left


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_keeps_1_minus_the_quantized_rate_and_scales_kept_values_unbiased(p):
    n = 400_000
    x = torch.rand(n, generator=torch.Generator().manual_seed(2)) + 1.0  # nonzero everywhere
    out, grad, _ = run(Dropout(p).train(), x, seed=5)
    kept = out != 0
    rate = quantized_rate(p)
    assert abs(rate - p) <= 2**-17
    assert abs(kept.float().mean().item() - (1 - rate)) < 5 * ((rate * (1 - rate) / n) ** 0.5)
    scale = 1.0 / (1.0 - rate)
    torch.testing.assert_close(out[kept], x[kept] * scale, atol=0, rtol=1e-6)
    torch.testing.assert_close(grad, kept * scale * torch.linspace(-1, 1, n), atol=0, rtol=1e-6)
    assert abs(out.mean().item() / x.mean().item() - 1) < 5 * (rate / (1 - rate) / n) ** 0.5  # unbiased


def test_mask_reads_four_16_bit_draws_per_random_word():
    # A direct reading: the generator's int64 words, split into little-endian 16-bit halves, each
    # compared with round(p * 2**16) after shifting to 0..65535.
    gen = torch.Generator().manual_seed(7)
    mask = keep_mask((3, 10), 0.25, torch.float64, gen)
    words = torch.empty(3, 3, dtype=torch.int64).random_(
        -(2**63), None, generator=torch.Generator().manual_seed(7)
    )
    draws = [[(int(w) >> (16 * j)) & 0xFFFF for w in row for j in range(4)][:10] for row in words.tolist()]
    expected = torch.tensor(
        [[float(((d + 32768) & 0xFFFF) >= 16384) for d in row] for row in draws], dtype=torch.float64
    )
    assert torch.equal(mask, expected)


def test_same_seed_same_mask_and_the_default_generator_moves_on():
    x = torch.randn(4, 50, 8)
    a, b = run(Dropout(0.1).train(), x, seed=3), run(Dropout(0.1).train(), x, seed=3)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    c = run(Dropout(0.1).train(), x, seed=4)
    assert not torch.equal(a[0], c[0])
    torch.manual_seed(3)
    assert not torch.equal(a[2], torch.rand(4))  # the draws advanced the generator


@pytest.mark.parametrize(("p", "train"), [(0.1, False), (0.0, True), (1.0, True)])
def test_eval_and_edge_rates_equal_nn_dropout(p, train):
    x = torch.randn(4, 6)
    torch.testing.assert_close(Dropout(p).train(train)(x), nn.Dropout(p).train(train)(x), atol=0, rtol=0)
