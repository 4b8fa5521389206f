"""Softmax (vanilla) attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lra_cond.models.attention.base import Attention
from lra_cond.models.attention.blockwise import blockwise_attention
from lra_cond.models.attention.registry import ATTENTIONS


def prefix_lengths(key_padding_mask: torch.Tensor, n: int) -> list[int] | None:
    """Per-sample real lengths if every row of the mask pads a suffix (as the encoder's do), else None."""
    lengths = (~key_padding_mask).sum(1)
    if not torch.equal(key_padding_mask, torch.arange(n, device=lengths.device)[None, :] >= lengths[:, None]):
        return None
    return lengths.tolist()


@ATTENTIONS.register("softmax")
class SoftmaxAttention(Attention):
    """softmax(Q K^T / sqrt(d)) V per head.

    Training path: ``F.scaled_dot_product_attention`` (fused kernels; the N x N matrix is not
    materialised when a fused kernel is chosen), except on CPU with attention dropout, where torch's
    flash kernel does not apply and SDPA would fall back to its N x N math path: there the blockwise
    kernel (``blockwise.py``) computes the same formula. Explicit path: the formula, written out.
    """

    def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        p = self.attn_dropout
        if p > 0 and q.device.type == "cpu":
            if key_padding_mask is None:
                return blockwise_attention(q, k, v, None, dropout_p=p)
            lengths = prefix_lengths(key_padding_mask, k.shape[-2])
            if lengths is not None:
                return blockwise_attention(q, k, v, lengths, dropout_p=p)
        mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)

    def kernel_explicit(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, self.attn_dropout, training=self.training)
        return probs @ v
