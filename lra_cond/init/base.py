"""What an init scheme is, and the scheme registry: ``apply_init(model, name, **kwargs)``.

A scheme is a function ``fn(model, **params) -> Any`` registered under a name, in a module of its
own in this package (``@INITS.register("mine")``; the package imports every module). Its keyword
parameters are the scheme's settings (``--model.init_args '{"v_scale": 2.0}'`` on the CLI, or
``model.init_args`` in YAML); ``apply_init`` checks them against the signature so a typo is a
one-line error listing the valid parameters, not a traceback.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from numbers import Real
from typing import Any

from torch import nn

from lra_cond.errors import UserError
from lra_cond.registry import Registry

InitFn = Callable[..., Any]
INITS: Registry[InitFn] = Registry("init")


def scheme_params(name: str) -> dict[str, inspect.Parameter]:
    """The settable parameters of scheme ``name`` (everything after ``model``)."""
    params = list(inspect.signature(INITS.get(name)).parameters.values())[1:]
    return {p.name: p for p in params}


def describe_params(name: str) -> str:
    """``v_scale=1.0, ...`` (default shown), or ``none``."""
    parts = [
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in scheme_params(name).values()
    ]
    return ", ".join(parts) or "none"


def check_params(name: str, kwargs: dict[str, Any]) -> None:
    """Unknown, missing or non-numeric-where-numeric parameters -> ``UserError``."""
    params = scheme_params(name)
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise UserError(
            f"init '{name}' has no parameter {', '.join(map(repr, unknown))}; "
            f"valid parameters: {describe_params(name)}"
        )
    empty = inspect.Parameter.empty
    missing = [p for p, v in params.items() if v.default is empty and p not in kwargs]
    if missing:
        example = json.dumps({p: "..." for p in missing})
        raise UserError(f"init '{name}' needs {', '.join(missing)}; pass --model.init_args '{example}'")
    for key, value in kwargs.items():
        default = params[key].default
        numeric = isinstance(default, Real) and not isinstance(default, bool)
        if numeric and (isinstance(value, bool) or not isinstance(value, Real)):
            raise UserError(f"init '{name}': parameter {key} must be a number, got {value!r}")


def apply_init(model: nn.Module, name: str, **kwargs: Any) -> nn.Module:
    """Initialise ``model`` in place with the scheme ``name``; returns the model."""
    check_params(name, kwargs)
    INITS.get(name)(model, **kwargs)
    return model
