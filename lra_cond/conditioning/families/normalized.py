"""Normalized (QK-norm) attention's head Jacobian: its closed form and its symmetries."""

from __future__ import annotations

import torch

from lra_cond.conditioning.families import base as jac
from lra_cond.linalg import RANK_RTOL, null_vectors
from lra_cond.models.attention.normalized import l2_normalize


class NormalizedJacobian(jac.FamilyJacobian, family="normalized"):
    def parts(self, inp: jac.HeadInputs) -> dict[str, jac.Part]:
        """With q^ = g q / ||q||, k^ = k / ||k||, P = softmax(q^ k^T), a_i = sum_j P_ij v~_j (v~ = v, or
        v / ||v|| with normalize_v), and N(u) = (I - u^ u^^T) / ||u|| the normalisation's Jacobian:
            dA_i/dq_i = (sum_j P_ij v~_j k^_j^T - a_i kbar^_i^T) g N(q_i)          (query-local)
            dA_i/dk_j = P_ij (v~_j - a_i) q^_i^T N(k_j)
                      = P_ij / ||k_j|| (v~_j - a_i) (q^_i - k^_j (k^_j . q^_i))^T
            dA_i/dv_j = P_ij N(v_j) (normalize_v) or P_ij I.
        The key block is a softmax-like outer product plus a correction of rank L (the sequence's
        length), given as factors: the probe forms its Gram from them."""
        g = float(self.layer.temperature[inp.h])
        parts: dict[str, list[torch.Tensor]] = {b: [] for b in inp.blocks}
        d = inp.d
        eye = torch.eye(d, dtype=inp.w["q"].dtype, device=inp.w["q"].device)
        for x in inp.xs:
            q, k, v = inp.projected(x)
            nq, nk = q.norm(dim=-1, keepdim=True), k.norm(dim=-1, keepdim=True)
            q_hat, k_hat = g * q / nq, k / nk
            vt = l2_normalize(v) if self.layer.normalize_v else v
            p = torch.softmax(q_hat @ k_hat.T, dim=-1)
            a = p @ vt
            if "q" in parts:
                u = q / nq
                norm_q = g * (eye - u[:, :, None] * u[:, None, :]) / nq[:, :, None]
                m = jac.softmax_query_factor(p, k_hat, vt, 1.0)
                parts["q"].append(jac.Factored("query_local", m @ norm_q, x))
            if "k" in parts:
                p1 = p / nk.T  # P_ij / ||k_j||
                r1 = jac.pair_means(p1, vt, x) - a[:, :, None] * (p1 @ x)[:, None, :]
                c = p1 * (q_hat @ k_hat.T)  # P_ij (k^_j . q^_i) / ||k_j||
                # the second term, sum_j c_ij (v~_j - a_i)[a] k^_j[b] x_j[c], as E Z (rank L)
                e = -c[:, None, :] * (vt.T[None, :, :] - a[:, :, None])  # [i, a, j]
                z = k_hat[:, :, None] * x[:, None, :]  # [j, b, c]
                parts["k"].append(jac.Factored("outer", q_hat, r1, (e, z)))
            if "v" in parts:
                if self.layer.normalize_v:
                    nv = v.norm(dim=-1, keepdim=True)
                    u = v / nv
                    direct = jac.value_block((p / nv.T) @ x, d).dense()
                    uux = jac.pair_means(p / nv.T, u, (u[:, :, None] * x[:, None, :]).reshape(len(x), -1))
                    parts["v"].append(direct - uux.reshape(len(x), d, d, -1))
                else:
                    parts["v"].append(jac.value_block(p @ x, d))
        return {b: jac.stack_sequences(ps) for b, ps in parts.items()}

    def symmetries(self, inp: jac.HeadInputs) -> dict[str, dict[str, torch.Tensor]]:
        """Normalising q and k keeps only the orthogonal part of the gauge, and makes their scales
        (and v's, with normalize_v) irrelevant.

        And a symmetric part: (dW_Q, dW_K) = (E W_Q, -E W_K) with E symmetric keeps every q . k, and
        changes q^_i . k^_j only through the norms, by -(q^_i^T E q^_i - k^_j^T E k^_j) q^_i . k^_j;
        so it is null when q^^T E q^ and k^^T E k^ take one value c_b over the tokens of each
        sequence b: d(d+1)/2 + B unknowns (E, c) for 2T conditions, hence d(d+1)/2 - 2T + B - 1
        directions beyond the scales when that is positive (measured at d = 32 and 256 tokens: 16)."""
        groups: dict[str, dict[str, torch.Tensor]] = {}
        if "q" in inp.blocks and "k" in inp.blocks:
            groups["orthogonal_gauge"] = jac.orthogonal_gauge(inp.w["q"], inp.w["k"])
            symmetric = self._symmetric_gauge(inp)
            if symmetric is not None:
                groups["symmetric_gauge"] = symmetric
        for b in ("q", "k", "v") if self.layer.normalize_v else ("q", "k"):
            if b in inp.blocks:
                groups[f"{b}_scale"] = {b: jac.scale(inp.w[b])}
        return groups

    @staticmethod
    def _symmetric_gauge(inp: jac.HeadInputs) -> dict[str, torch.Tensor] | None:
        """The symmetric part of the gauge (``symmetries``). The scores change by
        ds_ij = -s_ij (q^_i^T E q^_i - k^_j^T E k^_j), and softmax ignores a change that is one value
        per query: in a sequence of three or more tokens that generically takes the one value c_b
        above; in one of one or two tokens the condition itself is weaker (one key: none; two:
        s_i1 (a_i - b_1) = s_i2 (a_i - b_2) at each query), one direction more for each."""
        d = inp.d
        device = inp.w["q"].device
        rows, cols = torch.triu_indices(d, d, device=device)
        weight = torch.where(rows == cols, 1.0, 2.0).to(inp.w["q"].dtype)
        blocks, owners, n_long = [], [], 0
        for x in inp.xs:
            q, k, _ = inp.projected(x)
            q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
            forms = [u[:, rows] * u[:, cols] * weight for u in (q, k)]  # u^T E u over the upper triangle
            if len(x) > 2:
                blocks += forms
                owners.append(torch.full((2 * len(x),), n_long, device=device))
                n_long += 1
            elif len(x) == 2:  # s_i1 (a_i - b_1) - s_i2 (a_i - b_2) = 0, i = 1, 2
                s = q @ k.T
                blocks.append(s[:, :1] * (forms[0] - forms[1][:1]) - s[:, 1:] * (forms[0] - forms[1][1:]))
                owners.append(torch.full((2,), -1, device=device))
        if not blocks:
            return None
        owner = torch.cat(owners)
        seq = (owner[:, None] == torch.arange(n_long, device=device)[None, :]).to(weight.dtype)
        system = torch.cat([torch.cat(blocks), -seq], 1)  # [u^T E u - c_b] = 0 (and the short rows)
        null = null_vectors(system, RANK_RTOL)[: rows.numel()]
        if not null.shape[1]:
            return None
        e = torch.zeros(null.shape[1], d, d, dtype=null.dtype, device=null.device)
        e[:, rows, cols] = null.T
        e = e + e.transpose(1, 2) - torch.diag_embed(e.diagonal(dim1=1, dim2=2))
        return {"q": e @ inp.w["q"], "k": -(e @ inp.w["k"])}
