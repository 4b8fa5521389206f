"""Memory-bounded softmax attention for the fast paths of the softmax-based families.

``F.scaled_dot_product_attention`` picks a fused kernel that never builds the N x N matrix, except
that on CPU (torch 2.13) both fused kernels refuse dropout > 0 and it falls back to the math kernel,
which materialises (and keeps for backward) the full score, probability and dropout-mask matrices.
The mask type does not matter there: a boolean key-padding mask keeps the CPU flash kernel. So in
that one case the blockwise kernel (``blockwise.py``: query blocks against each sample's real keys,
probabilities recomputed and dropout masks regenerated in the backward) computes the formula
instead (docs/benchmarks.md, "Speed paths in the probe"). Masks that are not key-suffix padding
fall back to query chunks under activation checkpointing (checkpointing restores the RNG state, so
the backward reuses the forward's dropout mask). Either way peak memory is O(chunk x N) instead of
O(N x N).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lra_cond.models.attention.blockwise import blockwise_attention, prefix_lengths

# Largest score block (batch * heads * query rows * keys) built at once on the chunked path:
# 2**22 float32 elements = 16 MiB per intermediate, so a layer call's peak does not grow with N
# (docs/benchmarks.md, "Speed paths in the probe").
SCORE_BUDGET = 2**22


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    budget: int = SCORE_BUDGET,
    self_attention: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per head, keys masked where ``key_padding_mask`` (batch, keys) is True.

    q: (batch, heads, queries, d); k, v: (batch, heads, keys, d). ``scale`` defaults to 1/sqrt(d).
    ``self_attention``: the queries are the keys' positions, so the mask pads them too and no real
    token reads their rows; the blockwise kernel then skips them (their rows are zero there).
    """
    b, h, n, _ = q.shape
    if dropout_p > 0.0 and q.device.type == "cpu":
        lengths = None if key_padding_mask is None else prefix_lengths(key_padding_mask)
        if key_padding_mask is None or lengths is not None:
            rows = max(1, budget // (h * k.shape[-2]))  # per-sample blocks of at most `budget` scores
            return blockwise_attention(
                q, k, v, lengths, dropout_p=dropout_p, rows=rows, scale=scale, padded_queries=self_attention
            )
    mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
    rows = max(1, budget // (b * h * k.shape[-2]))
    if dropout_p == 0.0 or q.device.type != "cpu" or rows >= n:
        # Fused kernel (CPU flash without dropout; CUDA memory-efficient kernel takes dropout too),
        # or a chunk-free call whose whole score matrix already fits in the budget.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    chunks = [
        checkpoint(
            F.scaled_dot_product_attention,
            q[:, :, start : start + rows],
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            scale=scale,
            use_reentrant=False,
        )
        for start in range(0, n, rows)
    ]
    return torch.cat(chunks, dim=2)
