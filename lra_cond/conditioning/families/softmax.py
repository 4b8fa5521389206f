"""Softmax attention's head Jacobian: its closed form and its symmetries."""

from __future__ import annotations

import torch

from lra_cond.conditioning.families import base as jac
from lra_cond.linalg import RANK_RTOL


class SoftmaxJacobian(jac.FamilyJacobian, family="softmax"):
    def parts(self, inp: jac.HeadInputs) -> dict[str, jac.Part]:
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
