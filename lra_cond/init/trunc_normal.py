"""``trunc-normal``: the ViT/timm recipe, with the truncation made explicit.

Exactly what it does:
  * every ``nn.Linear`` weight (attention projections, MLPs, classifier head) and every
    ``nn.Embedding`` table (tokens, learned positions) ~ N(0, std^2) truncated to
    [-cutoff*std, +cutoff*std] (``torch.nn.init.trunc_normal_``; defaults std 0.02, cutoff 2);
  * every ``nn.Linear`` bias = 0;
  * LayerNorm weight 1, bias 0, and any other module (e.g. a convolution) at its PyTorch default.
timm calls ``trunc_normal_(w, std=.02)`` with its default *absolute* bounds +-2, i.e. +-100 std,
which truncates nothing; we truncate at +-2 std (the BERT / TF ``truncated_normal`` convention), so
the realised std is 0.8796 * std. ``{"cutoff": 100}`` reproduces timm's numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from lra_cond.errors import UserError
from lra_cond.init.base import INITS
from lra_cond.init.default import reset_defaults


@INITS.register("trunc-normal")
@torch.no_grad()
def trunc_normal_init(model: nn.Module, std: float = 0.02, cutoff: float = 2.0) -> None:
    """Linear/Embedding weights truncated-normal(std, +-cutoff*std), Linear biases 0."""
    if std <= 0 or cutoff <= 0:
        raise UserError(f"init 'trunc-normal' needs std > 0 and cutoff > 0, got std={std}, cutoff={cutoff}")
    reset_defaults(model)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, std=std, a=-cutoff * std, b=cutoff * std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
