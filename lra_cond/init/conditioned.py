"""Conditioned initialization (ICLR 2026): W_V = rectangular identity, W_Q/W_K semi-orthogonal
per head, W_O and everything else at default."""

from __future__ import annotations

import torch
from torch import nn

from lra_cond.init.default import reset_defaults
from lra_cond.init.registry import INITS
from lra_cond.models.attention.base import Attention, attention_layers


def semi_orthogonal_(weight: torch.Tensor) -> torch.Tensor:
    """Fill a (rows <= cols) block with orthonormal rows (a Haar-random semi-orthogonal matrix)."""
    return nn.init.orthogonal_(weight)


def per_head_semi_orthogonal_(weight: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Each head's (head_dim x dim) row block gets its own independent semi-orthogonal draw."""
    for h in range(num_heads):
        # Drawn in float64 so rows stay orthonormal to ~1e-7 after the cast to the weight dtype.
        block = torch.empty(head_dim, weight.shape[1], dtype=torch.float64, device=weight.device)
        weight[h * head_dim : (h + 1) * head_dim] = semi_orthogonal_(block).to(weight.dtype)


def rectangular_identity_(weight: torch.Tensor, scale: float = 1.0) -> None:
    """``eye(out, in)``: ones on the main diagonal of the (possibly non-square) matrix."""
    weight.copy_(scale * torch.eye(*weight.shape, dtype=weight.dtype, device=weight.device))


def condition_layer(layer: Attention, v_scale: float = 1.0) -> None:
    per_head_semi_orthogonal_(layer.q_proj.weight, layer.num_heads, layer.head_dim)
    per_head_semi_orthogonal_(layer.k_proj.weight, layer.num_heads, layer.head_dim)
    rectangular_identity_(layer.v_proj.weight, v_scale)


@INITS.register("conditioned")
@torch.no_grad()
def conditioned_init(model: nn.Module, v_scale: float = 1.0) -> None:
    reset_defaults(model)
    layers = [m for _, m in attention_layers(model)] or ([model] if isinstance(model, Attention) else [])
    for layer in layers:
        condition_layer(layer, v_scale)
