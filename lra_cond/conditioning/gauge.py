"""The whole head's Q/K null space in closed form, when it is the gauge plus input-side directions.

Scores that see queries and keys only through inner products (softmax, nystrom) leave the gauge
{(M A, -M^T B)} null (A = W~_Q, B = W~_K, M any d x d), and an input direction w that the scores
cannot see (a null direction of the inputs, a key shift) leaves every u w^T null in its block. When a
head's verified groups are exactly these (``NullStructure``), the orthogonal complement of their span
has an orthonormal basis in closed form, with Kronecker structure:

* per block, the input side splits into the null inputs W_b, the gauge's own input directions (the
  rows of A_b = W~_b (I - W_b W_b^T), by its SVD A_b = U_b S_b Vh_b) and the rest, ``perp`` (free
  of null directions: kept whole, as in ``deflation.deflation``);
* on the gauge's directions (d x d coordinates per block: output b, input Vh_b row c) the gauge is
  (M U_Q S_Q, -M^T U_K S_K), and its complement is spanned by the d^2 orthonormal columns
      (alpha_ij u^K_j (x) vh^Q_i,  beta_ij u^Q_i (x) vh^K_j),
      alpha_ij = s^K_j / r_ij,  beta_ij = s^Q_i / r_ij,  r_ij = (s^Q_i^2 + s^K_j^2)^(1/2):
  their inner product with a gauge direction is (alpha_ij s^Q_i - beta_ij s^K_j) u^K_j^T M u^Q_i = 0.

Because the gauge is null, the K half of each column moves J as a multiple of its Q half does: the
complement's columns of J are one block's factors transformed by a Kronecker product
(``factor``: J_Q (U_K (x) Vh_Q^T)), reindexed and scaled (``scale``): their Grams cost T d^4 from
the factors, where the Householder complement of a dense null basis
(~2200 x 1100 at the reference shape) and its congruences cost ~15 GMAC per head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lra_cond.conditioning import factored
from lra_cond.conditioning.families.base import Factored
from lra_cond.linalg import RANK_RTOL, gram, kron_left, matvec, null_vectors

GAUGE_RTOL = 1e-10  # a group is the gauge (or input-side) when its directions fit that form to this
INDEPENDENT_RTOL = 1e-8  # the gauge's input directions must be independent of the null inputs


@dataclass
class NullStructure:
    """A scope's null space outside V as closed-form groups: the gauge of (W~_Q, W~_K), if verified,
    and per block an orthonormal basis of its null inputs W_b (every u w^T, w in span W_b, null)."""

    gauge: tuple[torch.Tensor, torch.Tensor] | None = None
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def row_space(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal bases (span, complement) of the span of ``rows`` (n, D') and of its orthogonal
    complement, from the eigenvectors of rows^T rows (eigenvalues above 1e-10 of the largest)."""
    lam, vecs = torch.linalg.eigh(rows.T @ rows)
    inside = lam > 1e-10 * max(float(lam[-1]), 1e-300)
    return vecs[:, inside], vecs[:, ~inside]


def input_side(directions: torch.Tensor) -> torch.Tensor | None:
    """For one block's directions (m, d, D'): an orthonormal basis W (D', t) when they span exactly
    {u w^T : w in span W} (m = d t independent directions), else None."""
    m, d, dim = directions.shape
    span = row_space(directions.reshape(m * d, dim))[0]
    if m != d * span.shape[1]:
        return None
    flat = directions.reshape(m, -1)
    g = flat @ flat.T
    lam_g = torch.linalg.eigvalsh(g)
    return span if float(lam_g[0]) > 1e-10 * float(lam_g[-1]) else None


def gauge_maps(
    dq: torch.Tensor, dk: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor
) -> torch.Tensor | None:
    """The M_i (m, d, d) when every direction (dq_i, dk_i) is (M_i W_Q, -M_i^T W_K), any number of
    them (part of the gauge: normalized attention's rotations, M antisymmetric), else None."""
    m = dq @ torch.linalg.pinv(w_q)  # (m, d, d): the least-squares M_i
    fit_q = (dq - m @ w_q).norm() <= GAUGE_RTOL * dq.norm()
    fit_k = (dk + m.transpose(1, 2) @ w_k).norm() <= GAUGE_RTOL * max(float(dk.norm()), 1e-300)
    return m if bool(fit_q and fit_k) else None


