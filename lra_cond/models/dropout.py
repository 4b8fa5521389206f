"""Dropout whose CPU keep-mask costs a quarter of a random word per element.

``nn.Dropout`` on CPU draws one float64 uniform per element from torch's serial mt19937 generator,
and at the ListOps reference shape those draws were a quarter of a Nyström training step. Here each
64-bit word of the generator gives four 16-bit draws, and an element is dropped when its draw falls
below ``round(p * 2**16)``: the rate applied is ``p`` rounded to a multiple of 2**-16 (0.1 ->
0.1000061), and kept values are scaled by 1 / (1 - that rate), so the layer stays unbiased. The
softmax families' attention-probability dropout (``attention/blockwise.py``) draws its masks the
same way from per-block generators.
"""

from __future__ import annotations

import torch
from torch import nn


def quantized_rate(p: float) -> float:
    """The dropout rate actually applied: ``p`` rounded to a multiple of 2**-16."""
    return round(p * 65536) / 65536


def keep_mask(
    shape: tuple[int, ...],
    p: float,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Float CPU mask of ``shape``, 1 = kept, 0 = dropped with probability ``quantized_rate(p)``,
    from ``generator`` (torch's default CPU generator when None).

    ``clamp(bits - (t - 1), 0, 1)`` is exactly ``bits >= t`` on integers, and several times faster
    on CPU than a comparison followed by a conversion.
    """
    *lead, m = shape
    words = torch.empty(*lead, (m + 3) // 4, dtype=torch.int64, device="cpu")  # the generator is a CPU one
    words.random_(-(2**63), None, generator=generator)
    bits = words.view(torch.int16)[..., :m]  # uniform over -2**15 .. 2**15 - 1
    threshold = round(p * 65536) - 32768  # a draw below this is dropped
    return bits.to(dtype).sub_(threshold - 1).clamp_(0.0, 1.0)


class Dropout(nn.Dropout):
    """``nn.Dropout``; in training on CPU the keep-mask comes from ``keep_mask`` (16-bit draws)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.inplace or x.device.type != "cpu" or not 0.0 < self.p < 1.0:
            return super().forward(x)
        mask = keep_mask(tuple(x.shape), self.p, x.dtype)
        return x * mask.mul_(1.0 / (1.0 - quantized_rate(self.p)))
