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


def sequence_conv(v: torch.Tensor, weight: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Depthwise 'same' convolution of v (batch, heads, n, d) along n, one odd kernel per head
    (weight (heads, k)), shared over d: what ``conv2d`` with a (k, 1) kernel, padding (k // 2, 0) and
    heads as groups computes.

    Why not conv2d: on CPU its (k, 1) depthwise kernel runs far below the matmul rate
    (docs/benchmarks.md, "Speed paths in the probe"). Here the sequence is cut into blocks of
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
