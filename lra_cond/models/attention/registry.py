"""Attention family registry."""

from __future__ import annotations

from lra_cond.registry import Registry

ATTENTIONS: Registry[type] = Registry("attention")
