"""Conditioned initialization (the paper's scheme) and the helpers its variants share.

Per attention layer, in torch layout ``weight[out, in]`` with D = model width, H heads of d_h:
  * W_V = lambda * eye(H*d_h, D): ones on the main diagonal of the (possibly non-square) matrix.
    Its min(H*d_h, D) singular values all equal lambda, so kappa(W_V) = 1 for any H*d_h vs D;
    when H*d_h > D the rows past D are zero, when H*d_h < D the columns past H*d_h are unused.
  * W_Q, W_K: each head's (d_h x D) row block is an independent Haar semi-orthogonal draw
    (orthonormal rows; orthonormal columns in the degenerate case d_h > D), fresh for every head,
    for Q and K separately, and for every layer.
  * W_O, the biases and every non-attention parameter keep the default init (``reset_defaults``).
Independent per-head draws do not make the *stacked* W_Q well conditioned (see conditioned-joint).
"""

from __future__ import annotations

import torch
from torch import nn

from lra_cond.init.base import INITS
from lra_cond.init.default import reset_defaults
from lra_cond.init.matrices import haar_semi_orthogonal
from lra_cond.models.attention.base import Attention, attention_layers


def semi_orthogonal_(weight: torch.Tensor) -> torch.Tensor:
    """Fill ``weight`` with a Haar semi-orthogonal matrix (drawn in float64)."""
    with torch.no_grad():
        return weight.copy_(haar_semi_orthogonal(*weight.shape, device=weight.device))


def per_head_semi_orthogonal_(weight: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Each head's (head_dim x dim) row block gets its own independent semi-orthogonal draw."""
    for h in range(num_heads):
        semi_orthogonal_(weight[h * head_dim : (h + 1) * head_dim])


def rectangular_identity_(weight: torch.Tensor, scale: float = 1.0) -> None:
    """``scale * eye(out, in)``: ones on the main diagonal of the (possibly non-square) matrix."""
    with torch.no_grad():
        weight.copy_(scale * torch.eye(*weight.shape, dtype=weight.dtype, device=weight.device))


def condition_layer(layer: Attention, v_scale: float = 1.0, qk: bool = True, v: bool = True) -> None:
    """The conditioned recipe on one layer; ``qk``/``v`` switch its two halves (for the ablations)."""
    if qk:
        per_head_semi_orthogonal_(layer.q_proj.weight, layer.num_heads, layer.head_dim)
        per_head_semi_orthogonal_(layer.k_proj.weight, layer.num_heads, layer.head_dim)
    if v:
        rectangular_identity_(layer.v_proj.weight, v_scale)


@INITS.register("conditioned")
@torch.no_grad()
def conditioned_init(model: nn.Module, v_scale: float = 1.0) -> None:
    """W_V = v_scale * rectangular identity, W_Q/W_K per-head semi-orthogonal, rest default.

    ``v_scale`` is the paper's lambda (default 1); large values destabilise training (Remark A.1).
    """
    reset_defaults(model)
    for _, layer in attention_layers(model):
        condition_layer(layer, v_scale)
