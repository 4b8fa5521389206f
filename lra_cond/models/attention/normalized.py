"""Normalized (QK-norm) attention, after Henry et al. 2020, "Query-Key Normalization for
Transformers" (Findings of EMNLP 2020).

Per head h, queries and keys are L2-normalised along head_dim and the logits are the cosine
similarities times a learnable temperature g_h instead of 1/sqrt(d):

    out = softmax(g_h * q^ k^T) v,   q^ = q / ||q||,  k^ = k / ||k||,

with dropout on the probabilities as in softmax attention. Option ``normalize_v`` also replaces v by
v / ||v|| (off by default; not part of Henry et al.).

Differences from the paper: one temperature per head (the paper learns one scalar g per layer), and
its initial value. Henry et al. start g at log2(L^2 - L) for their translation lengths L; LRA lengths
range from 1k to 16k and the layer does not know them, so the default here is g_h = sqrt(head_dim).
Why: for q, k with unit-variance entries (LayerNorm'd inputs through default or semi-orthogonal
projections), ||q|| ||k|| ~ head_dim, so the standard logit q.k / sqrt(d) ~ sqrt(d) cos(q, k). Starting
at sqrt(head_dim) thus gives the same initial attention sharpness as softmax attention, which keeps the
families comparable at initialisation. ``temperature_init`` overrides it (e.g. Henry et al.'s value).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lra_cond.models.attention.base import Attention, Option, masked_softmax
from lra_cond.models.attention.sdpa import attend

NORM_EPS = 1e-6  # floor on ||x|| so an all-zero vector normalises to zero instead of NaN


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(NORM_EPS)


class NormalizedAttention(Attention, name="normalized"):
    """QK-norm attention; options ``temperature_init`` (default sqrt(head_dim)) and ``normalize_v``."""

    options = {
        "temperature_init": Option(None, float, positive=True, nullable=True),
        "normalize_v": Option(False, bool),
    }

    def build(self) -> None:
        if self.temperature_init is None:
            self.temperature_init = float(math.sqrt(self.head_dim))
        self.temperature = nn.Parameter(torch.full((self.num_heads,), self.temperature_init))

    def reset_parameters(self) -> None:
        """Called by the default init (the projections reset themselves as submodules)."""
        with torch.no_grad():
            self.temperature.fill_(self.temperature_init)

    def normalized(self, q, k, v):  # noqa: ANN001, ANN201
        """q^ scaled by its head's temperature, k^, and v (normalised if asked)."""
        q = l2_normalize(q) * self.temperature[None, :, None, None]
        return q, l2_normalize(k), l2_normalize(v) if self.normalize_v else v

    def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        q, k, v = self.normalized(q, k, v)
        return attend(q, k, v, key_padding_mask, dropout_p=self.attn_dropout, scale=1.0, self_attention=True)

    def kernel_explicit(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        q, k, v = self.normalized(q, k, v)
        probs = F.dropout(
            masked_softmax(q @ k.transpose(-1, -2), key_padding_mask), self.attn_dropout, self.training
        )
        return probs @ v
