"""Nyströmformer attention's head Jacobian: its closed form (the iterative pinv differentiated
exactly) and its symmetries."""

from __future__ import annotations

import torch

from lra_cond.conditioning.families import base as jac
from lra_cond.linalg import RANK_RTOL, null_vectors
from lra_cond.models.attention.nystrom import iterative_pinv


# One step of the pinv iteration on a singular value sigma of A. Z_k = V g_k(Sigma) U^T for
# A = U Sigma V^T (Z_0 = A^T / scale and every step is a polynomial in A Z), and with
# phi = sigma g_k(sigma) (A Z's eigenvalue) and e = 1 - phi:
#     g' = g f(phi),  f(phi) = (13 - 15 phi + 7 phi^2 - phi^3) / 4 = Q(e) = 1 + e + e^2 + e^3 / 4,
#     phi' = Phi(phi) = phi f(phi),  e' = P(e) = e^3 (3 + e) / 4.
# Each polynomial comes with its divided difference p[x, y] = (p(x) - p(y)) / (x - y) as a formula
# (exact, also at x == y), so no difference quotient of close values is ever taken.
def _f(p: torch.Tensor) -> torch.Tensor:
    return (13 - p * (15 - p * (7 - p))) / 4


def _f_dd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (-15 + 7 * (p + q) - (p * p + p * q + q * q)) / 4


def _q(e: torch.Tensor) -> torch.Tensor:
    return 1 + e * (1 + e * (1 + e / 4))


def _q_dd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 1 + (p + q) + (p * p + p * q + q * q) / 4


def _phi_step_dd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # Phi[p, q]
    return (13 - 15 * (p + q) + 7 * (p * p + p * q + q * q) - (p + q) * (p * p + q * q)) / 4


def _e_step_dd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # P[p, q]
    return (3 * (p * p + p * q + q * q) + (p + q) * (p * p + q * q)) / 4


