"""Preconditioners of a scope's columns (step 2 of ``spectrum``): a block-diagonal T, Kronecker
L_b (x) W on each block's coordinates (W whitens the inputs, L_b the block's output side), a
triangular or a Jacobi one on columns without that structure, so that the preconditioned Gram
T^T J^T J T is well conditioned and its Cholesky factor keeps every singular value."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lra_cond.conditioning import factored, gauge
from lra_cond.linalg import RANK_RTOL, gram, matvec


class Preconditioner:
    """Block-diagonal T over a column layout: Kronecker blocks L (x) W (columns (b, c), c over
    W's size, row-major; optionally after a metric's root, ``add_kron``), dense blocks
    T = R^{-1} (R upper triangular) and diagonal ones T = diag(1/s) (a Jacobi preconditioner,
    given as s), in column order."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, int, tuple[torch.Tensor, ...]]] = []  # (kind, size, matrices)

    def add_kron(self, lb: torch.Tensor, w: torch.Tensor, metric: gauge.MetricRoot | None = None) -> None:
        """T = L (x) W; with ``metric``, T = S (L (x) W), S its square root M^(1/2) (symmetric):
        coordinates whose inner product is M (``gauge.OrthogonalGaugeComplement``)."""
        mats = (lb, w, torch.linalg.inv(lb), torch.linalg.inv(w))
        n = lb.shape[0] * w.shape[0]
        self.parts.append(("kron", n, mats) if metric is None else ("kron_metric", n, (*mats, metric)))

    def add_dense(self, r: torch.Tensor) -> None:
        """R (n, n) upper triangular, or the diagonal s (n,) of a Jacobi preconditioner."""
        self.parts.append(("dense" if r.dim() == 2 else "diag", r.shape[0], (r,)))

    @property
    def size(self) -> int:
        return sum(n for _, n, _ in self.parts)

    def _each(self, v: torch.Tensor, fn) -> torch.Tensor:  # noqa: ANN001
        out, start = [], 0
        for kind, n, mats in self.parts:
            out.append(fn(kind, mats, v[start : start + n]))
            start += n
        return torch.cat(out)

    @staticmethod
    def _kron(lb: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(lb (x) w) v for v (d*p, k): per column, lb @ V @ w^T with V = v reshaped (d, p)."""
        d, p, k = lb.shape[0], w.shape[0], v.shape[1]
        tmp = (lb @ v.reshape(d, p * k)).reshape(d, p, k).transpose(0, 1).reshape(p, d * k)
        return (w @ tmp).reshape(p, d, k).transpose(0, 1).reshape(d * p, k)

    def apply(self, v: torch.Tensor) -> torch.Tensor:  # T v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[0], mats[1], x)
            if kind == "kron_metric":
                return mats[4].root(self._kron(mats[0], mats[1], x))
            if kind == "diag":
                return x / mats[0][:, None]
            return torch.linalg.solve_triangular(mats[0], x, upper=True)

        return self._each(v, fn)

    def apply_t(self, v: torch.Tensor) -> torch.Tensor:  # T^T v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[0].T, mats[1].T, x)
            if kind == "kron_metric":
                return self._kron(mats[0].T, mats[1].T, mats[4].root(x))
            if kind == "diag":
                return x / mats[0][:, None]
            return torch.linalg.solve_triangular(mats[0].T, x, upper=False)

        return self._each(v, fn)

    def solve(self, v: torch.Tensor) -> torch.Tensor:  # T^{-1} v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[2], mats[3], x)
            if kind == "kron_metric":
                return self._kron(mats[2], mats[3], mats[4].inverse_root(x))
            return x * mats[0][:, None] if kind == "diag" else matvec(mats[0], x)

        return self._each(v, fn)

    def solve_t(self, v: torch.Tensor) -> torch.Tensor:  # T^{-T} v
        def fn(kind, mats, x):  # noqa: ANN001, ANN202
            if kind == "kron":
                return self._kron(mats[2].T, mats[3].T, x)
            if kind == "kron_metric":
                return mats[4].inverse_root(self._kron(mats[2].T, mats[3].T, x))
            return x * mats[0][:, None] if kind == "diag" else matvec(mats[0].T, x)

        return self._each(v, fn)

    def right(self, a: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """a @ T for a (m, n); a @ T^{-1} with ``inverse``."""
        out, start = [], 0
        for kind, n, mats in self.parts:
            block = a[:, start : start + n]
            if kind in ("kron", "kron_metric"):
                lb, w = mats[2:4] if inverse else mats[:2]
                if kind == "kron_metric" and not inverse:  # a S (L (x) W): S symmetric
                    block = mats[4].root(block.T).T
                d, p = lb.shape[0], w.shape[0]
                tmp = (block.reshape(-1, p) @ w).reshape(-1, d, p)  # input side, then the output side
                tmp = (lb.T @ tmp).reshape(a.shape[0], n)  # in place: no transposed copies
                if kind == "kron_metric" and inverse:  # a (L (x) W)^-1 S^-1
                    tmp = mats[4].inverse_root(tmp.T).T
                out.append(tmp)
            elif kind == "diag":  # T = diag(1/s)
                out.append(block * mats[0] if inverse else block / mats[0])
            elif inverse:  # T = R^{-1}
                out.append(block @ mats[0])
            else:
                out.append(torch.linalg.solve_triangular(mats[0], block, upper=True, left=False))
            start += n
        if not out:  # no parts: a has no columns
            return a
        return out[0] if len(out) == 1 else torch.cat(out, 1)


def input_whitening(x: torch.Tensor, rtol: float = RANK_RTOL) -> torch.Tensor:
    """W = V diag(1/s) V^T from the SVD of the real input rows (null directions scaled by 1/s_max):
    the Kronecker preconditioner's input side."""
    _, s, vh = torch.linalg.svd(x, full_matrices=True)
    full = torch.full((x.shape[1],), float(s[0]), dtype=x.dtype, device=x.device)
    full[: s.numel()] = torch.where(s > rtol * s[0], s, s[0])
    return vh.T @ torch.diag(1.0 / full) @ vh


def output_whitening(a: torch.Tensor, d: int, rows: int = 64) -> torch.Tensor:
    """L with (a reshaped (m, d, p)) contracted over rows and c having unit Gram on b: the
    Kronecker preconditioner's output side (the inverse Cholesky factor, transposed)."""
    return factored.inverse_cholesky_t(factored.sum_over_inputs(a, a, d, rows))


def dense_whitening(a: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
    """R with a R^{-1} having unit Gram (shifted Cholesky: a preconditioner need not be exact);
    ``g``: a^T a when the caller has it (e.g. from a family's structure)."""
    g = gram(a) if g is None else g
    shift = 1e-10 * float(g.diagonal().mean())
    eye = torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
    return torch.linalg.cholesky_ex(g + shift * eye, upper=True)[0]


DENSE_PRECONDITIONER_MAX = 1536  # larger mixed blocks get a diagonal (Jacobi) preconditioner


def dense_preconditioner(
    columns: torch.Tensor, columns_gram: Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """R whitening columns without Kronecker structure, or (when there are many) the column norms s
    of a Jacobi preconditioner diag(1/s) (``Preconditioner.add_dense`` takes either: as a formed
    diagonal matrix every product with it cost a full triangular solve or GEMM, ~0.14 TFLOP per
    whitening of the tiny split's 4096 linear-attention columns); ``columns_gram``: their Gram by a
    family's structure, cheaper than from the columns."""
    if columns.shape[1] <= DENSE_PRECONDITIONER_MAX:
        return dense_whitening(columns, None if columns_gram is None else columns_gram())
    return columns.norm(dim=0).clamp_min(1e-300)


def whitened(
    columns: torch.Tensor,
    product: Callable[[torch.Tensor], torch.Tensor] | None,
    columns_gram: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, columns R^-1) for the dense preconditioner R of ``columns``; through ``product`` (M ->
    columns M by the family's structure) when given: linear attention's statistics apply R^-1 in
    T d^2 r flops where the triangular solve on the formed columns takes T d r^2 / 2 (~0.05
    against 0.11 s at the reference shape), and give R's Gram through their own (``columns_gram``:
    0.06 against 0.14 s)."""
    r = dense_preconditioner(columns, columns_gram)
    if r.dim() == 1:  # Jacobi: the columns scaled
        return r, columns / r
    if product is None:
        return r, torch.linalg.solve_triangular(r, columns, upper=True, left=False)
    eye = torch.eye(r.shape[0], dtype=r.dtype, device=r.device)
    return r, product(torch.linalg.solve_triangular(r, eye, upper=True))