def is_unit_basis(m: torch.Tensor) -> bool:
    """Whether the M_i are the unit matrices E_ac in ``jac.gauge``'s order (index a d + c): an
    orthonormal set, so each one's distance to the span of the others is 1."""
    d = m.shape[-1]
    eye = torch.eye(d * d, dtype=m.dtype, device=m.device).reshape(d * d, d, d)
    return float((m - eye).norm()) <= 1e-8 * d


def pivot_bound(structure: NullStructure) -> float:
    """A lower bound on what ``linalg.span_union``'s independence test measures for a gauge whose M_i
    are an orthonormal set (``is_unit_basis``), joined after the null inputs: each direction's
    distance to the span of the null inputs' directions and of the gauge's before it, over its own
    norm. The test forms the Gram of those directions (~4160 x 1024 per head at the reference
    shape, 0.2 s); this bound costs four d x D' SVDs.

    The gauge is L(M) = (M A_Q, -M^T A_K), with ||L(M)|| <= hi ||M||, hi^2 = s_max(A_Q)^2 +
    s_max(A_K)^2. Off the null inputs' {u w^T : w in span W_b} it is (M A'_Q, -M^T A'_K), A'_b =
    A_b (I - W_b W_b^T), of norm >= lo ||M||, lo^2 = s_min(A'_Q)^2 + s_min(A'_K)^2. So that
    distance, over the norm, is at least lo / hi times M_i's distance to the span of the others: 1."""
    lo = hi = 0.0
    for b, a in zip("qk", structure.gauge or ()):
        w = structure.inputs.get(b)
        s_proj = torch.linalg.svdvals(a if w is None else a - (a @ w) @ w.T)
        lo, hi = lo + float(s_proj[-1]) ** 2, hi + float(torch.linalg.svdvals(a)[0]) ** 2
    return math.sqrt(lo / hi) if hi > 0 else 0.0


@dataclass
class GaugeComplement:
    """An orthonormal basis of the complement of the gauge and the null inputs, per block (q, k):
    ``perp`` (D', p_b) input directions kept whole, ``rows`` (D', d) the gauge's input directions
    (Vh_b^T); and the d^2 columns on the latter, (alpha_ij u^K_j (x) e_i, beta_ij u^Q_i (x) e_j)."""

    perp: list[torch.Tensor]
    rows: list[torch.Tensor]
    u: tuple[torch.Tensor, torch.Tensor]  # (U_Q, U_K)
    alpha: torch.Tensor  # (d, d) [i, j]
    beta: torch.Tensor

    @property
    def d(self) -> int:
        return self.alpha.shape[0]

    def comp(self) -> ComplementColumns:
        """The d^2 columns on the blocks' ``rows`` coordinates (rows (b, c): output b, input
        ``rows[:, c]``), (2 d^2, d^2), as an operator: never formed (``ComplementColumns``)."""
        return ComplementColumns(self)

    def factor(self, fs: list[Factored]) -> Factored:
        """J_Q (U_K (x) Vh_Q^T) (columns (j, i)): the complement's columns of J, up to ``scale``.

        The gauge is null, so J_Q(M^T W~_Q) = J_K(M W~_K) for every M, and on the gauge's input
        directions (the null inputs' part of W~_b is null too) J_K(u^Q_i (x) vh^K_j) =
        (s^Q_i / s^K_j) J_Q(u^K_j (x) vh^Q_i): column (i, j) of the complement is
        (alpha_ij + beta_ij s^Q_i / s^K_j) J_Q(u^K_j (x) vh^Q_i) = J_Q(u^K_j (x) vh^Q_i) / alpha_ij.
        One block's factor, not two: the complement's Grams with K need K's perp columns only."""
        return factored.preconditioned(fs[0], self.u[1], self.rows[0])

    def scale(self, m: torch.Tensor) -> torch.Tensor:
        """M comp from M's products with ``factor``'s columns (n, d^2): reindexed (j, i) -> (i, j)
        and divided by alpha (``factor``)."""
        d = self.d
        return m.reshape(-1, d, d).transpose(1, 2).reshape(m.shape[0], d * d) / self.alpha.reshape(-1)

    def gram(self, g: torch.Tensor) -> torch.Tensor:
        """comp^T G comp from G, the Gram of ``factor``'s columns (d^2, d^2)."""
        return self.scale(self.scale(g).T)


