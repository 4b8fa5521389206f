"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive
Transformers with Linear Attention"), non-causal.

With the feature map phi(x) = elu(x) + 1 (positive), per head and query i

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps),

the sums running over real keys only (padded keys get phi = 0, so they leave both numerator and
denominator). The denominator is part of the method: the public LRA baseline that drops it is a known
deviation and is not reproduced. No 1/sqrt(d) scaling and no attention dropout, as in the paper.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from einops import rearrange

from lra_cond.models.attention.base import Attention, Option

T = TypeVar("T")


def feature_map(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


def feature_map_derivative(x: torch.Tensor) -> torch.Tensor:
    """elu'(x): 1 where x > 0, exp(x) (= phi(x)) elsewhere."""
    return torch.where(x > 0, torch.ones_like(x), torch.exp(x))


class LinearAttention(Attention, name="linear"):
    """elu+1 linear attention; option ``eps`` (1e-6) keeps the denominator away from zero.

    Training path: associate right, (phi(K)^T V) first, O(N d^2) time and O(d^2) state per head.
    Explicit path: the N x N similarity matrix phi(Q) phi(K)^T, normalised by its row sums.
    """

    options = {"eps": Option(1e-6, float, positive=True)}

    def features(self, q, k, key_padding_mask):  # noqa: ANN001, ANN201
        phi_q, phi_k = feature_map(q), feature_map(k)
        if key_padding_mask is not None:
            phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        return phi_q, phi_k

    def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        # Heads stay interleaved as the projections wrote them, (batch, seq, heads, d): bmm reads each
        # head in place through unbind views (whose backward is one stack), saving the head-major
        # copies an einsum makes and the copy back in heads_output. The denominator rides along as
        # an extra column of the (d, d + 1) state.
        phi_q, phi_k = self.features(q, k, key_padding_mask)
        phi_q, phi_k, v = (rearrange(t, "b h n d -> b n h d") for t in (phi_q, phi_k, v))
        outs = []
        for q_h, k_h, v_h, sum_h in zip(
            phi_q.unbind(2), phi_k.unbind(2), v.unbind(2), phi_k.sum(1).unbind(1)
        ):
            state = torch.cat([k_h.transpose(1, 2) @ v_h, sum_h[..., None]], dim=-1)
            out = q_h @ state  # (batch, seq, d + 1): numerator | denominator
            outs.append(out[..., :-1] / (out[..., -1:] + self.eps))
        return rearrange(torch.stack(outs, dim=2), "b n h d -> b h n d")

    def kernel_explicit(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        phi_q, phi_k = self.features(q, k, key_padding_mask)
        sim = phi_q @ phi_k.transpose(-1, -2)
        return (sim @ v) / (sim.sum(-1, keepdim=True) + self.eps)

    # ---- condition-number probe: the eps -> 0 limit
