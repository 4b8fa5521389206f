"""The encoder's Dropout against torch's nn.Dropout (the reference it must reproduce)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lra_cond.models.dropout import Dropout


def _bernoulli_draws_float64_uniforms() -> bool:
    """Whether torch's CPU bernoulli_ here takes one float64 uniform per element (not MKL's stream)."""
    torch.manual_seed(0)
    mask = torch.empty(1000).bernoulli_(0.5)
    torch.manual_seed(0)
    return torch.equal(mask, (torch.rand(1000, dtype=torch.float64) < 0.5).float())


def run(layer: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    x = x.detach().requires_grad_()
    out = layer(x)
    (grad,) = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), x)
    return out, grad, torch.rand(4)  # the last: where the generator was left


@pytest.mark.skipif(not _bernoulli_draws_float64_uniforms(), reason="bernoulli_ uses MKL's generator here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_output_gradient_and_generator_state_equal_nn_dropout(dtype):
    x = torch.randn(3, 50, 8, dtype=dtype, generator=torch.Generator().manual_seed(1))
    ours = run(Dropout(0.1).train(), x, seed=4)
    ref = run(nn.Dropout(0.1).train(), x, seed=4)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_keeps_about_1_minus_p_and_scales_kept_values_as_nn_dropout():
    p, n = 0.3, 200_000
    x = torch.rand(n, generator=torch.Generator().manual_seed(2)) + 1.0  # nonzero everywhere
    out, grad, _ = run(Dropout(p).train(), x, seed=5)
    kept = out != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * ((p * (1 - p) / n) ** 0.5)
    scale = torch.ones(1).div_(1 - p)  # nn.Dropout's float32 scale
    torch.testing.assert_close(out[kept], x[kept] * scale, atol=0, rtol=0)
    torch.testing.assert_close(grad, kept * scale * torch.linspace(-1, 1, n), atol=0, rtol=0)


@pytest.mark.parametrize(("p", "train"), [(0.1, False), (0.0, True), (1.0, True)])
def test_eval_and_edge_rates_equal_nn_dropout(p, train):
    x = torch.randn(4, 6)
    torch.testing.assert_close(Dropout(p).train(train)(x), nn.Dropout(p).train(train)(x), atol=0, rtol=0)