class ComplementColumns:
    """``GaugeComplement.comp``'s columns applied through U_Q, U_K and the scales, never formed: on Q's rows
    coordinates (b, c) column (i, j) is alpha_ij U_K[b, j] [c = i], on K's beta_ij U_Q[b, i] [c = j],
    so a product with k columns costs ~4 d^3 k flops where the dense (2 d^2, d^2) matrix reads 2 d^4
    entries (16.8 MB at d = 32), twice per product of a whole head's exact rows."""

    def __init__(self, complement: GaugeComplement, transposed: bool = False) -> None:
        self.c, self.transposed = complement, transposed
        d = complement.d
        self.shape = (d * d, 2 * d * d) if transposed else (2 * d * d, d * d)

    @property
    def T(self) -> ComplementColumns:  # noqa: N802 (reads like a tensor's)
        return ComplementColumns(self.c, not self.transposed)

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        d, k, (u_q, u_k) = self.c.d, v.shape[1], self.c.u
        if self.transposed:  # [(b, c) on Q | (b, c) on K] -> (i, j)
            on_q = (u_k.T @ v[: d * d].reshape(d, -1)).view(d, d, k).transpose(0, 1)  # [i, j, k]
            on_k = (u_q.T @ v[d * d :].reshape(d, -1)).view(d, d, k)  # [i, j, k]
            return (on_q * self.c.alpha[:, :, None] + on_k * self.c.beta[:, :, None]).reshape(d * d, k)
        v3 = v.reshape(d, d, k)  # [i, j, k]
        on_q = u_k @ (v3 * self.c.alpha[:, :, None]).transpose(0, 1).reshape(d, -1)  # [b, (c = i, k)]
        on_k = u_q @ (v3 * self.c.beta[:, :, None]).reshape(d, -1)  # [b, (c = j, k)]
        return torch.cat([on_q, on_k]).reshape(2 * d * d, k)


def complement(
    structure: NullStructure, blocks: list[str], k: int, d: int, dim: int
) -> GaugeComplement | None:
    """The closed-form complement for a null space of rank ``k`` over ``blocks``, or None when it
    does not apply: no gauge, other blocks, a rank other than d^2 + d (t_Q + t_K) (other groups, or
    directions shared between them), or gauge input directions that (nearly) lie among the null
    inputs (the caller then deflates the dense basis)."""
    if structure.gauge is None or blocks != ["q", "k"]:
        return None
    like = structure.gauge[0]
    inputs = [structure.inputs.get(b, like.new_zeros(dim, 0)) for b in blocks]
    if k != d * d + d * sum(w.shape[1] for w in inputs):
        return None
    perps, rows, us, ss = [], [], [], []
    for w, a in zip(inputs, structure.gauge):
        a_proj = a - (a @ w) @ w.T
        u, s, vh = torch.linalg.svd(a_proj, full_matrices=False)
        if float(s[-1]) <= INDEPENDENT_RTOL * float(s[0]):
            return None
        q = torch.linalg.qr(torch.cat([w, vh.T], 1), mode="complete").Q
        perps.append(q[:, w.shape[1] + d :])
        rows.append(vh.T)
        us.append(u)
        ss.append(s)
    s_q, s_k = ss
    r = torch.sqrt(s_q[:, None] ** 2 + s_k[None, :] ** 2)
    return GaugeComplement(perps, rows, (us[0], us[1]), s_k[None, :] / r, s_q[:, None] / r)


