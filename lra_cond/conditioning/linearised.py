"""Step 1 of the probe: linearise the layer.

The function whose Jacobian is measured is one attention layer's pre-``out_proj`` output at the
real tokens of a fixed input, as a map from every parameter of its q/k/v projections. The layer is
a ``jacobian_copy`` (float64, eval, explicit math, projections W~ = [W | b] of the augmented input
x~ = [x, 1] when the layer has biases, at the limit its family is measured at), so the parameters
are the weights W~ only, laid out head by head, ``[W~_Q^h, W~_K^h, W~_V^h]`` (only the blocks asked
for), each flattened row-major from torch's ``weight[out, in]`` layout. Head h's output depends
only on its own rows of the three projections, so J is block diagonal over heads and its singular
values are the union of the heads'.

Each head's block is a ``HeadJacobian``: the blocks its family's closed form gave
(``conditioning/families/``: dense columns, per-token factors ``Factored``, or the value block
``ValueBlock`` = Y (x) I_d), or forward-mode AD for a family without one. Dense columns are formed
only where a step asks for them (a head's dense J is 8192 x 6240 at the ListOps reference shape);
J v goes through the blocks as they are.

Also here: the condition numbers of the projection weights themselves (``weight_conditions``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, jvp, vmap

from lra_cond.conditioning.families import FamilyJacobian, family_jacobian
from lra_cond.conditioning.families.base import (
    BLOCKS,
    Factored,
    HeadInputs,
    Part,
    ValueBlock,
    columns,
    family_jacobian_class,
    part_like,
    part_shape,
)
from lra_cond.errors import UserError
from lra_cond.linalg import matrix_condition
from lra_cond.models.attention.base import Attention


class HeadJacobian:
    """J (T d, len(blocks) d D') of one head, block b in columns b * d D' onwards (``blocks`` order)."""

    def __init__(
        self, parts: dict[str, Part], blocks: tuple[str, ...], full: torch.Tensor | None = None
    ) -> None:
        self.parts, self.blocks = parts, blocks
        t, self.d, self.dim = part_shape(parts[blocks[0]])
        self.size = self.d * self.dim
        self.shape = (t * self.d, len(blocks) * self.size)
        # dense column matrices formed so far, by the blocks they hold
        self._formed: list[tuple[tuple[str, ...], torch.Tensor]] = [] if full is None else [(blocks, full)]
        self.cache: dict = {}  # what the probe derives from this head once for all its scopes

    @classmethod
    def from_dense(cls, jac: torch.Tensor, blocks: tuple[str, ...], d: int, dim: int) -> HeadJacobian:
        """A Jacobian computed as one matrix (forward-mode AD): every block dense."""
        t = jac.shape[0] // d
        view = jac.reshape(t, d, len(blocks), d, dim)
        return cls({b: view[:, :, i] for i, b in enumerate(blocks)}, blocks, jac)

    @property
    def factors(self) -> dict[str, Factored]:
        """The blocks the family gave as factors."""
        return {b: p for b, p in self.parts.items() if isinstance(p, Factored)}

    def value_factor(self) -> torch.Tensor | None:
        """Y when the value block came as Y (x) I_d (else None: a caller may test the dense block)."""
        part = self.parts.get("v")
        return part.y if isinstance(part, ValueBlock) else None

    def block(self, b: str) -> torch.Tensor:
        """Block b's dense columns (T d, d D')."""
        return self.columns((b,))

    def columns(self, wanted: list[str] | tuple[str, ...]) -> torch.Tensor:
        """The dense columns of ``wanted`` blocks, in that order: a view of a matrix formed before
        when they are adjacent there (the whole one, or a family's support blocks), else formed once."""
        wanted = tuple(wanted)
        if not wanted:
            return part_like(self.parts[self.blocks[0]]).new_empty(self.shape[0], 0)
        for names, mat in self._formed:
            for start in range(len(names) - len(wanted) + 1):
                if names[start : start + len(wanted)] == wanted:
                    return mat[:, start * self.size : (start + len(wanted)) * self.size]
        mat = columns(self.parts, wanted)
        self._formed.append((wanted, mat))
        return mat

    def dense(self) -> torch.Tensor:
        return self.columns(self.blocks)

    def apply(self, v: torch.Tensor, wanted: list[str] | tuple[str, ...]) -> torch.Tensor:
        """J[:, wanted] v for v (len(wanted) d D', k), each block as the family gave it."""
        out = None
        for i, b in enumerate(wanted):
            vb = v[i * self.size : (i + 1) * self.size]
            part = self.parts[b]
            if isinstance(part, (Factored, ValueBlock)):
                prod = part @ vb
            elif part.is_contiguous():  # its (T, d, d, D') entries as (T d, d D'): a view
                prod = part.view(-1, self.size) @ vb
            else:  # a view into a matrix formed whole (``from_dense``)
                prod = self.block(b) @ vb
            out = prod if out is None else out + prod
        assert out is not None
        return out


BLOCK_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}
CHUNK_BYTES = 2**30  # memory budget for one batch of Jacobian-vector products (AD fallback)


