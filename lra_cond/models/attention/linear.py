"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive
Transformers with Linear Attention"), non-causal.

With the feature map phi(x) = elu(x) + 1 (positive), per head and query i

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps),

the sums running over real keys only (padded keys get phi = 0, so they leave both numerator and
denominator). The denominator is part of the method: the public LRA baseline that drops it is a known
deviation and is not reproduced. No 1/sqrt(d) scaling and no attention dropout, as in the paper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from lra_cond.linalg import RANK_RTOL
from lra_cond.models.attention import jacobian as jac
from lra_cond.models.attention.base import Attention, Option


def feature_map(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


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

    def jacobian_copy(self) -> LinearAttention:
        """Measured at eps = 0: scaling a sequence's (S, z) together is then an exact symmetry (with
        eps > 0 it is broken only by eps, and those directions' singular values, ~eps * sigma_max,
        would set kappa). phi > 0, so the denominator stays positive."""
        layer = super().jacobian_copy()
        layer.eps = 0.0
        return layer

    def head_jacobian_parts(self, inp: jac.HeadInputs) -> dict[str, jac.Part]:
        """With phi = elu + 1, S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j), den_i = phi(q_i) . z and
        A_i = S^T phi(q_i) / den_i (eps = 0):
            dA_i/dq_i = (S^T - A_i z^T) diag(phi'(q_i)) / den_i                    (query-local)
            dA_i/dW_K[b, c] = phi(q_i)[b] / den_i (U[:, b, c] - A_i Z[b, c]),
                U = sum_j v_j (x) phi'(k_j) (x) x_j,  Z = sum_j phi'(k_j) (x) x_j  (per sequence)
            dA_i/dW_V[b, c] = e_b (P X)_i[c],  P_ij = phi(q_i) . phi(k_j) / den_i."""
        parts: dict[str, list[torch.Tensor]] = {b: [] for b in inp.blocks}
        for x in inp.xs:
            q, k, v = inp.projected(x)
            phi_q, phi_k = feature_map(q), feature_map(k)
            z, s = phi_k.sum(0), phi_k.T @ v  # (d,), (d, d)
            den = phi_q @ z  # (L,)
            a = (phi_q @ s) / den[:, None]
            if "q" in parts:
                dphi_q = torch.where(q > 0, torch.ones_like(q), torch.exp(q))  # elu'(q)
                g = (s.T[None] - a[:, :, None] * z[None, None, :]) * (dphi_q / den[:, None])[:, None, :]
                parts["q"].append(jac.Factored("query_local", g, x))
            if "k" in parts:
                dphi_k = torch.where(k > 0, torch.ones_like(k), torch.exp(k))
                u = torch.einsum("ja,jb,jc->abc", v, dphi_k, x)
                zz = dphi_k.T @ x  # (d, D')
                coef = phi_q / den[:, None]  # (L, d): phi(q_i)[b] / den_i
                inner = u[None] - a[:, :, None, None] * zz[None, None]  # (L, a, b, c)
                parts["k"].append(coef[:, None, :, None] * inner)
            if "v" in parts:
                p = (phi_q @ phi_k.T) / den[:, None]
                parts["v"].append(jac.value_block(p @ x, inp.d))
        return {b: jac.stack_sequences(ps) for b, ps in parts.items()}

    def _statistics_jacobian(
        self, inp: jac.HeadInputs, blocks: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-sequence statistics (S_b, z_b) stacked, their Jacobian G with respect to the K/V
        blocks in ``blocks`` ((B (d^2 + d),), (B (d^2 + d), len(blocks) d D')), and the eigenpairs
        the rank-r part of its SVD. Cached on this (probe) copy: support and symmetries share it."""
        key = (inp.h, tuple(blocks))
        cache = self.__dict__.setdefault("_statistics_cache", {})
        if key not in cache:
            stats, g = self._statistics(inp, blocks)
            # An SVD, not eigh(G G^T): the rank must be decided on singular values accurate to
            # eps * sigma_max (through the Gram, null and genuine values below ~1e-6 blur).
            u, sv, vh = torch.linalg.svd(g, full_matrices=False)
            rank = int((sv > RANK_RTOL * sv[0]).sum())
            cache[key] = (stats, g, u[:, :rank], sv[:rank], vh[:rank])
        return cache[key]

    def _statistics(self, inp: jac.HeadInputs, blocks: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        d, dim = inp.d, inp.dim

        def statistics(flat: torch.Tensor) -> torch.Tensor:
            w = dict(inp.w, **dict(zip(blocks, flat.reshape(len(blocks), d, dim))))
            out = []
            for x in inp.xs:
                phi_k, v = feature_map(x @ w["k"].T), x @ w["v"].T
                out.append(torch.cat([(phi_k.T @ v).reshape(-1), phi_k.sum(0)]))
            return torch.cat(out)

        theta = torch.cat([inp.w[b].reshape(-1) for b in blocks])
        return statistics(theta), torch.func.jacrev(statistics)(theta)

    def jacobian_support(self, inp: jac.HeadInputs) -> tuple[str, tuple[str, ...], torch.Tensor] | None:
        """Keys and values enter only through each sequence's S = sum phi(k) v^T and z = sum phi(k):
        J sees (W_K, W_V) only through the row space of the small (S, z)-Jacobian G, of dimension
        <= B (d^2 + d) against 2 d D' parameters (B sequences). The probe works on J P, P an
        orthonormal basis of that row space; its complement (>= 2 d D' - B (d^2 + d) directions per
        head, every direction that leaves every (S_b, z_b) fixed) is null."""
        blocks = [b for b in ("k", "v") if b in inp.blocks]
        if not blocks:
            return None
        _, g, _, _, vh = self._statistics_jacobian(inp, blocks)
        if vh.shape[0] >= g.shape[1]:
            return None  # no reduction: G has full column rank
        return "key_value_statistics", tuple(blocks), vh.T

    def symmetries(self, inp: jac.HeadInputs) -> dict[str, dict[str, torch.Tensor]]:
        """At eps = 0 the output depends on each sequence's (S_b, z_b) only up to a common scale: the
        parameter direction that scales (S_b, z_b) (the minimum-norm solution of G theta = (S_b,
        z_b), one per sequence) is null."""
        blocks = [b for b in ("k", "v") if b in inp.blocks]
        if "k" not in blocks:
            return {}  # z depends on K only: V alone cannot scale (S, z) together
        d, dim = inp.d, inp.dim
        stats, g, u, sv, vh = self._statistics_jacobian(inp, blocks)
        per = d * d + d
        targets = torch.zeros(len(stats), len(inp.xs), dtype=stats.dtype, device=stats.device)
        for b in range(len(inp.xs)):
            targets[b * per : (b + 1) * per, b] = stats[b * per : (b + 1) * per]
        theta = vh.T @ ((u.T @ targets) / sv[:, None])  # minimum-norm: G^+ targets
        residual = (g @ theta - targets).norm() / targets.norm()
        if float(residual) > 1e-8:
            return {}  # (S_b, z_b) not reachable: no scaling direction
        parts = theta.T.reshape(-1, len(blocks), d, dim)
        groups = {"key_value_scale": {b: parts[:, i] for i, b in enumerate(blocks)}}
        if "q" in inp.blocks and blocks == ["k", "v"]:
            feature = self._feature_gauge(inp, g, u, sv, vh, stats)
            if feature is not None:
                groups["feature_gauge"] = feature
        return groups

    @staticmethod
    def _feature_gauge(inp, g, u, sv, vh, stats):  # noqa: ANN001, ANN205
        """phi(q_i) -> (I + E) phi(q_i) with (S, z) -> (I - E^T)(S, z) leaves every A_i unchanged; it
        is a parameter direction when dphi_i = E phi_i is linear in x_i: for E = e_b e_c^T with b, c
        features whose queries stay positive over the probe (phi = q + 1, phi' = 1: dq_b = q_c + 1),
        and E = e_b e_b^T for a feature whose queries stay non-positive (phi = phi' = exp(q):
        dq_b = 1). The (S, z) part comes from the minimum-norm K/V direction; "1" is the input
        direction w with x . w = 1 on every real row (the bias column)."""
        d, dim = inp.d, inp.dim
        x_all = torch.cat(inp.xs)
        q = x_all @ inp.w["q"].T
        # gelsd (SVD): x_all is rank-deficient after a LayerNorm, where the default gelsy at times
        # returned a non-solution (residual ~1), varying from run to run
        target = torch.ones(len(x_all), 1, dtype=x_all.dtype)
        ones = torch.linalg.lstsq(x_all, target, driver="gelsd").solution[:, 0]
        if float((x_all @ ones - 1).abs().max()) > 1e-9:
            return None
        positive = torch.nonzero((q > 0).all(0)).flatten().tolist()
        negative = torch.nonzero((q <= 0).all(0)).flatten().tolist()
        pairs = [(b, c) for b in positive for c in positive] + [(b, b) for b in negative]
        if not pairs:
            return None
        per = d * d + d
        dq = torch.zeros(len(pairs), d, dim, dtype=q.dtype, device=q.device)
        targets = torch.zeros(len(stats), len(pairs), dtype=q.dtype, device=q.device)
        for j, (b, c) in enumerate(pairs):
            dq[j, b] = (inp.w["q"][c] + ones) if b in positive else ones
            for s_idx in range(len(inp.xs)):  # (dS, dz) = -E^T (S, z): row c gets -(row b)
                block = stats[s_idx * per : (s_idx + 1) * per]
                s_mat, z_vec = block[: d * d].reshape(d, d), block[d * d :]
                ds, dz = torch.zeros_like(s_mat), torch.zeros_like(z_vec)
                ds[c], dz[c] = -s_mat[b], -z_vec[b]
                targets[s_idx * per : (s_idx + 1) * per, j] = torch.cat([ds.reshape(-1), dz])
        theta = vh.T @ ((u.T @ targets) / sv[:, None])
        if float((g @ theta - targets).norm()) > 1e-8 * float(targets.norm()):
            return None
        kv = theta.T.reshape(len(pairs), 2, d, dim)
        return {"q": dq, "k": kv[:, 0], "v": kv[:, 1]}