@dataclass
class GaugeProjector:
    """The orthogonal projector onto span{T^T (M W_Q, -M^T W_K) : M in span(M_i)} for a Kronecker
    preconditioner T = diag(L_Q (x) W, L_K (x) W) on the [Q | K] coordinates, in closed form.

    With P_b = W_b W and the row-major vec, the map vec(M) -> T^T (M W_Q, -M^T W_K) is
    Mmap = [L_Q^T (x) P_Q^T ; -(L_K^T (x) P_K^T) Pi] (Pi: vec(M) -> vec(M^T)), so
    Mmap^T Mmap = L_Q L_Q^T (x) P_Q P_Q^T + P_K P_K^T (x) L_K L_K^T, and the projector onto
    Mmap S (S: the M_i as columns) is Mmap X Mmap^T, X = S (S^T Mmap^T Mmap S)^-1 S^T (d^2 x d^2):
    each of its blocks a Kronecker congruence of X (~(d D')^2 (d + D') flops each), where the same
    projector from an orthonormal basis of Mmap S costs a rank-m update of the (2 d D')^2 Gram
    (~11 GFLOP at the reference shape, m = 496)."""

    blocks: tuple[torch.Tensor, torch.Tensor]  # (L_Q, L_K), the output sides
    inputs: tuple[torch.Tensor, torch.Tensor]  # (P_Q, P_K) = (W_Q W, W_K W), (d, D') each
    x: torch.Tensor  # (d^2, d^2)

    @classmethod
    def of(
        cls, maps: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor], t: tuple[torch.Tensor, ...]
    ) -> GaugeProjector | None:
        """``maps`` (m, d, d) the M_i, ``w`` (W_Q, W_K), ``t`` (L_Q, W, L_K, W) the preconditioner;
        None when the M_i's images are not numerically independent (then no closed form)."""
        l_q, in_q, l_k, in_k = t
        p_q, p_k = w[0] @ in_q, w[1] @ in_k
        d = l_q.shape[0]
        a_q, b_q, a_k, b_k = l_q @ l_q.T, p_q @ p_q.T, l_k @ l_k.T, p_k @ p_k.T
        # Mmap^T Mmap vec(M) = vec(A_Q M B_Q + B_K M A_K), per M_i: no d^2 x d^2 matrix formed
        image = (torch.matmul(a_q, maps) @ b_q + torch.matmul(b_k, maps) @ a_k).reshape(-1, d * d)
        s = maps.reshape(maps.shape[0], d * d)
        chol, info = torch.linalg.cholesky_ex(s @ image.T)
        if int(info):
            return None
        half = torch.linalg.solve_triangular(chol, s, upper=False)  # X = half^T half
        return cls((l_q, l_k), (p_q, p_k), half.T @ half)

    @property
    def d(self) -> int:
        return self.blocks[0].shape[0]

    def _swap(self, m: torch.Tensor, rows: bool) -> torch.Tensor:
        """Pi m (``rows``) or m Pi, for the d^2 index (a, e) -> (e, a)."""
        d = self.d
        if rows:
            return m.reshape(d, d, -1).transpose(0, 1).reshape(d * d, -1)
        return m.reshape(-1, d, d).transpose(1, 2).reshape(m.shape[0], d * d)

    def block(self, i: int, j: int) -> torch.Tensor:
        """Block (i, j) of the projector (0: Q, 1: K), (d D')^2."""
        x = self.x
        if j == 1:
            x = -self._swap(x, rows=False)
        if i == 1:
            x = -self._swap(x, rows=True)
        d, (l_i, l_j), (p_i, p_j) = self.d, (self.blocks[i], self.blocks[j]), (self.inputs[i], self.inputs[j])
        # x[(a, e), (a', e')]: the output sides on the d^2 x d^2 matrix first, then each input side
        # (measured 13 against 19 ms for the congruence's two sides taken in turn)
        y = torch.matmul(l_j.T, (l_i.T @ x.reshape(d, -1)).reshape(d * d, d, d))  # (i e, i', e')
        y = torch.matmul(p_i.T, (y.reshape(-1, d) @ p_j).reshape(d, d, -1))  # (i, c, i' c')
        return y.reshape(d * p_i.shape[1], d * p_j.shape[1])

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        """The projector times v ((2 d D', k), [Q | K])."""
        n = v.shape[0] // 2
        d, (l_q, l_k), (p_q, p_k) = self.d, self.blocks, self.inputs
        u = kron_left(v[:n], l_q.T, p_q.T, d) - self._swap(kron_left(v[n:], l_k.T, p_k.T, d), rows=True)
        z = self.x @ u
        return torch.cat([kron_left(z, l_q, p_q, d), -kron_left(self._swap(z, rows=True), l_k, p_k, d)])


