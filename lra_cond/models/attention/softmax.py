"""Softmax (vanilla) attention."""

from __future__ import annotations

import math

import torch.nn.functional as F

from lra_cond.models.attention.base import Attention, masked_softmax
from lra_cond.models.attention.sdpa import attend


class SoftmaxAttention(Attention, name="softmax"):
    """softmax(Q K^T / sqrt(d)) V per head, dropout on the attention probabilities.

    Training path: ``attend`` (fused ``F.scaled_dot_product_attention``; on CPU with dropout, the
    blockwise kernel of ``blockwise.py``), so training memory never holds the N x N matrix of a long
    sequence (see ``sdpa.py``). Explicit path: the formula, written out.
    """

    def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        return attend(q, k, v, key_padding_mask, dropout_p=self.attn_dropout, self_attention=True)

    def kernel_explicit(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        probs = masked_softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), key_padding_mask)
        probs = F.dropout(probs, self.attn_dropout, training=self.training)
        return probs @ v
