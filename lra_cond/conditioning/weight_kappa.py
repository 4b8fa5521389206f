"""Condition numbers of the projection weights themselves, per head and stacked over heads."""

from __future__ import annotations

from lra_cond.linalg import matrix_condition
from lra_cond.models.attention.base import Attention


def weight_conditions(layer: Attention, blocks: tuple[str, ...] = ("q", "k", "v")) -> dict[str, dict]:
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
