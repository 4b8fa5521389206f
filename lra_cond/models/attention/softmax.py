"""Softmax (vanilla) attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lra_cond.models.attention.base import Attention
from lra_cond.models.attention.registry import ATTENTIONS


@ATTENTIONS.register("softmax")
class SoftmaxAttention(Attention):
    """softmax(Q K^T / sqrt(d)) V per head.

    Training path: ``F.scaled_dot_product_attention`` (fused kernels; the N x N matrix is not
    materialised when a fused kernel is chosen). Explicit path: the formula, written out.
    """

    def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.attn_dropout)

    def kernel_explicit(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, self.attn_dropout, training=self.training)
        return probs @ v
