"""The attention contract every family implements, and the family registry.

Inits and the Jacobian probe act only through ``q_proj``/``k_proj``/``v_proj``/``out_proj``
(``nn.Linear``, torch layout ``weight[out, in]``), ``num_heads`` and ``head_dim``; head h owns rows
``h*head_dim:(h+1)*head_dim`` of the q/k/v weights. A family is one file: a subclass
``class MyAttention(Attention, name="mine")`` registers itself under its name, declares its options
once (``options = {"eps": Option(1e-6, float, positive=True)}``: defaults, types and ranges, checked
here), and supplies its kernel. What the condition-number probe knows of a family's Jacobian (its
closed form and symmetries) lives with the probe, in ``lra_cond/conditioning/families/``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from einops import rearrange
from torch import nn

from lra_cond.errors import UserError
from lra_cond.registry import Registry

ATTENTIONS: Registry[type] = Registry("attention")
COMMON_OPTIONS = ("head_dim", "dropout", "bias")  # every family's, set through the encoder


@dataclass(frozen=True)
class Option:
    """One family option: its default and what it accepts (``kind`` int, float or bool; a
    ``minimum``, ``positive``, ``None`` allowed, and an extra ``check`` returning an error text)."""

    default: Any
    kind: type
    minimum: float | None = None
    positive: bool = False
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None

    def validate(self, family: str, name: str, value: Any) -> Any:
        if value is None and self.nullable:
            return None
        if self.kind is bool:
            ok, what = isinstance(value, bool), "true or false"
        elif self.kind is int:
            ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
        else:
            ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        if ok and self.positive:
            ok, what = value > 0, "a positive number"
        if ok and self.minimum is not None:
            ok, what = value >= self.minimum, f"{what} >= {self.minimum:g}"
        if not ok:
            raise UserError(f"{family} attention: {name} must be {what}, got {value!r}")
        problem = self.check(value) if self.check else None
        if problem:
            raise UserError(f"{family} attention: {problem}")
        return float(value) if self.kind is float else value


def masked_softmax(scores: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis (keys) of (batch, heads, queries, keys) scores, keys masked where
    ``key_mask`` (batch, keys) is True."""
    if key_mask is not None:
        scores = scores.masked_fill(key_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


class Attention(nn.Module):
    """Multi-head attention skeleton: projections, head split/merge, and the kernel choice.

    Subclasses implement ``kernel`` (fast training path) and ``kernel_explicit`` (plain math that
    forward-mode AD and double-backward go through). Both take q, k, v of shape
    (batch, heads, seq, head_dim) and a key padding mask (batch, seq), True at padded positions.
    A family's options are attributes of the layer once checked; ``build`` makes what they need.
    """

    name: ClassVar[str] = ""
    options: ClassVar[dict[str, Option]] = {}

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
            ATTENTIONS.add(name, cls)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            valid = [*COMMON_OPTIONS, *self.options]
            raise UserError(
                f"unknown option(s) {', '.join(unknown)} for attention '{self.name}'; "
                f"valid options: {', '.join(valid)}"
            )
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
        for key, option in self.options.items():
            setattr(self, key, option.validate(self.name, key, options.get(key, option.default)))
        self.build()

    def build(self) -> None:
        """Make what the family's options need (parameters, submodules); called once they are set."""

    def max_len_problem(self, max_len: int) -> str | None:
        """Why this layer's options do not suit a model of sequences up to ``max_len`` tokens (the
        encoder refuses to build it then), or None."""
        return None

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
