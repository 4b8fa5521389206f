"""Condition numbers of the attention Jacobian and of the projection weights."""

from lra_cond.conditioning.jacobian import (
    DEFINITION,
    UNSEPARATED,
    JacobianCondition,
    SpectrumSummary,
    cut_separated,
    jacobian_condition,
)
from lra_cond.conditioning.linearised import weight_conditions
from lra_cond.linalg import matrix_condition

__all__ = [
    "DEFINITION",
    "JacobianCondition",
    "SpectrumSummary",
    "UNSEPARATED",
    "cut_separated",
    "jacobian_condition",
    "matrix_condition",
    "weight_conditions",
]
