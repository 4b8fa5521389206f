"""Init schemes, chosen by name: ``apply_init(model, "conditioned", v_scale=1.0)``.

Every module of this package is imported here, so a scheme is one file: a function registered
with ``@INITS.register("name")`` whose keyword parameters are its settings (see ``base.py``);
registration order (the order of ``INITS.names()``) follows the modules' alphabetical order.
Schemes act only through the attention contract (``lra_cond.models.attention.base``).
"""

import importlib
import pkgutil

from lra_cond.init.base import INITS, apply_init, describe_params

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["INITS", "apply_init", "describe_params"]
