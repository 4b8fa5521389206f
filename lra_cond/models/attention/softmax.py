"""Softmax (vanilla) attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lra_cond.models.attention.base import Attention
from lra_cond.models.attention.registry import ATTENTIONS
from lra_cond.models.attention.sdpa import attend


@ATTENTIONS.register("softmax")
class SoftmaxAttention(Attention):
    """softmax(Q K^T / sqrt(d)) V per head, dropout on the attention probabilities.

    Training path: ``attend`` (fused ``F.scaled_dot_product_attention``; on CPU with dropout, the
    blockwise kernel of ``blockwise.py``), so training memory never holds the N x N matrix of a long
    sequence (see ``sdpa.py``). Explicit path: the formula, written out.
    """

    def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        return attend(q, k, v, key_padding_mask, dropout_p=self.attn_dropout)

    def kernel_explicit(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, self.attn_dropout, training=self.training)
        return probs @ v