def pinv_output_jacobian(a: torch.Tensor, right: torch.Tensor, iterations: int) -> torch.Tensor:
    """d (Z R)[r', c] / d A[r, t] for Z = ``iterative_pinv(A, iterations)`` of one (m, m) matrix and a
    fixed R (m, n), as [r, r', c, t] (m, m, n, m): the iteration differentiated exactly, in closed form.
    (The layout its caller contracts per r: ``NystromJacobian.parts``.)

    Z = V g(Sigma) U^T is a function of A's singular values (see the step polynomials above), so
    for fixed scale its derivative is, with E = U^T dA V (Daleckii-Krein on A's symmetric dilation),
        dZ = V (D_- o E + D_+ o E^T) U^T,  D_-/+ = (g[s_i, s_j] -/+ (g_i + g_j) / (s_i + s_j)) / 2,
    plus the scale's own term (Z0 = A^T / (||A||_1 ||A||_inf); the norms' maxima differentiated
    with ties sharing the gradient, as torch's ``amax`` does). g and its divided differences
    g[s_i, s_j] come from the step recursions; each step tracks phi while phi <= 1/2 and e = 1 - phi
    after (an iteration that converges makes e tiny, one far from it keeps phi tiny: tracking only
    one loses digits on the other, measured 3e-11 at 12 iterations against 1e-15 this way).
    ~1 GFLOP at the reference shape (m = 64, n = d = 32) where reverse mode through the iterations
    takes ~51; equal to ``torch.func.jacrev`` of
    ``iterative_pinv`` to ~1e-15 of its largest entry, 4e-14 at worst over 72 small softmax
    matrices and 1-12 iterations (tested to 1e-13, also with tied singular values, a singular A and
    far from convergence), and within 2e-15 of a 50-digit finite-difference reference (measured on
    6 x 6 matrices of kappa up to 1.5e4 at 6 and 12 iterations).
    """
    m, n = right.shape
    col, row = a.abs().sum(-2), a.abs().sum(-1)
    norm_1, norm_inf = col.amax(), row.amax()
    scale = norm_1 * norm_inf
    u, s, vh = torch.linalg.svd(a)
    v = vh.T
    g = s / scale
    phi = s * g  # <= 1: ||A||_2^2 <= ||A||_1 ||A||_inf
    e = 1 - phi
    pair = s[:, None] + s[None, :]
    g_dd = torch.full_like(a, 1.0) / scale
    phi_dd = pair / scale
    g_scale, phi_scale = s.clone(), s * s  # d/d(1/scale)
    for _ in range(iterations):
        small = phi <= 0.5  # phi is the accurate variable (else e)
        w = torch.where(small, _f(phi), _q(e))
        w_d = torch.where(small, _f_dd(phi, phi), -_q_dd(e, e))  # dw / dphi
        both_e = ~small[:, None] & ~small[None, :]
        phi_step_dd = torch.where(
            both_e, _e_step_dd(e[:, None], e[None, :]), _phi_step_dd(phi[:, None], phi[None, :])
        )
        w_dd = _f_dd(phi[:, None], phi[None, :]) * phi_dd
        g_dd = g_dd * (w[:, None] + w[None, :]) / 2 + (g[:, None] + g[None, :]) / 2 * w_dd
        g_scale = g_scale * w + g * w_d * phi_scale
        phi_scale = torch.where(small, _phi_step_dd(phi, phi), _e_step_dd(e, e)) * phi_scale
        phi_dd = phi_step_dd * phi_dd
        g = g * w
        phi_next, e_next = phi * w, e**3 * (3 + e) / 4  # Phi(phi) = phi f(phi), P(e)
        phi, e = torch.where(small, phi_next, 1 - e_next), torch.where(small, 1 - phi_next, e_next)
    # (g_i + g_j) / (s_i + s_j) -> g'(0) where both are 0 (a singular A)
    g_mean = torch.where(pair > 0, (g[:, None] + g[None, :]) / torch.where(pair > 0, pair, 1.0), g_dd)
    d_minus, d_plus = (g_dd - g_mean) / 2, (g_dd + g_mean) / 2
    # dA = e_r e_t^T: E_ij = U[r, i] V[t, j]; with M = U^T R,
    # out[r, p, c, t] = sum_i V[p, i] (U[r, i] X_-[i, t, c] + V[t, i] X_+[i, r, c]),
    # X_-[i, t, c] = sum_j D_-[i, j] V[t, j] M[j, c], X_+[i, r, c] = sum_j D_+[i, j] U[r, j] M[j, c]
    mm = u.T @ right
    x_minus = ((d_minus[:, None, :] * v[None]) @ mm).transpose(1, 2)  # [i, c, t]
    x_plus = (d_plus[:, None, :] * u[None]) @ mm  # [i, r, c]
    uv = (u[:, None, :] * v[None]).reshape(m * m, m)  # [(r, p), i]
    vv = (v[:, None, :] * v[None]).reshape(m * m, m)  # [(p, t), i]
    out = a.new_empty(m, m, n, m)
    # the first term lands in out's layout; the second as [r, c, p, t], its middle pair swapped in the
    # one pass (a permute of whole rows of t, where [r', c, r, t] took two of single entries)
    torch.add(
        (uv @ x_minus.reshape(m, -1)).view(m, m, n, m),
        (x_plus.reshape(m, -1).T @ vv.T).view(m, n, m, m).transpose(1, 2),
        out=out,
    )
    sign = torch.sign(a)
    col_max, row_max = (col == norm_1).to(a.dtype), (row == norm_inf).to(a.dtype)
    d_scale = sign * (norm_inf * col_max[None, :] / col_max.sum() + norm_1 * row_max[:, None] / row_max.sum())
    z_scale = (v * g_scale) @ mm  # d (Z R) / d (1 / scale)
    alpha = -1 / float(scale) ** 2
    out.view(m, m * n, m).baddbmm_(
        z_scale.reshape(1, -1, 1).expand(m, -1, -1), d_scale.view(m, 1, m), alpha=alpha
    )
    return out


# The landmark correction's rank m_e d adds up over a probe's sequences (each has its own landmarks),
# while its Grams cost rank x (d D')^2 where the formed columns' cost ~(rows / 2) x (d D')^2: the
# factors pay up to a rank of about half the rows. Probes of one to four sequences, timed side by
# side, put the crossover near 0.57 of the rows (docs/benchmarks.md, "Speed paths in the probe").
FACTORED_RANK_FRACTION = 0.57


def _factoring_pays(blocks: list[jac.Factored]) -> bool:
    """Whether a block's landmark corrections, over every sequence, are of low enough rank that
    its Grams are cheaper from the factors than from its formed columns."""
    rank = sum(f.low_rank[0].rank for f in blocks)  # type: ignore[index]
    rows = sum(f.left.shape[0] * f.left.shape[-1] for f in blocks)
    return rank <= FACTORED_RANK_FRACTION * rows


