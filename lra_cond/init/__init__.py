"""Init schemes, chosen by name: ``apply_init(model, "conditioned")``."""

from lra_cond.init import conditioned, default  # noqa: F401  (register the schemes)
from lra_cond.init.registry import INITS, apply_init

__all__ = ["INITS", "apply_init"]