@dataclass
class MetricRoot:
    """The symmetric square root S of M = I - Y C^-1 Y^T (C - Y^T Y positive semidefinite:
    0 < M <= I) and its inverse, each applied in O(n r) through Y and an r x r core:
    S^(+-1) = I + Y A_(+-) Y^T, A_(+-) = R^-1 V diag((1 - lam)^(+-1/2) - 1) V^T R^-T, from
    Y^T Y = R^T R and R C^-1 R^T = V diag(lam) V^T (Y R^-1 V orthonormal: M = I - Y R^-1 V diag(lam)
    V^T R^-T Y^T)."""

    y: torch.Tensor  # (n, r)
    plus: torch.Tensor  # (r, r) A_+
    minus: torch.Tensor  # (r, r) A_-
    floor: float  # M's smallest eigenvalue, 1 - max lam

    @classmethod
    def of(cls, y: torch.Tensor, extra: torch.Tensor) -> MetricRoot | None:
        """C = Y^T Y + ``extra`` (positive semidefinite); None when Y's columns are not independent."""
        g = gram(y)
        r, info = torch.linalg.cholesky_ex(g, upper=True)
        if int(info):
            return None
        half = torch.linalg.solve_triangular(torch.linalg.cholesky(g + extra), r.T, upper=False)
        lam, vecs = torch.linalg.eigh(half.T @ half)  # R C^-1 R^T = half^T half
        lam = lam.clamp(0.0, 1.0)
        w = torch.linalg.solve_triangular(r, vecs, upper=True)  # R^-1 V
        root = torch.sqrt(1 - lam)
        core = lambda f: (w * f) @ w.T  # noqa: E731
        return cls(y, core(root - 1), core(1 / root.clamp_min(1e-300) - 1), float(root[-1] ** 2))

    def root(self, v: torch.Tensor) -> torch.Tensor:  # S v
        return v + matvec(self.y, self.plus @ matvec(self.y.T, v))

    def inverse_root(self, v: torch.Tensor) -> torch.Tensor:  # S^-1 v
        return v + matvec(self.y, self.minus @ matvec(self.y.T, v))


# The metric's smallest eigenvalue below which the complement is not used: the Gram in E's
# coordinates is ~1/floor as ill-conditioned as in orthonormal ones (measured: normalized attention
# at its init, floor ~0.1, its Schur-complement Gram off by 2e-4 along the sigma_min vector where
# the regularised route's was off by 2e-6; both refined on the exact J to the same sigma_min)
METRIC_FLOOR = 0.05


