"""What the condition-number probe asks of an attention family, and the pieces families share.

The probe measures J = d vec(A_h) / d (W_Q^h, b_Q^h, W_K^h, b_K^h, W_V^h, b_V^h) per head: the
head's output before ``out_proj`` with respect to every parameter of its q/k/v projections. A
projection with a bias is the bias-free map W~ = [W | b] of the augmented input x~ = [x, 1], so a
family only ever sees bias-free projections of an input of width D' (D + 1 with biases, else D):
``linearised.jacobian_copy`` builds that float64 copy.

Columns of a head's Jacobian: one block per projection asked for (q, k, v order), each d x D'
flattened row-major from torch's ``weight[out, in]`` layout, entry (b, c) = d/d W~[b, c]. Rows:
(token, output coordinate a), tokens in probe order (sequence by sequence, real tokens only).

A family's file in this package subclasses ``FamilyJacobian`` (``class MyJacobian(FamilyJacobian,
family="mine")``, registered under the attention family's name) and may provide:
* ``parts(inp)``: that matrix in closed form, block by block, a block either dense
  ((T, d, d, D') tensor [i, a, b, c]), ``Factored`` (the probe then also forms its Gram matrix
  from the factors, T x d^2 x D'^2 instead of T d x (d D')^2) or a ``ValueBlock`` (Y (x) I_d,
  kept as Y); the probe forms dense columns only where it needs them, and falls back to
  forward-mode AD through the explicit kernel for a family without a closed form;
* ``support(inp)``: for blocks that reach the output only through a subspace, that subspace;
* ``symmetries(inp)``: candidate exact null directions of the Jacobian, by name, per block
  (the probe verifies every group numerically before it deflates it).
A family without a file is measured through forward-mode AD, with the input's null space only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lra_cond.linalg import Operator, null_vectors
from lra_cond.models.attention.base import Attention

BLOCKS = ("q", "k", "v")


@dataclass
class HeadInputs:
    """One head of a probe: per-sequence inputs (real tokens only) and the head's projection rows."""

    xs: list[torch.Tensor]  # per sequence (L_b, D') float64, augmented when the layer has biases
    h: int
    w: dict[str, torch.Tensor]  # "q" | "k" | "v" -> (d, D'), this head's rows of W~
    blocks: tuple[str, ...]  # which projections the Jacobian's columns cover, in q, k, v order

    @property
    def d(self) -> int:
        return self.w["q"].shape[0]

    @property
    def dim(self) -> int:
        return self.w["q"].shape[1]

    def projected(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (each (L, d)) of one sequence."""
        return x @ self.w["q"].T, x @ self.w["k"].T, x @ self.w["v"].T


@dataclass
class Support:
    """Blocks that reach a head's output only through a subspace: ``p`` (n_blocks * d * D', r), an
    orthonormal basis of a subspace holding every direction J sees through ``blocks``. The probe
    works on J_S P (the complement's n - r directions are null, checked numerically); a family
    that can form J_S P more cheaply than the product passes it as ``columns`` (also checked), and
    ``product``, M -> J_S P M, when it can apply it to other matrices M (r, k) that way too."""

    name: str
    blocks: tuple[str, ...]
    p: torch.Tensor
    columns: torch.Tensor | None = None  # (T * d, r): J_S P
    product: Callable[[torch.Tensor], torch.Tensor] | None = None
    # () -> (J_S P)^T (J_S P) by the family's structure, to a preconditioner's accuracy (it may
    # lose the small eigenvalues a Gram of the formed columns keeps)
    gram: Callable[[], torch.Tensor] | None = None


FAMILY_JACOBIANS: dict[str, type[FamilyJacobian]] = {}


class FamilyJacobian:
    """One family's Jacobian on a probe's ``jacobian_copy`` of a layer (one instance per probe, so
    ``cache`` holds what the probe's scopes share). This base knows no closed form, no support and
    no symmetry: the probe then uses forward-mode AD and the input's own null space."""

    # layer options the probe measures at (a limit of the layer's function), set on its copy
    measured_at: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, family: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if family is not None:
            FAMILY_JACOBIANS[family] = cls

    def __init__(self, layer: Attention) -> None:
        self.layer = layer
        self.cache: dict = {}

    def parts(self, inp: HeadInputs) -> dict[str, Part] | None:
        """Closed-form head Jacobian, block by block ({block: (T, d, d, D') tensor, ``Factored`` or
        ``ValueBlock``}), or None: forward-mode AD through ``kernel_explicit``."""
        return None

    def support(self, inp: HeadInputs) -> Support | None:
        """For blocks that reach the output only through a subspace: that subspace. The probe then
        works on J_S P: the complement's n - r directions are null (checked numerically)."""
        return None

    def symmetries(self, inp: HeadInputs) -> dict[str, dict[str, torch.Tensor]]:
        """Candidate exact null directions of the head Jacobian beyond the input's own null space:
        {group name: {block: (m, d, D') directions}}, only groups whose blocks are all in
        ``inp.blocks``. The probe keeps a group only after verifying it numerically."""
        return {}


def family_jacobian_class(layer: Attention) -> type[FamilyJacobian]:
    """The class registered under the layer's family name (the base one if none)."""
    return FAMILY_JACOBIANS.get(layer.name, FamilyJacobian)


def family_jacobian(layer: Attention) -> FamilyJacobian:
    """What the layer's family knows of its Jacobian, for one probe of this layer."""
    return family_jacobian_class(layer)(layer)


# ---------------------------------------------------------------- Jacobian blocks (L, d, d, D')
# A block's rows (i, a) and columns (b, c) are kept as a 4-index tensor [i, a, b, c] (or as its
# factors) until ``columns`` flattens them.


@dataclass
class DenseMixing(Operator):
    """A correction's left factor E (T d, r) given entry by entry, as (T, d, r): E[i, a, j]."""

    e: torch.Tensor
    _gram: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # every product reads E as (T d, r): a strided E (a broadcast product's layout) would be
        # copied on each of them
        self.e = self.e.contiguous()

    @property
    def rank(self) -> int:
        return self.e.shape[-1]

    @property
    def flat(self) -> torch.Tensor:  # E as (T d, r)
        return self.e.reshape(-1, self.rank)

    def __matmul__(self, m: torch.Tensor) -> torch.Tensor:  # E m, m (r, k) -> (T d, k)
        return self.flat @ m

    def matmul_t(self, y: torch.Tensor) -> torch.Tensor:  # E^T y, y (T d, k) -> (r, k)
        return self.flat.T @ y

    def rotated(self, u: torch.Tensor) -> DenseMixing:  # (U^T (x) I_d) E, U (T, r_u)
        t, d = self.e.shape[:2]
        return DenseMixing((u.T @ self.e.reshape(t, -1)).reshape(u.shape[1], d, -1))

    def cross(
        self, other: Mixing, m: torch.Tensor, add_to: torch.Tensor | None = None, alpha: float = 1.0
    ) -> torch.Tensor:  # E^T E' m, or add_to + alpha E^T E' m
        if not isinstance(other, DenseMixing):
            return _added(self.T @ (other @ m), add_to, alpha)
        # through the r x r' Gram (kept for E^T E): T d r r' + r r' k flops where E^T (E' m) takes
        # T d (r + r') k (k = d D')
        if other is self:
            if self._gram is None:
                self._gram = self.flat.T @ self.flat
            g = self._gram
        else:
            g = self.flat.T @ other.flat
        return g @ m if add_to is None else torch.addmm(add_to, g, m, alpha=alpha)

    def dense(self) -> torch.Tensor:
        return self.e

    @staticmethod
    def cat(parts: list[DenseMixing]) -> DenseMixing:
        """Block diagonal: each sequence's correction stays within its own rows."""
        es = [p.e for p in parts]
        e = es[0].new_zeros(sum(x.shape[0] for x in es), es[0].shape[1], sum(x.shape[2] for x in es))
        i = j = 0
        for x in es:
            e[i : i + x.shape[0], :, j : j + x.shape[2]] = x
            i, j = i + x.shape[0], j + x.shape[2]
        return DenseMixing(e)


def _added(out: torch.Tensor, add_to: torch.Tensor | None, alpha: float) -> torch.Tensor:
    return out if add_to is None else torch.add(add_to, out, alpha=alpha)


@dataclass
class TokenMixing(Operator):
    """E = F (x) I_d: E[(i, a), (j, a')] = F[i, j] delta_aa' for F (T, m), rank m d (columns (j, a'),
    j-major). Token i's output sees the correction only through a mixture of m rows of d
    (Nyström's F = softmax(Q K~^T) over the landmarks): every product costs T m d k where a dense
    E of that rank costs T d m d k, and nothing of size T d x m d is formed."""

    f: torch.Tensor
    d: int

    @property
    def rank(self) -> int:
        return self.f.shape[1] * self.d

    def __matmul__(self, m: torch.Tensor) -> torch.Tensor:
        k = m.shape[1]
        return (self.f @ m.reshape(self.f.shape[1], -1)).reshape(-1, k)

    def matmul_t(self, y: torch.Tensor) -> torch.Tensor:
        k = y.shape[1]
        return (self.f.T @ y.reshape(self.f.shape[0], -1)).reshape(-1, k)

    def rotated(self, u: torch.Tensor) -> TokenMixing:
        return TokenMixing(u.T @ self.f, self.d)

    def cross(
        self, other: Mixing, m: torch.Tensor, add_to: torch.Tensor | None = None, alpha: float = 1.0
    ) -> torch.Tensor:  # as ``DenseMixing.cross``; the sum in the same pass (one write of r x k)
        if not isinstance(other, TokenMixing):
            return _added(self.T @ (other @ m), add_to, alpha)
        k = m.shape[1]  # (F^T F' (x) I) m: m^2 d k flops
        g, flat = self.f.T @ other.f, m.reshape(other.f.shape[1], -1)
        if add_to is None:
            return (g @ flat).reshape(-1, k)
        return torch.addmm(add_to.reshape(self.f.shape[1], -1), g, flat, alpha=alpha).reshape(-1, k)

    def dense(self) -> torch.Tensor:
        eye = torch.eye(self.d, dtype=self.f.dtype, device=self.f.device)
        return torch.einsum("ij,ab->iajb", self.f, eye).reshape(self.f.shape[0], self.d, -1)

    @staticmethod
    def cat(parts: list[TokenMixing]) -> TokenMixing:
        return TokenMixing(torch.block_diag(*[p.f for p in parts]), parts[0].d)


Mixing = DenseMixing | TokenMixing


@dataclass
class Factored(Operator):
    """A block that factors per token: ``query_local``: [i, a, b, c] = left[i, a, b] right[i, c]
    (a projection row i's output sees only through its own projection, dA_i = G_i dW x_i);
    ``outer``: [i, a, b, c] = left[i, b] right[i, a, c] (softmax's keys: q_i[b] R_i[a, c]).
    ``low_rank`` (E, Z) adds sum_j E[(i, a), j] Z[j, b, c], a correction of rank r (E a ``Mixing``
    (T d, r), Z (r, d, D')): normalized attention's keys, whose normalisation couples each key's own
    direction into every query's row (E dense, (T, d, r); a tensor is taken as that), and
    Nyström's queries and keys, which reach every token through the landmarks (E = F (x) I_d)."""

    kind: str  # "query_local" | "outer"
    left: torch.Tensor
    right: torch.Tensor
    low_rank: tuple[Mixing, torch.Tensor] | None = None
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # products of the factors

    def __post_init__(self) -> None:
        if self.low_rank is not None and isinstance(self.low_rank[0], torch.Tensor):
            self.low_rank = (DenseMixing(self.low_rank[0]), self.low_rank[1])

    @property
    def base(self) -> Factored:
        """The per-token part alone (without ``low_rank``)."""
        return self if self.low_rank is None else Factored(self.kind, self.left, self.right)

    def dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "query_local":
            out = query_local(self.left, self.right, out)
        else:
            out = outer_right(self.left, self.right, out)
        if self.low_rank is not None:
            mix, z = self.low_rank
            out += (mix @ z.reshape(z.shape[0], -1)).reshape(out.shape)
        return out

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        """J v for v (d p, k), as (T d, k): per token d x d and d x p products, never the block."""
        t, d, p, k = self.left.shape[0], self.left.shape[-1], self.right.shape[-1], v.shape[1]
        v3 = v.reshape(d, p, k)
        if self.kind == "query_local":  # G_i (V x_i): W[i, b] = sum_c x_i[c] V[b, c]
            w = torch.einsum("ic,bck->ibk", self.right, v3)
            out = (self.left @ w).reshape(t * d, k)
        else:
            w = torch.einsum("ib,bck->ick", self.left, v3)  # R_i (V^T q_i)
            out = (self.right @ w).reshape(t * d, k)
        if self.low_rank is not None:
            mix, z = self.low_rank
            out = out + mix @ (z.reshape(z.shape[0], -1) @ v)
        return out

    def matmul_t(self, y: torch.Tensor) -> torch.Tensor:
        """J^T y for y (T d, k), as (d p, k)."""
        t, d, k = self.left.shape[0], self.left.shape[-1], y.shape[1]
        y3 = y.reshape(t, d, k)
        if self.kind == "query_local":  # sum_i x_i[c] (G_i^T y_i)[b]
            out = torch.einsum("ic,ibk->bck", self.right, self.left.transpose(1, 2) @ y3).reshape(-1, k)
        else:
            out = torch.einsum("ib,ick->bck", self.left, self.right.transpose(1, 2) @ y3).reshape(-1, k)
        if self.low_rank is not None:
            mix, z = self.low_rank
            out = out + z.reshape(z.shape[0], -1).T @ (mix.T @ y)
        return out

    @staticmethod
    def cat(parts: list[Factored]) -> Factored:
        """Every sequence's rows; a correction of each stays within its own rows (block diagonal)."""
        low_rank = None
        if parts[0].low_rank is not None:
            mixes = [p.low_rank[0] for p in parts]  # type: ignore[index]
            low_rank = (type(mixes[0]).cat(mixes), torch.cat([p.low_rank[1] for p in parts]))  # type: ignore[index,arg-type]
        return Factored(
            parts[0].kind, torch.cat([p.left for p in parts]), torch.cat([p.right for p in parts]), low_rank
        )


def query_local(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[i, a, b, c] = G_i[a, b] x_i[c]: the block of a projection row i's output sees only through
    its own projection (dA_i = G_i dW x_i). ``out``: written there (any strides)."""
    return torch.mul(g[:, :, :, None], x[:, None, None, :], out=out)


def outer_right(u: torch.Tensor, r: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[i, a, b, c] = u_i[b] R_i[a, c] (e.g. softmax's key block: dA_i/dW_K[b, c] = q_i[b] R_i[:, c])."""
    return torch.mul(u[:, None, :, None], r[:, :, None, :], out=out)


@dataclass
class ValueBlock(Operator):
    """[i, a, b, c] = delta_ab Y[i, c]: the value block of every A = P V family (Y = P X), kept as Y
    (T x D' numbers instead of T d x d D': the probe eliminates this block in closed form)."""

    y: torch.Tensor
    d: int

    def dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        eye = torch.eye(self.d, dtype=self.y.dtype, device=self.y.device)
        return torch.mul(eye[None, :, :, None], self.y[:, None, None, :], out=out)

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        """(Y (x) I_d) v for v (d D', k), as (T d, k): row (t, a) = sum_c Y[t, c] V[a, c]."""
        t, dim = self.y.shape
        return torch.einsum("tc,ack->tak", self.y, v.reshape(self.d, dim, -1)).reshape(t * self.d, -1)


def value_block(y: torch.Tensor, d: int) -> ValueBlock:
    """The value block of A = P V for Y = P X."""
    return ValueBlock(y, d)


Part = torch.Tensor | Factored | ValueBlock


def dense(part: Part) -> torch.Tensor:
    """A block as its (T, d, d, D') entries."""
    return part if isinstance(part, torch.Tensor) else part.dense()


def part_shape(part: Part) -> tuple[int, int, int]:
    """(T, d, D') of a block."""
    if isinstance(part, Factored):
        return part.left.shape[0], part.left.shape[-1], part.right.shape[-1]
    if isinstance(part, ValueBlock):
        return part.y.shape[0], part.d, part.y.shape[1]
    return part.shape[0], part.shape[1], part.shape[-1]


def part_like(part: Part) -> torch.Tensor:
    """A tensor of the block's dtype and device."""
    return part.left if isinstance(part, Factored) else part.y if isinstance(part, ValueBlock) else part


def columns(parts: dict[str, Part], blocks: tuple[str, ...]) -> torch.Tensor:
    """{block: (L, d, d, D'), Factored or ValueBlock} -> (L*d, len(blocks)*d*D'), blocks in
    ``blocks`` order. Each block is written in place into its columns (no per-block temporaries to
    concatenate)."""
    t, d, dim = part_shape(parts[blocks[0]])
    out = part_like(parts[blocks[0]]).new_empty(t, d, len(blocks), d, dim)
    for i, b in enumerate(blocks):
        part = parts[b]
        if isinstance(part, torch.Tensor):
            out[:, :, i] = part
        else:
            part.dense(out=out[:, :, i])
    return out.reshape(t * d, -1)


def stack_sequences(per_sequence: list[Part]) -> Part:
    """Rows of every sequence, in probe order."""
    if len(per_sequence) == 1:
        return per_sequence[0]  # one probe sequence (the usual case): no copy of the block
    first = per_sequence[0]
    if isinstance(first, Factored):
        return Factored.cat(per_sequence)  # type: ignore[arg-type]
    if isinstance(first, ValueBlock):
        return ValueBlock(torch.cat([p.y for p in per_sequence]), first.d)  # type: ignore[union-attr]
    return torch.cat(per_sequence, 0)  # type: ignore[arg-type]


def pair_means(p: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_j P_ij u_j w_j^T for every i, as one matmul: (I, U, W)."""
    outer = (u[:, :, None] * w[:, None, :]).reshape(u.shape[0], -1)
    return (p @ outer).reshape(p.shape[0], u.shape[1], w.shape[1])


def softmax_query_factor(p: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """G_i = d(sum_j P_ij v_j) / d q_i for P = softmax(scale * q k^T): scale * (sum_j P_ij v_j k_j^T
    - a_i kbar_i^T), (I, d_v, d_k). From dP_i = (diag P_i - P_i P_i^T) ds_i."""
    a, k_bar = p @ v, p @ k
    return scale * (pair_means(p, v, k) - a[:, :, None] * k_bar[:, None, :])


def softmax_key_factor(p: torch.Tensor, v: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """R_i with d(sum_j P_ij v_j) / d W_K[b, c] = q_i[b] R_i[:, c] for keys k_j = W_K x_j:
    scale * (sum_j P_ij v_j x_j^T - a_i xbar_i^T), (I, d_v, D')."""
    a, x_bar = p @ v, p @ x
    return scale * (pair_means(p, v, x) - a[:, :, None] * x_bar[:, None, :])


def attention_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


# ---------------------------------------------------------------- symmetry generators
# Each returns {block: (m, d, D')} directions (m candidates) for the blocks present.


def rows_equal(vectors: torch.Tensor, d: int) -> torch.Tensor:
    """Directions "row a of the d x D' block = w" for every a and every column w of ``vectors``
    (D', r): the u w^T directions, (r*d, d, D')."""
    eye = torch.eye(d, dtype=vectors.dtype, device=vectors.device)
    return torch.einsum("ai,vD->vaiD", eye, vectors.T).reshape(-1, d, vectors.shape[0])


def gauge(w_q: torch.Tensor, w_k: torch.Tensor) -> dict[str, torch.Tensor]:
    """(W_Q, W_K) -> (M W_Q, M^-T W_K): scores q.k see queries and keys only through inner products.
    Tangents (E W_Q, -E^T W_K) for E = e_a e_c^T: d^2 directions."""
    d, dim = w_q.shape
    eye = torch.eye(d, dtype=w_q.dtype, device=w_q.device)
    dq = torch.einsum("ai,cD->aciD", eye, w_q).reshape(-1, d, dim)
    dk = -torch.einsum("ic,aD->aciD", eye, w_k).reshape(-1, d, dim)
    return {"q": dq, "k": dk}


def orthogonal_gauge(w_q: torch.Tensor, w_k: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rotations of q and k together (E antisymmetric): d(d-1)/2 directions (E W_Q, E W_K)."""
    d = w_q.shape[0]
    es = []
    for a in range(d):
        for c in range(a + 1, d):
            e = torch.zeros(d, d, dtype=w_q.dtype, device=w_q.device)
            e[a, c], e[c, a] = 1.0, -1.0
            es.append(e)
    if not es:
        return {}
    e = torch.stack(es)
    return {"q": e @ w_q, "k": e @ w_k}


def key_shift(xs: list[torch.Tensor], d: int, rtol: float) -> torch.Tensor:
    """Softmax over the keys of a sequence ignores a shift common to all of them: dW_K = u w^T with
    x_j . w constant within every sequence (the bias column, and 1/gamma after a LayerNorm).
    Returns the K-block directions (r*d, d, D')."""
    centred = torch.cat([x - x.mean(0, keepdim=True) for x in xs if x.shape[0]])
    return rows_equal(null_vectors(centred, rtol), d)


def scale(w: torch.Tensor) -> torch.Tensor:
    """The direction W itself (a kernel that normalises the projected vectors ignores their scale)."""
    return w[None]
