"""Nyströmformer attention (Xiong et al. 2021, "Nyströmformer: A Nyström-Based Algorithm for
Approximating Self-Attention").

With m landmarks Q~, K~ (segment means of Q and K), per head

    softmax(Q K^T / sqrt(d)) V  ~=  F pinv(A) B V + conv(V),
    F = softmax(Q K~^T / sqrt(d))  (N x m),  A = softmax(Q~ K~^T / sqrt(d))  (m x m),
    B = softmax(Q~ K^T / sqrt(d))  (m x N),

pinv by the paper's iterative scheme, conv a depthwise convolution of V along the sequence.

Padding and lengths (the reference pools padded tokens into landmarks and needs N % m == 0):
- An example with L real tokens puts its r-th real token (0-based) into segment floor(r * m / L), so
  landmarks average real tokens only and any L works. For L >= m every segment holds floor(L/m) or
  ceil(L/m) tokens; for L == m each landmark is one token, so with an exact pinv and no conv the
  layer is exactly softmax attention.
- An example shorter than m inside a batch padded to N >= m has empty segments. Those landmarks are
  dropped rather than raising: masked as keys of F, zero rows and columns of A (the pinv of
  blockdiag(A', 0) is blockdiag(pinv(A'), 0), and the iteration keeps that block structure). Such an
  example is then attended with L one-token landmarks, i.e. as softmax attention over its real
  tokens, so a batch mixing short and long examples trains properly.
- So does a whole batch of examples shorter than m (the encoder runs a batch as groups of similar
  length, see ``models/length_groups.py``): what an example computes never depends on its batch.
  ``num_landmarks`` larger than the model's maximum length is refused when the encoder is built.
- Padded keys are masked in B and F's keys are only landmarks of real tokens; padded values are
  zeroed before the conv skip, so real positions never see padding.

No dropout on the attention matrices, as in the authors' code; the encoder's residual dropout applies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lra_cond.linalg import RANK_RTOL, null_vectors
from lra_cond.models.attention import jacobian as jac
from lra_cond.models.attention.base import Attention, Option, masked_softmax
from lra_cond.models.attention.sdpa import attend


def landmark_segments(
    key_padding_mask: torch.Tensor | None, batch: int, n: int, m: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's landmark segment (batch, n), padded tokens in an extra slot m, and the
    (batch, m) number of real tokens per segment."""
    if key_padding_mask is None:
        real = torch.ones(batch, n, dtype=torch.bool, device=device)
    else:
        real = ~key_padding_mask
    rank = real.long().cumsum(-1) - 1  # position among the example's real tokens
    length = real.sum(-1, keepdim=True).clamp_min(1)
    segment = torch.where(real, rank * m // length, m)
    counts = torch.zeros(batch, m + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, segment, torch.ones_like(segment))
    return segment, counts[:, :m]


def segment_means(x: torch.Tensor, segment: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-segment mean of x (batch, heads, n, d) -> (batch, heads, m, d); empty segments give 0.

    A scatter-add over the (batch, n, heads*d) layout the projections wrote: it reads x once, where
    a dense (m x n) pooling matmul costs m times more and copies its matrix per head.
    """
    heads, m = x.shape[1], counts.shape[1]
    flat = rearrange(x, "b h n d -> b n (h d)")
    sums = flat.new_zeros(flat.shape[0], m + 1, flat.shape[2])
    sums = sums.scatter_add(1, segment[..., None].expand_as(flat), flat)[:, :m]
    means = sums / counts.clamp_min(1)[..., None].to(x.dtype)
    return rearrange(means, "b m (h d) -> b h m d", h=heads)


def iterative_pinv(a: torch.Tensor, iterations: int = 6) -> torch.Tensor:
    """Moore-Penrose pseudo-inverse of each (..., m, m) matrix by the Nyströmformer iteration.

    Z0 = A^T / (||A||_1 ||A||_inf) computed per matrix (the reference takes one max over the whole
    batch), then Z <- Z (13 I - AZ (15 I - AZ (7 I - AZ))) / 4. Converges for any A given enough
    iterations; how many depend on A's conditioning.
    """
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    norm_1 = a.abs().sum(-2).amax(-1)  # max column sum
    norm_inf = a.abs().sum(-1).amax(-1)  # max row sum
    z = a.transpose(-1, -2) / (norm_1 * norm_inf)[..., None, None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


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
    (The layout its caller contracts per r: ``NystromAttention.head_jacobian_parts``.)

    Z = V g(Sigma) U^T is a function of A's singular values (see the step polynomials above), so
    for fixed scale its derivative is, with E = U^T dA V (Daleckii-Krein on A's symmetric dilation),
        dZ = V (D_- o E + D_+ o E^T) U^T,  D_-/+ = (g[s_i, s_j] -/+ (g_i + g_j) / (s_i + s_j)) / 2,
    plus the scale's own term (Z0 = A^T / (||A||_1 ||A||_inf); the norms' maxima differentiated
    with ties sharing the gradient, as torch's ``amax`` does). g and its divided differences
    g[s_i, s_j] come from the step recursions; each step tracks phi while phi <= 1/2 and e = 1 - phi
    after (an iteration that converges makes e tiny, one far from it keeps phi tiny: tracking only
    one loses digits on the other, measured 3e-11 at 12 iterations against 1e-15 this way).
    ~1 GFLOP at the reference shape (m = 64, n = d = 32) where reverse mode through the iterations
    takes ~51 (measured 0.11 against 0.75 s per head); equal to ``torch.func.jacrev`` of
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
    # one pass (a permute of whole rows of t, where [r', c, r, t] took two of single entries: 2.3x)
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
# while its Grams cost rank x (d D')^2 where the formed columns' cost ~(rows / 2) x (d D')^2
# (measured at the reference shape, one sequence of 256 tokens, rank 2048 of 8192 rows: the probe
# 57 -> 42 s on a 2-core AMD EPYC; the tiny split's four sequences of 40-150 tokens have rank 7680
# of 9792 rows, where the factors took 49-51 s against the formed columns' 37-43 s). In between,
# probes of 256-320 tokens, side by side: two sequences of 128 (rank 1/2 of the rows) 20.4-21.5 s
# from the factors against 24.8-26.6 formed; three of 100 (0.64) 36.3 against 31.7; four of 80
# (0.8) 49.5 against 32.8. The crossover is near 0.57.
FACTORED_RANK_FRACTION = 0.57


def _factoring_pays(blocks: list[jac.Factored]) -> bool:
    """Whether a block's landmark corrections, over every sequence, are of low enough rank that
    its Grams are cheaper from the factors than from its formed columns."""
    rank = sum(f.low_rank[0].rank for f in blocks)  # type: ignore[index]
    rows = sum(f.left.shape[0] * f.left.shape[-1] for f in blocks)
    return rank <= FACTORED_RANK_FRACTION * rows


def sequence_conv(v: torch.Tensor, weight: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Depthwise 'same' convolution of v (batch, heads, n, d) along n, one odd kernel per head
    (weight (heads, k)), shared over d: what ``conv2d`` with a (k, 1) kernel, padding (k // 2, 0) and
    heads as groups computes.

    Why not conv2d: on CPU its (k, 1) depthwise kernel runs far below the matmul rate (about 6x slower
    than this at the ListOps shape, forward + backward). Here the sequence is cut into blocks of
    ``block`` rows; a block's output is one banded Toeplitz (block x (block + k - 1)) matrix times its
    zero-padded window of v, so the whole conv is one batched matmul. The windows are built from
    whole tiles (a cat, whose backward is slicing) rather than ``unfold`` (whose backward is slow).
    """
    k = weight.shape[-1]
    n = v.shape[-2]
    blocks, width = -(-n // block), block + k - 1
    extra = -(-(k - 1) // block)  # further tiles a window reaches into
    padded = F.pad(v, (0, 0, k // 2, (blocks + extra) * block - n - k // 2))
    tiles = padded.unflatten(-2, (blocks + extra, block))  # (batch, heads, tiles, block, d)
    parts = [tiles[:, :, j : j + blocks] for j in range(extra + 1)]
    parts[-1] = parts[-1][..., : width - extra * block, :]
    windows = torch.cat(parts, dim=-2)  # (batch, heads, blocks, width, d)
    # Row i of a block reads window entries i .. i + k - 1 with taps 0 .. k - 1 (cross-correlation).
    offset = torch.arange(width, device=v.device) - torch.arange(block, device=v.device)[:, None]
    toeplitz = weight[:, offset.clamp(0, k - 1)] * ((offset >= 0) & (offset < k))
    out = torch.einsum("hij,bhcjd->bhcid", toeplitz, windows)
    return out.flatten(2, 3)[:, :, :n]


def _odd_or_zero(kernel: int | None) -> str | None:
    if kernel and kernel % 2 == 0:
        return (
            f"conv_kernel must be odd (centred on each token), got {kernel}; "
            f"use {kernel + 1} or 0 to disable the conv skip"
        )
    return None


class NystromAttention(Attention, name="nystrom"):
    """Nyström attention; options ``num_landmarks`` (64), ``pinv_iterations`` (6) and
    ``conv_kernel`` (35, odd; 0 or None disables the conv skip)."""

    options = {
        "num_landmarks": Option(64, int, minimum=1),
        "pinv_iterations": Option(6, int, minimum=1),
        "conv_kernel": Option(35, int, minimum=0, nullable=True, check=_odd_or_zero),
    }

    def build(self) -> None:
        self.conv: nn.Conv2d | None = None
        if self.conv_kernel:
            # One kernel per head, shared over head_dim: Conv2d over (seq, 1) with heads as channels.
            kernel, pad = (self.conv_kernel, 1), (self.conv_kernel // 2, 0)
            heads = self.num_heads
            self.conv = nn.Conv2d(heads, heads, kernel, padding=pad, groups=heads, bias=False)

    def max_len_problem(self, max_len: int) -> str | None:
        if self.num_landmarks > max_len:
            return (
                f"num_landmarks={self.num_landmarks} exceeds the model's maximum sequence length {max_len}; "
                f"choose num_landmarks <= {max_len}, e.g. --model.attention_args "
                f"'{{\"num_landmarks\": {min(64, max_len)}}}'"
            )
        return None

    def landmarks(self, q, k, key_padding_mask):  # noqa: ANN001, ANN201
        """Landmarks Q~, K~, pinv(A), and the (batch, m) mask of empty landmarks."""
        b, _, n, d = q.shape
        segment, counts = landmark_segments(key_padding_mask, b, n, self.num_landmarks, q.device)
        q_l, k_l = segment_means(q, segment, counts), segment_means(k, segment, counts)
        empty = counts == 0
        a = masked_softmax(q_l @ k_l.transpose(-1, -2) / math.sqrt(d), empty)
        a = a.masked_fill(empty[:, None, :, None], 0.0)
        return q_l, k_l, iterative_pinv(a, self.pinv_iterations), empty

    def with_skip(self, out, v, key_padding_mask, explicit: bool):  # noqa: ANN001, ANN201
        """Add the depthwise conv of V along the sequence, padded values zeroed first (torch's conv on
        the explicit path, the same conv as a blocked matmul on the fast path)."""
        if self.conv is None:
            return out
        if key_padding_mask is not None:
            v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        if explicit:
            return out + self.conv(v)
        return out + sequence_conv(v, self.conv.weight.flatten(1))

    def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        q_l, k_l, z, empty = self.landmarks(q, k, key_padding_mask)
        bv = attend(q_l, k, v, key_padding_mask)  # B V: (batch, heads, m, d)
        return self.with_skip(attend(q, k_l, z @ bv, empty), v, key_padding_mask, explicit=False)

    def kernel_explicit(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        q_l, k_l, z, empty = self.landmarks(q, k, key_padding_mask)
        scale = 1.0 / math.sqrt(q.shape[-1])
        f = masked_softmax(q @ k_l.transpose(-1, -2) * scale, empty)
        b = masked_softmax(q_l @ k.transpose(-1, -2) * scale, key_padding_mask)
        return self.with_skip(f @ (z @ (b @ v)), v, key_padding_mask, explicit=True)

    # ---- condition-number probe

    def _sequence_parts(self, x: torch.Tensor, inp: jac.HeadInputs) -> dict[str, torch.Tensor]:
        """One sequence's landmark quantities (only non-empty landmarks: an empty one is dropped by
        the kernel, and the pinv of blockdiag(A', 0) is blockdiag(pinv(A'), 0))."""
        q, k, v = inp.projected(x)
        length = x.shape[0]
        segment = torch.arange(length, device=x.device) * self.num_landmarks // length
        landmarks = torch.unique(segment)
        seg = (segment[None, :] == landmarks[:, None]).to(x.dtype)
        seg = seg / seg.sum(1, keepdim=True)  # (m_e, L) segment means
        return {"q": q, "k": k, "v": v, "seg": seg, "q_l": seg @ q, "k_l": seg @ k, "x_l": seg @ x}

    def _conv_matrix(self, h: int, length: int, like: torch.Tensor) -> torch.Tensor:
        """The conv skip as an (L, L) Toeplitz matrix: out_i = sum_t w[t] v_{i + t - k//2}."""
        if self.conv is None:
            return like.new_zeros(length, length)
        w = self.conv.weight[h, 0, :, 0].to(like.dtype)
        kernel = w.numel()
        pos = torch.arange(length, device=w.device)
        offset = pos[None, :] - pos[:, None] + kernel // 2
        inside = (offset >= 0) & (offset < kernel)
        return torch.where(inside, w[offset.clamp(0, kernel - 1)], like.new_zeros(()))

    def head_jacobian_parts(self, inp: jac.HeadInputs) -> dict[str, jac.Part]:
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
            z = iterative_pinv(a, self.pinv_iterations)
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
            jz = pinv_output_jacobian(a, bv, self.pinv_iterations)
            ws = [w for b, w in (("q", k_l), ("k", x_l)) if b in parts]
            w = torch.cat(ws, 1)
            weights = a[:, :, None] * (w[None] - (a @ w)[:, None])  # [r, t, :]
            y = torch.matmul(jz.view(m, m * d, m), weights)  # [r, (r', a), :]
            mixing = jac.TokenMixing(f, d)  # every landmark term reaches token i as F_i (Psi + Z B')
            if "q" in parts:
                g_f = jac.softmax_query_factor(f, k_l, hv, s)
                n_b = jac.softmax_query_factor(b, k, v, s)  # (m, d, d)
                via_b = (n_b[:, :, :, None] * x_l[:, None, None, :]).reshape(m, -1)
                # [(r', a), b, c] batched over (r', a): 61 -> 34 ms against an einsum, the same sums
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
