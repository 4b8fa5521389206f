"""Attention families, looked up by name: ``build_attention("softmax", dim=64, num_heads=2)``."""

from __future__ import annotations

from typing import Any

# Importing a family module registers it; registration order is the order of ATTENTIONS.names().
from lra_cond.models.attention import linear, normalized, nystrom, softmax  # noqa: F401
from lra_cond.models.attention.base import Attention, attention_layers, explicit_math
from lra_cond.models.attention.registry import ATTENTIONS


def build_attention(name: str, dim: int, num_heads: int, **options: Any) -> Attention:
    """Build one attention layer, called as ``layer(x, key_padding_mask=None)``."""
    return ATTENTIONS.get(name)(dim, num_heads, **options)


__all__ = ["ATTENTIONS", "Attention", "attention_layers", "build_attention", "explicit_math"]
