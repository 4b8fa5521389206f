"""``xavier``: Glorot init of every ``nn.Linear`` weight, biases 0.

Each Linear weight (fan_in = in features, fan_out = out features; the q/k/v projections as whole
(H*d_h x D) matrices) ~ U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)), or
N(0, gain^2 * 2 / (fan_in + fan_out)) with ``distribution="normal"``. Embeddings keep the default
N(0, 0.02^2), LayerNorms (1, 0), other modules their PyTorch defaults.
"""

from __future__ import annotations

import torch
from torch import nn

from lra_cond.errors import UserError
from lra_cond.init.base import INITS
from lra_cond.init.default import reset_defaults

DISTRIBUTIONS = {"uniform": nn.init.xavier_uniform_, "normal": nn.init.xavier_normal_}


@INITS.register("xavier")
@torch.no_grad()
def xavier_init(model: nn.Module, gain: float = 1.0, distribution: str = "uniform") -> None:
    """Xavier/Glorot Linear weights (uniform or normal), zero Linear biases, rest default."""
    if distribution not in DISTRIBUTIONS:
        raise UserError(
            f"init 'xavier': unknown distribution {distribution!r}; valid: {', '.join(DISTRIBUTIONS)}"
        )
    reset_defaults(model)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            DISTRIBUTIONS[distribution](module.weight, gain=gain)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