class NystromJacobian(jac.FamilyJacobian, family="nystrom"):
    def _sequence_parts(self, x: torch.Tensor, inp: jac.HeadInputs) -> dict[str, torch.Tensor]:
        """One sequence's landmark quantities (only non-empty landmarks: an empty one is dropped by
        the kernel, and the pinv of blockdiag(A', 0) is blockdiag(pinv(A'), 0))."""
        q, k, v = inp.projected(x)
        length = x.shape[0]
        segment = torch.arange(length, device=x.device) * self.layer.num_landmarks // length
        landmarks = torch.unique(segment)
        seg = (segment[None, :] == landmarks[:, None]).to(x.dtype)
        seg = seg / seg.sum(1, keepdim=True)  # (m_e, L) segment means
        return {"q": q, "k": k, "v": v, "seg": seg, "q_l": seg @ q, "k_l": seg @ k, "x_l": seg @ x}

    def _conv_matrix(self, h: int, length: int, like: torch.Tensor) -> torch.Tensor:
        """The conv skip as an (L, L) Toeplitz matrix: out_i = sum_t w[t] v_{i + t - k//2}."""
        if self.layer.conv is None:
            return like.new_zeros(length, length)
        w = self.layer.conv.weight[h, 0, :, 0].to(like.dtype)
        kernel = w.numel()
        pos = torch.arange(length, device=w.device)
        offset = pos[None, :] - pos[:, None] + kernel // 2
        inside = (offset >= 0) & (offset < kernel)
        return torch.where(inside, w[offset.clamp(0, kernel - 1)], like.new_zeros(()))

    def parts(self, inp: jac.HeadInputs) -> dict[str, jac.Part]:
        """O = F Z B V + C V with F = softmax(s Q K~^T), A = softmax(s Q~ K~^T), B = softmax(s Q~ K^T),
        Z = the iterative pinv of A, C the conv skip, Q~ = S Q, K~ = S K (S: segment means, X~ = S X).
        Q and K reach O through F directly (softmax-like, query-local in Q), through B via Q~ and K,
        and through Z via A; V only linearly (O = P V, P = F Z B + C). With H = Z B V and
        Psi(dA) = dZ (B V) (its (m d) x m^2 Jacobian by reverse mode through the pinv iteration,
        ``pinv_output_jacobian``):
            dO/dW_Q = G^F_i x_i + sum_r (F Z)_ir N_r x~_r + F Psi_Q,  dO/dW_K = q_i R^F_i + sum_r
            (F Z)_ir q~_r R^B_r + F Psi_K,  dO/dW_V = e_b (P X)_i,
        G^F, R^F the softmax factors of F (values H, keys K~, inputs X~), N_r, R^B_r those of B.
        So Q and K are per-token factors (F's own terms) plus a correction that reaches token i only
        through F's row: (F (x) I_d) W with W = Psi + Z [N_r x~_r or q~_r R^B_r] (m d x d D'), kept as
        ``Factored`` with a ``TokenMixing`` correction: the probe never forms their 8192 x 2080
        columns, and every Gram with them costs m d (d D')^2 instead of T d (d D')^2."""
        s = jac.attention_scale(inp.d)
        parts: dict[str, list[jac.Part]] = {b: [] for b in inp.blocks}
        for x in inp.xs:
            t = self._sequence_parts(x, inp)
            q, k, v, q_l, k_l, x_l = t["q"], t["k"], t["v"], t["q_l"], t["k_l"], t["x_l"]
            f = torch.softmax(s * q @ k_l.T, dim=-1)
            a = torch.softmax(s * q_l @ k_l.T, dim=-1)
            b = torch.softmax(s * q_l @ k.T, dim=-1)
            bv = b @ v
            z = iterative_pinv(a, self.layer.pinv_iterations)
            hv, fz = z @ bv, f @ z
            length, m, d = x.shape[0], a.shape[0], inp.d
            if "v" in parts:
                p = fz @ b + self._conv_matrix(inp.h, length, x)
                parts["v"].append(jac.value_block(p @ x, d))
            if "q" not in parts and "k" not in parts:
                continue
            # Psi: d(Z BV) / dA [r', a, r, t] through A's softmax rows: dA[r, t] = A[r, t] (ds[r, t] -
            # sum_t' A[r, t'] ds[r, t']), with the scores s q~_r . k~_t = s x~_r W_Q^T W_K x~_t. Both
            # blocks contract t first, so the weighted and centred (r, t) tensors are never formed:
            # Y[r, (r', a), :] = sum_t jz[r, r', a, t] A[r, t] (w[t] - (A w)[r]), w = [K~ | X~]
            jz = pinv_output_jacobian(a, bv, self.layer.pinv_iterations)
            ws = [w for b, w in (("q", k_l), ("k", x_l)) if b in parts]
            w = torch.cat(ws, 1)
            weights = a[:, :, None] * (w[None] - (a @ w)[:, None])  # [r, t, :]
            y = torch.matmul(jz.view(m, m * d, m), weights)  # [r, (r', a), :]
            mixing = jac.TokenMixing(f, d)  # every landmark term reaches token i as F_i (Psi + Z B')
            if "q" in parts:
                g_f = jac.softmax_query_factor(f, k_l, hv, s)
                n_b = jac.softmax_query_factor(b, k, v, s)  # (m, d, d)
                via_b = (n_b[:, :, :, None] * x_l[:, None, None, :]).reshape(m, -1)
                # [(r', a), b, c] batched over (r', a): an einsum's sums as one batched matmul
                psi = s * torch.matmul(y[:, :, :d].permute(1, 2, 0), x_l)
                low = torch.addmm(psi.reshape(m, -1), z, via_b).view(m * d, d, -1)
                parts["q"].append(jac.Factored("query_local", g_f, x, (mixing, low)))
            if "k" in parts:
                r_f = jac.softmax_key_factor(f, hv, x_l, s)
                r_b = jac.softmax_key_factor(b, v, x, s)  # (m, d, D')
                via_b = (q_l[:, None, :, None] * r_b[:, :, None, :]).reshape(m, -1)
                psi = s * torch.einsum("rb,rnc->nbc", q_l, y[:, :, -x_l.shape[1] :])  # [(r', a), b, c]
                low = torch.addmm(psi.reshape(m, -1), z, via_b).view(m * d, d, -1)
                parts["k"].append(jac.Factored("outer", q, r_f, (mixing, low)))
        for b in ("q", "k"):
            if b in parts and not _factoring_pays(parts[b]):
                parts[b] = [f.dense() for f in parts[b]]  # type: ignore[union-attr]
        return {b: jac.stack_sequences(ps) for b, ps in parts.items()}

    def symmetries(self, inp: jac.HeadInputs) -> dict[str, dict[str, torch.Tensor]]:
        """Landmark softmaxes see queries and keys through inner products (the gauge) and ignore a
        shift common to a sequence's keys (its landmark keys shift alike).

        With no more landmarks than head dimensions there are more: every score is x_i^T Omega x~_t
        (F, A) or x~_r^T Omega x_j (B) with Omega = W_Q^T W_K, and a softmax row ignores a constant.
        So every (dW_Q, dW_K) whose dOmega = dW_Q^T W_K + W_Q^T dW_K adds only row constants is
        null: R_X dOmega X~_c^T = 0 and X~ dOmega R_Xc^T = 0 in every sequence (X = Q_X R_X, _c:
        rows centred, X~ the landmark inputs). The null space of that small map (it holds the gauge
        and the key shifts) is taken only when every sequence has m_e <= d landmarks: with more it
        holds nothing else (measured on single sequences: m = 12 > d = 8 none, m <= 8 up to 20 per
        head), and it would cost an SVD as large as the Jacobian's block.
        """
        groups: dict[str, dict[str, torch.Tensor]] = {}
        if "q" in inp.blocks and "k" in inp.blocks:
            groups["gauge"] = jac.gauge(inp.w["q"], inp.w["k"])
        if "k" in inp.blocks:
            groups["key_shift"] = {"k": jac.key_shift(inp.xs, inp.d, RANK_RTOL)}
        seqs = [self._sequence_parts(x, inp) for x in inp.xs]
        blocks = [b for b in ("q", "k") if b in inp.blocks]
        if blocks and all(t["x_l"].shape[0] <= inp.d for t in seqs):
            null = self._invisible_scores(inp, seqs, blocks)
            if null.shape[1]:
                parts = null.T.reshape(-1, len(blocks), inp.d, inp.dim)
                groups["few_landmarks"] = {b: parts[:, i] for i, b in enumerate(blocks)}
        return groups

    @staticmethod
    def _invisible_scores(inp: jac.HeadInputs, seqs: list[dict], blocks: list[str]) -> torch.Tensor:
        """Null space of (dW_Q, dW_K) -> {R_X dOmega X~_c^T, X~ dOmega R_Xc^T} per sequence."""
        d, dim = inp.d, inp.dim
        eye = torch.eye(d * dim, dtype=inp.w["q"].dtype, device=inp.w["q"].device).reshape(-1, d, dim)
        rows = []
        for x, t in zip(inp.xs, seqs):
            r_x = torch.linalg.qr(x, mode="r").R
            r_xc = torch.linalg.qr(x - x.mean(0, keepdim=True), mode="r").R
            x_lc = t["x_l"] - t["x_l"].mean(0, keepdim=True)
            d_omega = []
            if "q" in blocks:  # dOmega = dW_Q^T W_K
                d_omega.append(eye.transpose(1, 2) @ inp.w["k"])
            if "k" in blocks:  # dOmega = W_Q^T dW_K
                d_omega.append(inp.w["q"].T @ eye)
            # columns: each block's basis tangents; rows: the two score maps, flattened
            per_block = [
                torch.cat([(r_x @ om @ x_lc.T).flatten(1), (t["x_l"] @ om @ r_xc.T).flatten(1)], 1)
                for om in d_omega
            ]
            rows.append(torch.cat(per_block, 0).T)
        return null_vectors(torch.cat(rows, 0), RANK_RTOL)
