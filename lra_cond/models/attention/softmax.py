"""Softmax (vanilla) attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lra_cond.linalg import RANK_RTOL
from lra_cond.models.attention import jacobian as jac
from lra_cond.models.attention.base import Attention, masked_softmax
from lra_cond.models.attention.sdpa import attend


class SoftmaxAttention(Attention, name="softmax"):
    """softmax(Q K^T / sqrt(d)) V per head, dropout on the attention probabilities.

    Training path: ``attend`` (fused ``F.scaled_dot_product_attention``; on CPU with dropout, the
    blockwise kernel of ``blockwise.py``), so training memory never holds the N x N matrix of a long
    sequence (see ``sdpa.py``). Explicit path: the formula, written out.
    """

    def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        return attend(q, k, v, key_padding_mask, dropout_p=self.attn_dropout)

    def kernel_explicit(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        probs = masked_softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), key_padding_mask)
        probs = F.dropout(probs, self.attn_dropout, training=self.training)
        return probs @ v

    def head_jacobian_parts(self, inp: jac.HeadInputs) -> dict[str, jac.Part]:
        """With P = softmax(s q k^T), a_i = sum_j P_ij v_j, s = 1/sqrt(d) (from dP_i = (diag P_i -
        P_i P_i^T) ds_i):
            dA_i/dW_Q[b, c] = G_i[:, b] x_i[c],  G_i = s (sum_j P_ij v_j k_j^T - a_i kbar_i^T)
            dA_i/dW_K[b, c] = q_i[b] R_i[:, c],  R_i = s (sum_j P_ij v_j x_j^T - a_i xbar_i^T)
            dA_i/dW_V[b, c] = e_b xbar_i[c]
        A few N^2 d D products instead of 3 d D forward passes."""
        s = jac.attention_scale(inp.d)
        parts: dict[str, list[torch.Tensor]] = {b: [] for b in inp.blocks}
        for x in inp.xs:
            q, k, v = inp.projected(x)
            p = torch.softmax(q @ k.T * s, dim=-1)
            if "q" in parts:
                parts["q"].append(jac.Factored("query_local", jac.softmax_query_factor(p, k, v, s), x))
            if "k" in parts:
                parts["k"].append(jac.Factored("outer", q, jac.softmax_key_factor(p, v, x, s)))
            if "v" in parts:
                parts["v"].append(jac.value_block(p @ x, inp.d))
        return {b: jac.stack_sequences(ps) for b, ps in parts.items()}

    def symmetries(self, inp: jac.HeadInputs) -> dict[str, dict[str, torch.Tensor]]:
        groups: dict[str, dict[str, torch.Tensor]] = {}
        if "q" in inp.blocks and "k" in inp.blocks:
            groups["gauge"] = jac.gauge(inp.w["q"], inp.w["k"])
        if "k" in inp.blocks:
            groups["key_shift"] = {"k": jac.key_shift(inp.xs, inp.d, RANK_RTOL)}
        return groups
