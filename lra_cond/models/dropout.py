"""Residual/embedding dropout with a faster CPU mask draw.

``nn.Dropout`` on CPU draws its mask with ``bernoulli_(1 - p)``, which (without MKL's generator, as
on AMD CPUs) takes one float64 uniform per element from the default generator, serially, and keeps
the element where it is below ``1 - p``. ``torch.rand(..., dtype=float64)`` draws those same doubles
about 40% faster, so comparing them with ``1 - p`` gives the same mask bit for bit (and leaves the
generator in the same state); the scaling below is nn.Dropout's own (mask / (1 - p), times x). Where
bernoulli_ uses MKL's generator instead, the mask is drawn differently with the same distribution.
At the ListOps reference shape the 7 dropouts of a step are about a third of the linear family's
step time on 2 cores, the draw being serial.
"""

from __future__ import annotations

import torch
from torch import nn


class Dropout(nn.Dropout):
    """``nn.Dropout``; in training on CPU the keep mask comes from ``torch.rand`` (float64)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.inplace or x.device.type != "cpu" or not 0.0 < self.p < 1.0:
            return super().forward(x)
        keep = torch.rand(x.shape, dtype=torch.float64, device=x.device) < 1.0 - self.p
        return x * keep.to(x.dtype).div_(1.0 - self.p)  # nn.Dropout's noise: mask / (1 - p)
