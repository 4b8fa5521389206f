"""The Jacobian's exact null space, built analytically and checked numerically.

Theory (per head h, A_h = kernel(X W_Q^hT, X W_K^hT, X W_V^hT), torch layout W[out, in]):

* **Gauge symmetry.** Kernels that see queries and keys only through inner products q_i . k_j
  (softmax, Nystrom's landmark softmaxes) are unchanged by (W_Q^h, W_K^h) -> (M W_Q^h, M^{-T} W_K^h)
  for any invertible d_h x d_h M. Its tangent directions (E W_Q^h, -E^T W_K^h), E in R^{d_h x d_h},
  give H*d_h^2 null singular values. Kernels that L2-normalise q and k keep only the orthogonal part
  (E antisymmetric: d_h(d_h-1)/2 per head) and gain the scale directions (W_Q^h, 0) and (0, W_K^h).
  Elementwise feature maps (linear attention's elu+1) have no continuous gauge.
* **Input null space.** If the probe rows x_i all lie in a subspace (X w = 0 for some w), then any
  direction u w^T of W_Q, W_K or W_V leaves q, k, v unchanged: d_h directions per head, per block and
  per null vector w. LayerNorm without bias (or with bias 0, as at init) makes rows mean-free, w = 1,
  hence 3*H*d_h more null values on LayerNorm-ed inputs. This holds for every family.
* **Key shift.** Softmax over keys ignores adding the same vector to every key of a sequence. If
  (x_j - mean_j x_j) w = 0 within each sequence (e.g. w = 1/gamma after a LayerNorm with any bias),
  the K directions u w^T are null too (they coincide with the input null space when rows are mean-free).
* **Gauge with a shifted query bias.** With a fixed query bias b_Q, the gauge tangent E breaks only
  by -E b_Q . k_j (``gauge_fixed_bias`` keeps the E with E b_Q = 0). If moreover every real row has
  the same x w = c != 0 for the key-shift vector w (a LayerNorm with a bias: w = 1/gamma,
  c = beta . w), adding (E b_Q / c) w^T to W_Q shifts every query back by E b_Q: the remaining d_h
  gauge directions per head, (E W_Q + (E b_Q / c) w^T, -E^T W_K), are null as well.
* **Linear attention's key/value statistics.** Kernels that see keys and values only through
  per-sequence sums (elu+1 linear attention: S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j)) are
  unchanged to first order by any (W_K, W_V) direction that leaves every sequence's (S, z) fixed:
  at least 2 d_h D - B (d_h^2 + d_h) per head (B sequences), the null space of that small Jacobian.

Each candidate group is a linear subspace; a group is accepted when J applied to two random
combinations of it is zero (relative to J on random directions). If J restricted to the group were
not zero, a random combination would be null with probability zero, so this verifies the whole group
with two Jacobian-vector products, for any attention family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lra_cond.conditioning.probe import Probe
from lra_cond.conditioning.weights import svdvals
from lra_cond.models.attention.linear import LinearAttention

ACCEPT_RTOL = 1e-8  # ||J v|| / typical ||J u|| below this: v is a null direction (float64 noise ~1e-15)


@dataclass
class NullSpace:
    """Orthonormal null-space basis per head, in that head's own parameter layout."""

    dims: list[int]  # null-space dimension per head
    bases: list[torch.Tensor] | None = None  # one (head_size, m_h) matrix per head, when asked for
    groups: dict[str, int] = field(default_factory=dict)  # accepted group -> directions (all heads)
    rejected: list[str] = field(default_factory=list)

    @property
    def dim(self) -> int:
        return sum(self.dims)


def input_null_vectors(x: torch.Tensor, rtol: float) -> torch.Tensor:
    """Orthonormal w (D x z) with x w ~ 0, at relative tolerance ``rtol`` on the singular values."""
    _, s, vh = torch.linalg.svd(x, full_matrices=True)
    s_full = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
    s_full[: s.numel()] = s
    keep = s_full <= rtol * s.max()
    return vh[keep].T


