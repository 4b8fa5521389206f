"""Attention families, looked up by name: ``build_attention("softmax", dim=64, num_heads=2)``.

Every module of this package is imported here, so a family is one file: its class registers itself
(``class MyAttention(Attention, name="mine")``, see ``base.py``); registration order (the order of
``ATTENTIONS.names()``) is the modules' alphabetical order.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from lra_cond.models.attention.base import ATTENTIONS, Attention, Option, attention_layers, explicit_math

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build_attention(name: str, dim: int, num_heads: int, **options: Any) -> Attention:
    """Build one attention layer, called as ``layer(x, key_padding_mask=None)``.

    ``options`` are ``head_dim``, ``dropout``, ``bias`` (every family) and the family's own (e.g.
    ``num_landmarks`` for nystrom); an unknown one is a ``UserError`` listing the valid ones.
    """
    return ATTENTIONS.get(name)(dim, num_heads, **options)


__all__ = ["ATTENTIONS", "Attention", "Option", "attention_layers", "build_attention", "explicit_math"]
