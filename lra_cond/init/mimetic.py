r"""``mimetic`` (Trockman & Kolter 2023, "Mimetic initialization of self-attention layers").

Trained attention layers show W_Q W_K^T close to a positive identity plus noise (heads attend to
nearby/similar tokens) and W_V W_O close to a *negative* identity plus noise. Mimetic init draws
those targets and factors them.

Torch layout: ``q = x W_q^T`` with ``W_q`` of shape (H*d_h, D) and head h owning rows
h*d_h:(h+1)*d_h (call that block ``W_q^h``, shape d_h x D). Then, per head,

    logits_h = q_h k_h^T = x (W_q^{hT} W_k^h) x^T,

so the D x D matrix to shape is M_h = W_q^{hT} W_k^h. For each head (independently, per layer):

    T_h = alpha1 Z1_h + beta1 I,      Z1_h entries i.i.d. N(0, 1/D),
    T_h = U S V^T (SVD),  r = d_h,    W_q^{hT} = U_r S_r^{1/2},  W_k^{hT} = V_r S_r^{1/2},

so M_h = U_r S_r V_r^T is the best rank-d_h approximation of T_h (Eckart-Young).

Value/output: with attention close to the identity, the layer maps x to
concat_h(x W_v^{hT}) W_o^T = x W_v^T W_o^T, a sum over heads; the paper states its target for the
full W_V W_proj (all heads together), so we shape that D x D composite C = W_v^T W_o^T:

    T = alpha2 Z2 + sign * beta2 I,   Z2 entries i.i.d. N(0, 1/D),   sign = -1 by default,
    W_v^T = U_r S_r^{1/2},  W_o^T = S_r^{1/2} V_r^T,  r = min(D, H*d_h).

(With H*d_h = D this is exact: C = T.) Shaping each head's W_v^{hT} W_o^{hT} to T instead would
sum to H * T over heads. If a factor's inner size exceeds D (d_h > D, or H*d_h > D) the rank-D
factors are spread over the inner coordinates with a random isometry (``low_rank_factors``).
The 1/sqrt(d_h) logit scaling of the attention kernels is applied on top, as in the paper.
Biases, all non-attention parameters and anything else keep the default init.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lra_cond.errors import UserError
from lra_cond.init.base import INITS
from lra_cond.init.default import reset_defaults
from lra_cond.init.matrices import low_rank_factors
from lra_cond.models.attention.base import Attention, attention_layers


@dataclass
class MimeticTargets:
    """The float64 targets one layer was factored from (returned so tests can check the fit)."""

    qk: list[torch.Tensor] = field(default_factory=list)  # per head: alpha1 Z1_h + beta1 I
    vo: torch.Tensor | None = None  # alpha2 Z2 + sign * beta2 I


def noisy_identity(dim: int, alpha: float, beta: float, device: torch.device | None = None) -> torch.Tensor:
    """alpha * Z + beta * I with Z entries i.i.d. N(0, 1/dim), in float64."""
    z = torch.randn(dim, dim, dtype=torch.float64, device=device) / dim**0.5
    return alpha * z + beta * torch.eye(dim, dtype=torch.float64, device=device)


def mimetic_layer_(
    layer: Attention, alpha1: float, beta1: float, alpha2: float, beta2: float, vo_sign: int
) -> MimeticTargets:
    """Set one layer's W_q, W_k, W_v, W_o in place; return the targets it drew."""
    dim, heads, d_h = layer.q_proj.in_features, layer.num_heads, layer.head_dim
    dev = layer.q_proj.weight.device
    targets = MimeticTargets()
    for h in range(heads):
        rows = slice(h * d_h, (h + 1) * d_h)
        target = noisy_identity(dim, alpha1, beta1, dev)
        left, right = low_rank_factors(target, d_h)  # left @ right = W_q^{hT} W_k^h
        layer.q_proj.weight[rows] = left.T.to(layer.q_proj.weight.dtype)
        layer.k_proj.weight[rows] = right.to(layer.k_proj.weight.dtype)
        targets.qk.append(target)
    target = noisy_identity(dim, alpha2, vo_sign * beta2, dev)
    left, right = low_rank_factors(target, heads * d_h)  # left @ right = W_v^T W_o^T
    layer.v_proj.weight.copy_(left.T)
    layer.out_proj.weight.copy_(right.T)
    targets.vo = target
    return targets


@INITS.register("mimetic")
@torch.no_grad()
def mimetic_init(
    model: nn.Module,
    alpha1: float = 0.7,
    beta1: float = 0.7,
    alpha2: float = 0.4,
    beta2: float = 0.4,
    vo_sign: int = -1,
) -> list[MimeticTargets]:
    """Per head W_q^{hT} W_k^h ~ alpha1 Z1 + beta1 I; W_v^T W_o^T ~ alpha2 Z2 + vo_sign * beta2 I.

    Returns the drawn targets, one ``MimeticTargets`` per attention layer (in module order).
    """
    if vo_sign not in (-1, 1):
        raise UserError(f"init 'mimetic': vo_sign must be -1 or 1, got {vo_sign!r}")
    reset_defaults(model)
    return [
        mimetic_layer_(layer, alpha1, beta1, alpha2, beta2, int(vo_sign))
        for _, layer in attention_layers(model)
    ]
