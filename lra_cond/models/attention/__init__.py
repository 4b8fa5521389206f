"""Attention families, looked up by name: ``build_attention("softmax", dim=64, num_heads=2)``."""

from __future__ import annotations

import inspect
from typing import Any

from lra_cond.errors import UserError

# Importing a family module registers it; registration order is the order of ATTENTIONS.names().
from lra_cond.models.attention import linear, normalized, nystrom, softmax  # noqa: F401
from lra_cond.models.attention.base import Attention, attention_layers, explicit_math
from lra_cond.models.attention.registry import ATTENTIONS


def build_attention(name: str, dim: int, num_heads: int, **options: Any) -> Attention:
    """Build one attention layer, called as ``layer(x, key_padding_mask=None)``.

    ``options`` are the family's keyword arguments (``head_dim``, ``dropout``, ``bias`` for all, and
    e.g. ``num_landmarks`` for nystrom); an unknown one is a ``UserError`` listing the valid ones.
    """
    family = ATTENTIONS.get(name)
    valid = [p for p in inspect.signature(family).parameters if p not in ("dim", "num_heads")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise UserError(
            f"unknown option(s) {', '.join(unknown)} for attention '{name}'; "
            f"valid options: {', '.join(valid)}"
        )
    return family(dim, num_heads, **options)


__all__ = ["ATTENTIONS", "Attention", "attention_layers", "build_attention", "explicit_math"]
