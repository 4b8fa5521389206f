"""One head's Jacobian as the blocks its family gave: dense columns formed only where asked for.

A family's closed form gives each block dense, ``Factored`` (per-token factors) or as a
``ValueBlock`` (Y (x) I_d). The probe needs the dense columns only of blocks that come dense (or
for the ``dense`` method and the svdvals fallback); J v for the null-space check goes through the
blocks as they are. At the reference shape a head's dense J is 8192 x 6240 (409 MB): forming it
cost ~0.2 s per head and ~1.6 GB per layer for softmax and normalized attention, whose blocks all
come factored or as the value block.
"""

from __future__ import annotations

import torch

from lra_cond.conditioning import factored
from lra_cond.conditioning.families.base import Factored, Part, ValueBlock, columns, part_like, part_shape


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
            if isinstance(part, Factored):
                prod = factored.apply(part, vb, self.d)
            elif isinstance(part, ValueBlock):
                prod = part.apply(vb)
            elif part.is_contiguous():  # its (T, d, d, D') entries as (T d, d D'): a view
                prod = part.view(-1, self.size) @ vb
            else:  # a view into a matrix formed whole (``from_dense``)
                prod = self.block(b) @ vb
            out = prod if out is None else out + prod
        assert out is not None
        return out
