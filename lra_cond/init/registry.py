"""Init scheme registry: ``apply_init(model, name, **kwargs)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lra_cond.errors import UserError
from lra_cond.registry import Registry

InitFn = Callable[..., None]
INITS: Registry[InitFn] = Registry("init")


def apply_init(model: nn.Module, name: str, **kwargs: Any) -> nn.Module:
    """Initialise ``model`` in place with the scheme ``name``; returns the model."""
    fn = INITS.get(name)
    try:
        fn(model, **kwargs)
    except TypeError as e:
        if "unexpected keyword argument" in str(e):
            raise UserError(f"init '{name}': {e}") from None
        raise
    return model