@dataclass
class OrthogonalGaugeComplement:
    """Coordinates of a complement of the orthogonal gauge {(M W_Q, M W_K) : M antisymmetric} and
    the null inputs (every u w^T, w in null(X), in either block), for scores that see q and k only
    through their directions (normalized attention).

    No orthonormal basis of that complement has Kronecker structure (the gauge rotates Q's output
    side by M and K's by the same M, whose two sides differ), but a complement that is not
    orthogonal does: E = [all of Q on the non-null inputs V | K's perp inputs | the part of K's gauge
    input directions (Vh_K, from A_K = W_K V V^T = U_K S_K Vh_K) off the gauge]. With C' = U_K^T C
    for K's direction C Vh_K, the gauge's K part is M' S_K (M' antisymmetric), per pair i < j the
    coordinates (C'_ij, C'_ji) along (s_j, -s_i); the complement keeps (s_i, s_j) / r_ij and the
    diagonal. E meets the gauge only in Q, so its metric E^T P E (P the orthogonal projector onto
    the complement of the gauge and the null inputs) is I but on Q's coordinates, where it is
    M = I - Y_Q (Y_Q^T Y_Q + Y_K^T Y_K)^-1 Y_Q^T (Y_b: the gauge's coordinates in block b). J on
    the orthogonal complement, in orthonormal coordinates, is then J E M^(-1/2) (J is null on the
    gauge): its Grams are those of J E, from the blocks' factors, with M^(1/2) in the
    preconditioner (``Preconditioner.add_kron``)."""

    inputs: torch.Tensor  # V (D', r): the non-null input directions, Q's coordinates (b, c) on them
    rows: torch.Tensor  # Vh_K^T (D', d)
    perp: torch.Tensor  # (D', r - d): K's other non-null input directions
    u: torch.Tensor  # U_K (d, d)
    s: torch.Tensor  # S_K (d,)
    metric: MetricRoot  # on Q's coordinates, (d r) row-major
    first: torch.Tensor  # per complement column: its (i, j) and (j, i) indices among K's d^2
    second: torch.Tensor
    a: torch.Tensor  # and their weights s_i / r_ij, s_j / r_ij (diagonal: 1, 0)
    b: torch.Tensor

    @property
    def d(self) -> int:
        return self.u.shape[0]

    @property
    def n_sym(self) -> int:
        return self.a.numel()

    def sym(self, m: torch.Tensor) -> torch.Tensor:
        """M P for M's products with K's gauge coordinates (n, d^2; (i, j): u^K_i (x) vh^K_j)."""
        return m[:, self.first] * self.a + m[:, self.second] * self.b

    def sym_matrix(self) -> torch.Tensor:
        """P as a (d^2, n_sym) matrix in K's (b, j) coordinates, output b raw: (U_K (x) I) P."""
        d = self.d
        eye = torch.eye(d * d, dtype=self.u.dtype, device=self.u.device)
        p = self.sym(eye)  # rows (i, j)
        return (self.u @ p.reshape(d, -1)).reshape(d * d, -1)

    def gauge_part(self, m: torch.Tensor) -> torch.Tensor:
        """The M (k, d, d) of the gauge elements that clear K's directions C' (k, d, d) of their part
        along the gauge (on the pairs (s_j, -s_i))."""
        s = self.s
        r2 = s[:, None] ** 2 + s[None, :] ** 2
        mu = (m * s[None, None, :] - m.transpose(1, 2) * s[None, :, None]) / r2  # M'_ij, antisymmetric
        return self.u @ mu @ self.u.T

    def coordinates(self, dq: torch.Tensor, dk: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
        """The coordinates ([Q | K perp | K sym], metric applied) of directions (dq, dk) (k, d, D'),
        modulo the gauge and the null inputs, as (n, k): what J sees of them."""
        ck = self.u.T @ (dk @ self.rows)  # C' (k, d, d)
        m = self.gauge_part(ck)
        q = ((dq - m @ w_q) @ self.inputs).reshape(dq.shape[0], -1).T
        sym = self.sym(ck.reshape(dk.shape[0], -1))  # (the gauge element's K part is off P)
        return torch.cat([self.metric.root(q), (dk @ self.perp).reshape(dk.shape[0], -1).T, sym.T])


def orthogonal_complement(
    maps: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, x: torch.Tensor
) -> OrthogonalGaugeComplement | None:
    """The complement for a group whose M_i (m, d, d) span every antisymmetric M (the orthogonal
    gauge's d (d - 1) / 2), on inputs x (rows); None when the group is another, or the metric
    nearly singular (``METRIC_FLOOR``)."""
    d, dim = w_q.shape
    if maps.shape[0] != d * (d - 1) // 2 or (maps + maps.transpose(1, 2)).norm() > 1e-12 * maps.norm():
        return None
    null_in = null_vectors(x, RANK_RTOL)
    q = torch.linalg.qr(null_in, mode="complete").Q
    inputs = q[:, null_in.shape[1] :]
    a_k = w_k @ inputs @ inputs.T
    u, s, vh = torch.linalg.svd(a_k, full_matrices=False)
    if float(s[-1]) <= INDEPENDENT_RTOL * float(s[0]):
        return None
    rows = vh.T
    basis = torch.linalg.qr(torch.cat([null_in, rows], 1), mode="complete").Q
    perp = basis[:, null_in.shape[1] + d :]
    if not perp.shape[1]:  # every input direction K's own or null (a head as wide as its inputs)
        return None
    y_q = (maps @ w_q @ inputs).reshape(maps.shape[0], -1).T.contiguous()  # (d r, m)
    y_k = (u.T @ maps @ u * s[None, None, :]).reshape(maps.shape[0], -1)  # C' = M' S_K, (m, d^2)
    metric = MetricRoot.of(y_q, y_k @ y_k.T)
    if metric is None or metric.floor < METRIC_FLOOR:
        return None
    idx_i, idx_j = torch.triu_indices(d, d, device=s.device)
    r = torch.sqrt(s[idx_i] ** 2 + s[idx_j] ** 2)
    diag = idx_i == idx_j
    a = torch.where(diag, 1.0, s[idx_i] / r).to(s.dtype)
    b = torch.where(diag, 0.0, s[idx_j] / r).to(s.dtype)
    return OrthogonalGaugeComplement(
        inputs,
        rows,
        perp,
        u,
        s,
        metric,
        idx_i * d + idx_j,
        idx_j * d + idx_i,
        a,
        b,
    )
