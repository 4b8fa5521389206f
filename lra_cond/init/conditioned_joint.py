"""``conditioned-joint``: conditioned, but W_Q and W_K are each one orthogonal draw split across heads.

Why: independent per-head draws make every head's block orthonormal, yet the stacked (H*d_h x D)
W_Q can be nearly singular (two random d_h-dim row spaces almost share a direction). Splitting
one draw keeps the stacked condition number at 1 as well. Construction, with n = H*d_h rows:
  * n <= D: one Haar (n x D) matrix with orthonormal rows, heads take consecutive row blocks.
    Stacked kappa = 1 and every head has orthonormal rows, exactly as in ``conditioned``.
  * n > D: a stacked matrix cannot have orthonormal rows. We make W^T W = (n/D) I instead
    (orthonormal columns scaled by sqrt(n/D), so the mean squared row norm is 1 as above):
    stacked kappa = 1 still. If D divides n and d_h divides D, the stack is n/D independent
    orthogonal D x D matrices, so every head keeps orthonormal rows too; otherwise it is one
    Haar orthonormal-column matrix and the per-head blocks are only approximately orthonormal.
W_V = v_scale * rectangular identity; W_O and everything else default, as in ``conditioned``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lra_cond.init.base import INITS
from lra_cond.init.conditioned import rectangular_identity_
from lra_cond.init.default import reset_defaults
from lra_cond.init.matrices import haar_semi_orthogonal
from lra_cond.models.attention.base import attention_layers


def joint_semi_orthogonal(
    rows: int, dim: int, head_dim: int, device: torch.device | None = None
) -> torch.Tensor:
    """The stacked float64 (rows x dim) matrix described in the module docstring."""
    if rows <= dim:
        return haar_semi_orthogonal(rows, dim, device)
    if rows % dim == 0 and dim % head_dim == 0:
        return torch.cat([haar_semi_orthogonal(dim, dim, device) for _ in range(rows // dim)])
    return math.sqrt(rows / dim) * haar_semi_orthogonal(rows, dim, device)


@INITS.register("conditioned-joint")
@torch.no_grad()
def conditioned_joint_init(model: nn.Module, v_scale: float = 1.0) -> None:
    """Stacked W_Q and W_K each one orthogonal draw (kappa = 1), W_V = v_scale * identity."""
    reset_defaults(model)
    for _, layer in attention_layers(model):
        for proj in (layer.q_proj, layer.k_proj):
            w = proj.weight
            w.copy_(joint_semi_orthogonal(w.shape[0], w.shape[1], layer.head_dim, w.device))
        rectangular_identity_(layer.v_proj.weight, v_scale)
