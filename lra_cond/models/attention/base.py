"""The attention contract every family implements.

Inits and the Jacobian probe act only through ``q_proj``/``k_proj``/``v_proj``/``out_proj``
(``nn.Linear``, torch layout ``weight[out, in]``), ``num_heads`` and ``head_dim``; head h owns rows
``h*head_dim:(h+1)*head_dim`` of the q/k/v weights. A family only supplies its kernel.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from einops import rearrange
from torch import nn

from lra_cond.errors import UserError


class Attention(nn.Module):
    """Multi-head attention skeleton: projections, head split/merge, and the kernel choice.

    Subclasses implement ``kernel`` (fast training path) and ``kernel_explicit`` (plain math that
    forward-mode AD and double-backward go through). Both take q, k, v of shape
    (batch, heads, seq, head_dim) and a key padding mask (batch, seq), True at padded positions.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if num_heads <= 0:
            raise UserError(f"num_heads must be positive, got {num_heads}")
        if head_dim is None:
            if dim % num_heads:
                raise UserError(
                    f"num_heads={num_heads} does not divide dim={dim}; choose num_heads among "
                    f"{[h for h in range(1, dim + 1) if dim % h == 0]} or set head_dim explicitly"
                )
            head_dim = dim // num_heads
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dropout = dropout
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(dim, inner, bias=bias)
        self.k_proj = nn.Linear(dim, inner, bias=bias)
        self.v_proj = nn.Linear(dim, inner, bias=bias)
        self.out_proj = nn.Linear(inner, dim, bias=bias)
        self.explicit = False

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        return rearrange(t, "b n (h d) -> b h n d", h=self.num_heads)

    def heads_output(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output before ``out_proj``, heads concatenated: (batch, seq, heads*head_dim)."""
        q, k, v = (self.split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        kernel = self.kernel_explicit if self.explicit else self.kernel
        out = kernel(q, k, v, key_padding_mask)
        return rearrange(out, "b h n d -> b n (h d)")

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.out_proj(self.heads_output(x, key_padding_mask))

    def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def kernel_explicit(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
        raise NotImplementedError

    @property
    def attn_dropout(self) -> float:
        return self.dropout if self.training else 0.0


def attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    """All attention layers of a model, in order, with their qualified names (a layer itself gives
    ``[("", layer)]``: ``named_modules`` starts with the module)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]


@contextmanager
def explicit_math(model: nn.Module):
    """Route every attention layer in ``model`` through its explicit math path."""
    layers = [m for _, m in attention_layers(model)]
    saved = [m.explicit for m in layers]
    for m in layers:
        m.explicit = True
    try:
        yield model
    finally:
        for m, s in zip(layers, saved):
            m.explicit = s