def parse_blocks(blocks: str) -> tuple[str, ...]:
    letters = tuple(dict.fromkeys(blocks.lower()))
    if not letters or any(b not in BLOCK_NAMES for b in letters):
        raise UserError(f"blocks must combine the letters q, k, v (e.g. 'qkv'), got {blocks!r}")
    return tuple(b for b in BLOCKS if b in letters)


@dataclass
class LinearisedLayer:
    """A layer's ``jacobian_copy`` at a fixed (augmented) input, with the head-wise parameter layout."""

    layer: Attention
    x: torch.Tensor  # (B, N, D') float64
    mask: torch.Tensor | None  # (B, N) True at padded positions
    real: torch.Tensor  # (B, N) True at real (query) positions
    blocks: tuple[str, ...]
    family: FamilyJacobian  # what the layer's family knows of its Jacobian

    @property
    def num_heads(self) -> int:
        return self.layer.num_heads

    @property
    def head_dim(self) -> int:
        return self.layer.head_dim

    @property
    def dim(self) -> int:
        """D': the augmented input width the projections read."""
        return self.x.shape[-1]

    @property
    def num_tokens(self) -> int:
        return int(self.real.sum())

    @property
    def block_size(self) -> int:
        """Parameters of one block of one head (d_h x D')."""
        return self.head_dim * self.dim

    @property
    def head_size(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def num_params(self) -> int:
        return self.num_heads * self.head_size

    def weight(self, block: str) -> torch.Tensor:
        return getattr(self.layer, BLOCK_NAMES[block]).weight.detach()

    def head_weight(self, block: str, h: int) -> torch.Tensor:
        d = self.head_dim
        return self.weight(block)[h * d : (h + 1) * d]

    def sequences(self) -> list[torch.Tensor]:
        """Each sequence's real tokens (L_b, D'), in probe order."""
        return [self.x[b][self.real[b]] for b in range(self.x.shape[0])]

    def head_inputs(self, h: int, blocks: tuple[str, ...] | None = None) -> HeadInputs:
        w = {b: self.head_weight(b, h) for b in BLOCKS}
        return HeadInputs(self.sequences(), h, w, self.blocks if blocks is None else blocks)

    def head_jacobian(self, h: int, closed_form: bool = True) -> torch.Tensor:
        """Head h's Jacobian (T*d_h, head_size): the family's closed form, else forward-mode AD."""
        return self.head_jacobian_operator(h, closed_form).dense()

    def head_jacobian_operator(self, h: int, closed_form: bool = True) -> HeadJacobian:
        """Head h's Jacobian as the blocks the family gave (dense columns formed only on demand)."""
        parts = self.family.parts(self.head_inputs(h)) if closed_form else None
        if parts is None:
            return HeadJacobian.from_dense(self.ad_head_jacobian(h), self.blocks, self.head_dim, self.dim)
        return HeadJacobian(parts, self.blocks)

    def ad_head_jacobian(self, h: int) -> torch.Tensor:
        """Forward-mode AD through the explicit kernel, in memory-bounded chunks of columns."""
        f = self.head_function(h)
        theta_h = self.theta().reshape(self.num_heads, -1)[h]
        b, n = self.x.shape[:2]
        per_tangent = 8 * 6 * b * self.num_heads * n * max(n, self.dim)  # attention-sized temporaries
        chunk = max(1, min(theta_h.numel(), CHUNK_BYTES // per_tangent))
        eye = torch.eye(theta_h.numel(), dtype=theta_h.dtype, device=theta_h.device)
        column = vmap(lambda t: jvp(f, (theta_h,), (t,))[1])
        return torch.cat([column(eye[i : i + chunk]) for i in range(0, theta_h.numel(), chunk)]).T

    def theta(self) -> torch.Tensor:
        """The current parameters as one flat vector in the head-wise layout."""
        parts = [self.head_weight(b, h).reshape(-1) for h in range(self.num_heads) for b in self.blocks]
        return torch.cat(parts)

    def output(self, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pre-out_proj output at real query rows, (T, H*d_h); padded rows are not outputs."""
        out = functional_call(self.layer, weights, (self.x,), {"key_padding_mask": self.mask})
        return out[self.real]

    def head_function(self, h: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Head h's own parameters (flat) -> head h's output columns at real rows (flat)."""
        d = self.head_dim
        base = {b: self.weight(b) for b in self.blocks}

        def f(theta_h: torch.Tensor) -> torch.Tensor:
            chunks = theta_h.reshape(len(self.blocks), d, self.dim)
            weights = {
                f"{BLOCK_NAMES[b]}.weight": torch.cat([base[b][: h * d], chunks[i], base[b][(h + 1) * d :]])
                for i, b in enumerate(self.blocks)
            }
            return self.output(weights)[:, h * d : (h + 1) * d].reshape(-1)

        return f


def jacobian_copy(layer: Attention) -> Attention:
    """A float64, eval-mode, explicit-math copy whose q/k/v projections are the bias-free maps
    W~ = [W | b] of the augmented input [x, 1] (J over (W, b) is J over W~), at the options its
    family is measured at (``FamilyJacobian.measured_at``: linear attention's eps -> 0). Its
    ``out_proj`` is the identity: its output is the heads' output, before ``out_proj``."""
    out = copy.deepcopy(layer).to(torch.float64).eval()
    out.explicit = True
    out.out_proj = nn.Identity()
    for name in BLOCK_NAMES.values():
        old = getattr(out, name)
        weight = old.weight.detach()
        if old.bias is not None:
            weight = torch.cat([weight, old.bias.detach()[:, None]], 1)
        new = nn.Linear(*weight.shape[::-1], bias=False, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            new.weight.copy_(weight)
        setattr(out, name, new)
    for p in out.parameters():
        p.requires_grad_(False)
    for option, value in family_jacobian_class(out).measured_at.items():
        setattr(out, option, value)
    return out


def linearise(
    layer: Attention, x: torch.Tensor, key_padding_mask: torch.Tensor | None, blocks: str
) -> LinearisedLayer:
    """The layer's ``jacobian_copy`` at x (augmented with a ones column when the layer has biases);
    the caller's layer is never touched."""
    if not isinstance(layer, Attention):
        raise UserError(f"expected an attention layer (lra_cond Attention), got {type(layer).__name__}")
    if x.dim() == 2:
        x = x[None]
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.reshape(1, -1)
    if x.dim() != 3 or x.shape[-1] != layer.dim:
        raise UserError(f"x must be (batch, seq, {layer.dim}) — the layer's input — got {tuple(x.shape)}")
    if key_padding_mask is not None and key_padding_mask.shape != x.shape[:2]:
        raise UserError(
            f"key_padding_mask must be (batch, seq) = {tuple(x.shape[:2])}, "
            f"got {tuple(key_padding_mask.shape)}"
        )
    copy64 = jacobian_copy(layer).to(x.device)
    x64 = x.detach().to(torch.float64)
    if copy64.q_proj.in_features == layer.dim + 1:
        x64 = torch.cat([x64, torch.ones_like(x64[..., :1])], -1)
    mask = None if key_padding_mask is None else key_padding_mask.to(x.device).bool()
    real = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else ~mask
    return LinearisedLayer(copy64, x64, mask, real, parse_blocks(blocks), family_jacobian(copy64))


def weight_conditions(layer: Attention, blocks: tuple[str, ...] = ("q", "k", "v")) -> dict[str, dict]:
    """``{"q": {"stacked": kappa(W_Q), "heads": [kappa(W_Q^h) ...]}, ...}`` (torch layout, rows = outputs)."""
    d = layer.head_dim
    out: dict[str, dict] = {}
    for b in blocks:
        w = getattr(layer, f"{b}_proj").weight
        out[b] = {
            "stacked": matrix_condition(w),
            "heads": [matrix_condition(w[h * d : (h + 1) * d]) for h in range(layer.num_heads)],
        }
    return out
