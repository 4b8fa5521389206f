"""Each attention family's Jacobian, one file per family, registered under the family's name (see
``base.py``): adding a family's closed form is one file here; without one the probe uses autodiff."""

from __future__ import annotations

import importlib
import pkgutil

from lra_cond.conditioning.families.base import FamilyJacobian, family_jacobian

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["FamilyJacobian", "family_jacobian"]
