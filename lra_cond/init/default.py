"""The reference code's init: PyTorch defaults for Linear/LayerNorm, N(0, 0.02) embeddings."""

from __future__ import annotations

import torch
from torch import nn

from lra_cond.init.base import INITS


def reset_defaults(model: nn.Module) -> None:
    """Redraw every parameter as the reference does, in module order (so seeds reproduce)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif hasattr(module, "reset_parameters") and module is not model:
            module.reset_parameters()


@INITS.register("default")
@torch.no_grad()
def default_init(model: nn.Module) -> None:
    reset_defaults(model)
