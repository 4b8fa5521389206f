"""Condition numbers of the attention Jacobian (exact and matrix-free) and of the weights."""

from lra_cond.conditioning.jacobian import JacobianCondition, SpectrumSummary, jacobian_condition
from lra_cond.conditioning.weights import matrix_condition, weight_conditions

__all__ = [
    "JacobianCondition",
    "SpectrumSummary",
    "jacobian_condition",
    "matrix_condition",
    "weight_conditions",
]