def centered_rows(probe: Probe) -> torch.Tensor:
    """Real rows minus their sequence's mean (keys of different sequences never mix)."""
    parts = []
    for b in range(probe.x.shape[0]):
        xb = probe.x[b][probe.real[b]]
        if xb.shape[0]:
            parts.append(xb - xb.mean(0, keepdim=True))
    return torch.cat(parts)


def snap_input(probe: Probe, rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Make near-exact input symmetries exact; returns orthonormal bases (w0: x w = 0, wc: centred x w = 0).

    Float32 LayerNorm outputs are mean-free only to ~1e-7; without snapping, the 3*H*d_h "null"
    values would sit at ~1e-7 sigma_max and poison kappa. Directions below ``rtol`` are removed from
    the real rows (a perturbation of relative size <= rtol).
    """
    x = probe.x.clone()
    wc = input_null_vectors(centered_rows(probe), rtol)
    for b in range(x.shape[0]):
        rows = probe.real[b]
        xb = x[b][rows]
        resid = (xb - xb.mean(0, keepdim=True)) @ wc
        x[b][rows] = xb - resid @ wc.T
    probe.x = x
    w0 = input_null_vectors(x[probe.real], rtol)
    for b in range(x.shape[0]):
        rows = probe.real[b]
        x[b][rows] = x[b][rows] - (x[b][rows] @ w0) @ w0.T
    probe.x = x
    return w0, input_null_vectors(centered_rows(probe), rtol)


def _bias(probe: Probe, block: str, h: int) -> torch.Tensor:
    """Head h's bias of a projection as a (d_h, 1) column (zeros if the layer has none)."""
    bias = getattr(probe.layer, f"{block}_proj").bias
    d = probe.head_dim
    if bias is None:
        return torch.zeros(d, 1, dtype=probe.x.dtype, device=probe.x.device)
    return bias.detach()[h * d : (h + 1) * d, None].to(probe.x.dtype)


def _columns(probe: Probe, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """{block: (m, d_h, D) directions} -> (head_size, m) in a head's layout, zeros in the other blocks."""
    m = next(iter(parts.values())).shape[0]
    z = torch.zeros(m, probe.head_dim, probe.dim, dtype=probe.x.dtype, device=probe.x.device)
    return torch.cat([parts.get(b, z).reshape(m, -1) for b in probe.blocks], 1).T


def _constant_projection(probe: Probe, wc: torch.Tensor) -> float | None:
    """c when every real row has x . w = c != 0 for the first key-shift vector w, else None."""
    if wc.shape[1] == 0:
        return None
    proj = probe.x[probe.real] @ wc[:, 0]
    c = float(proj.mean())
    scale = float(probe.x[probe.real].abs().max())
    if abs(c) <= 1e-12 * scale or float((proj - c).abs().max()) > 1e-10 * scale:
        return None
    return c


def _linear_statistics(probe: Probe, h: int) -> torch.Tensor | None:
    """(W_K, W_V) directions of head h that leave every sequence's S and z unchanged (linear attention)."""
    layer, d, dim = probe.layer, probe.head_dim, probe.dim
    blocks = [b for b in ("k", "v") if b in probe.blocks]
    if not isinstance(layer, LinearAttention) or not blocks:
        return None
    weights = {b: probe.head_weight(b, h) for b in "kv"}
    bias = {b: _bias(probe, b, h)[:, 0] for b in "kv"}

    def statistics(flat: torch.Tensor) -> torch.Tensor:
        w = dict(weights, **dict(zip(blocks, flat.reshape(len(blocks), d, dim))))
        k, v = (probe.x @ w[b].T + bias[b] for b in "kv")  # (B, N, d)
        _, phi_k = layer.features(k[:, None], k[:, None], probe.mask)
        phi_k = phi_k[:, 0]
        return torch.cat([torch.einsum("bnd,bne->bde", phi_k, v).flatten(1), phi_k.sum(1)], 1).flatten()

    jac = torch.func.jacrev(statistics)(torch.cat([weights[b].reshape(-1) for b in blocks]))
    # Exact SVD (not the Gram route of orthonormal_columns): these directions are deflated, so they
    # must be null to working precision, not to sqrt(eps).
    _, s, vh = torch.linalg.svd(jac, full_matrices=True)
    rank = int((s > 1e-10 * s[0]).sum())
    null = vh[rank:].T  # (len(blocks) * d * D, m)
    if null.shape[1] == 0:
        return None
    parts = null.T.reshape(-1, len(blocks), d, dim)
    return _columns(probe, {b: parts[:, i] for i, b in enumerate(blocks)})


def _complement(vectors: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the orthogonal complement of span(vectors) (d x k) in R^d."""
    d = vectors.shape[0]
    scale = float(vectors.abs().max())
    if scale == 0.0:
        return torch.eye(d, dtype=vectors.dtype, device=vectors.device)
    u, s, _ = torch.linalg.svd(vectors / scale, full_matrices=True)
    rank = int((s > 1e-12).sum())
    return u[:, rank:]


def _head_group(probe: Probe, h: int, name: str, w0: torch.Tensor, wc: torch.Tensor) -> torch.Tensor | None:
    """Candidate directions of one group for head h, columns in head h's layout (or None)."""
    d, dim, blocks = probe.head_dim, probe.dim, probe.blocks
    W = {b: probe.head_weight(b, h) for b in blocks}
    eye = torch.eye(d, dtype=probe.x.dtype, device=probe.x.device)

    def rows_equal(vectors: torch.Tensor) -> torch.Tensor:
        """Directions "row a of the d x D block = v" for every a and every v in vectors (D, r)."""
        return torch.einsum("ai,vD->vaiD", eye, vectors.T).reshape(-1, d, dim)

    if name in ("gauge", "gauge_fixed_bias", "orthogonal_gauge") and not ("q" in blocks and "k" in blocks):
        return None
    if name in ("gauge", "gauge_fixed_bias"):
        # E = e_a n^T with n over a basis N of R^d ("gauge") or of b_Q's complement ("gauge_fixed_bias":
        # q = W_Q x + b_Q with b_Q held fixed needs E b_Q = 0; b_K only adds a per-query constant
        # to the scores, which softmax ignores). dW_Q = E W_Q, dW_K = -E^T W_K.
        n = eye if name == "gauge" else _complement(_bias(probe, "q", h))
        dq = torch.einsum("ai,cD->aciD", eye, n.T @ W["q"])
        dk = -torch.einsum("ic,aD->aciD", n, W["k"])
        return _columns(probe, {"q": dq.reshape(-1, d, dim), "k": dk.reshape(-1, d, dim)})
    if name == "orthogonal_gauge":
        # Rotations of q and k together; with fixed biases only those fixing b_Q and b_K.
        basis = _complement(torch.cat([_bias(probe, "q", h), _bias(probe, "k", h)], 1))
        es = [
            torch.outer(basis[:, a], basis[:, c]) - torch.outer(basis[:, c], basis[:, a])
            for a in range(basis.shape[1])
            for c in range(a + 1, basis.shape[1])
        ]
        if not es:
            return None
        e = torch.stack(es)
        return _columns(probe, {"q": e @ W["q"], "k": e @ W["k"]})
    if name in ("q_scale", "k_scale"):
        b = name[0]
        return _columns(probe, {b: W[b][None]}) if b in blocks else None
    if name.startswith("input_null_"):
        b = name[-1]
        return _columns(probe, {b: rows_equal(w0)}) if b in blocks and w0.shape[1] else None
    if name == "gauge_bias_shift":
        b_q, c = _bias(probe, "q", h), _constant_projection(probe, wc)
        if not ("q" in blocks and "k" in blocks) or c is None or not b_q.any():
            return None
        w = wc[:, :1]
        e = torch.einsum("ai,j->aij", eye, b_q[:, 0] / float(b_q.square().sum()))  # E_a b_Q = e_a
        dq = e @ W["q"] + eye[:, :, None] * (w[:, 0] / c)[None, None, :]
        return _columns(probe, {"q": dq, "k": -e.transpose(1, 2) @ W["k"]})
    if name == "linear_statistics":
        return _linear_statistics(probe, h)
    if name == "key_shift":
        return _columns(probe, {"k": rows_equal(wc)}) if "k" in blocks and wc.shape[1] else None
    return None


GROUPS = (
    "gauge",
    "gauge_fixed_bias",
    "orthogonal_gauge",
    "q_scale",
    "k_scale",
    "input_null_q",
    "input_null_k",
    "input_null_v",
)


def _is_null(probe: Probe, direction: torch.Tensor, reference: float) -> bool:
    jv = probe.jvp(probe.theta(), direction)
    return bool(jv.norm() <= ACCEPT_RTOL * reference * direction.norm())


def orthonormal_columns(m: torch.Tensor, rtol: float = 1e-6) -> torch.Tensor:
    """Orthonormal basis of span(m), rank-revealing (duplicated directions count once).

    Via the Gram matrix (k x k, k = candidates << rows): eigh finds the rank and a rotation that
    makes the kept columns orthogonal, a QR normalises them to working precision. A full SVD of the
    tall m costs ~10x more on CPU. Candidate groups are either independent (relative singular values
    far above rtol) or exactly dependent (~1e-8 through the Gram), so rtol = 1e-6 separates them.
    """
    if m.shape[1] == 0:
        return m
    lam, vecs = torch.linalg.eigh(m.mT @ m)
    keep = lam > rtol**2 * lam[-1]
    return torch.linalg.qr(m @ vecs[:, keep]).Q


def build_null_space(
    probe: Probe, w0: torch.Tensor, wc: torch.Tensor, seed: int = 0, basis: bool = True
) -> NullSpace:
    """Candidate groups that J maps to zero, orthonormalised per head."""
    gen = torch.Generator().manual_seed(seed)
    theta = probe.theta()
    rand = torch.randn(theta.shape, generator=gen, dtype=theta.dtype).to(theta.device)
    jr = probe.jvp(theta, rand)
    reference = float(jr.norm() / rand.norm())  # a typical gain of J, scale for the null test

    per_head: list[list[torch.Tensor]] = [[] for _ in range(probe.num_heads)]
    accepted: dict[str, int] = {}
    rejected: list[str] = []
    names = [*GROUPS, "key_shift", "gauge_bias_shift"] if wc.shape[1] > w0.shape[1] else list(GROUPS)
    names.append("linear_statistics")
    for name in names:
        if name in ("gauge_fixed_bias", "orthogonal_gauge") and (
            "gauge" in accepted or "gauge_fixed_bias" in accepted
        ):
            continue  # subgroups of an accepted gauge
        if name == "gauge_fixed_bias" and not any(_bias(probe, "q", h).any() for h in range(probe.num_heads)):
            continue  # without a query bias it is the full gauge
        cands = [_head_group(probe, h, name, w0, wc) for h in range(probe.num_heads)]
        if any(c is None for c in cands):
            continue
        ok = True
        for _ in range(2):
            direction = torch.cat([c @ torch.randn(c.shape[1], generator=gen, dtype=c.dtype) for c in cands])
            ok = ok and _is_null(probe, direction, reference)
        if ok:
            for h, c in enumerate(cands):
                per_head[h].append(c)
            accepted[name] = sum(c.shape[1] for c in cands)
        else:
            rejected.append(name)
    empty = torch.zeros(probe.head_size, 0, dtype=theta.dtype, device=theta.device)
    stacked = [torch.cat(cs, 1) if cs else empty for cs in per_head]
    if basis:
        bases = [orthonormal_columns(m) for m in stacked]
        return NullSpace([b.shape[1] for b in bases], bases, accepted, rejected)
    return NullSpace([_rank(m) for m in stacked], None, accepted, rejected)


def _rank(m: torch.Tensor, rtol: float = 1e-9) -> int:
    if m.shape[1] == 0:
        return 0
    s = svdvals(m)
    return int((s > rtol * s.max()).sum())
