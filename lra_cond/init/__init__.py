"""Init schemes, chosen by name: ``apply_init(model, "conditioned", v_scale=1.0)``.

One module per scheme (the four conditioned ablations share one); importing them registers the names.
The registry is imported first: scheme modules import ``lra_cond.models``, whose ``module.py``
imports ``INITS``/``apply_init`` back from this (then partially initialised) package.
"""

from lra_cond.init.registry import INITS, apply_init, describe_params  # isort: skip

from lra_cond.init import (  # noqa: F401, E402  (register the schemes)
    ablations,
    conditioned,
    conditioned_joint,
    default,
    mimetic,
    trunc_normal,
    weight_selection,
    xavier,
)

__all__ = ["INITS", "apply_init", "describe_params"]
