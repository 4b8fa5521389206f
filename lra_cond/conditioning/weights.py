"""Condition numbers of the projection weights themselves, per head and stacked over heads."""

from __future__ import annotations

import torch


def matrix_condition(m: torch.Tensor) -> float:
    """sigma_max / sigma_min over the min(rows, cols) singular values (inf if rank-deficient)."""
    s = torch.linalg.svdvals(m.detach().to(torch.float64))
    return float(s[0] / s[-1]) if s[-1] > 0 else float("inf")


def weight_conditions(layer, blocks: tuple[str, ...] = ("q", "k", "v")) -> dict[str, dict]:  # noqa: ANN001
    """``{"q": {"stacked": kappa(W_Q), "heads": [kappa(W_Q^h) ...]}, ...}`` (torch layout, rows = outputs)."""
    d = layer.head_dim
    out: dict[str, dict] = {}
    for b in blocks:
        w = getattr(layer, f"{b}_proj").weight
        out[b] = {
            "stacked": matrix_condition(w),
            "heads": [matrix_condition(w[h * d : (h + 1) * d]) for h in range(layer.num_heads)],
        }
    return out
