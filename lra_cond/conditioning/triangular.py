"""Square factors R of a preconditioned Gram G = R^T R, as ``extremes`` reads them: products with R
and R^T, solves with them. A formed upper-triangular R (``Upper``: a Cholesky or Householder QR
factor), or the factor of a Gram bordered by whitened coordinates (``BorderedGram``: a whole
head's, its complement coordinates whitened by their own block's Cholesky factor), factored with
those coordinates first (``Bordered``): their block of the factor is then the identity, and only
the Schur complement of the rest is factored."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lra_cond.linalg import gram, matvec


class Upper:
    """A formed upper-triangular R."""

    def __init__(self, r: torch.Tensor) -> None:
        self.r = self.like = r

    @property
    def n(self) -> int:
        return self.r.shape[0]

    def apply(self, u: torch.Tensor) -> torch.Tensor:  # R u
        return matvec(self.r, u)

    def apply_t(self, w: torch.Tensor) -> torch.Tensor:  # R^T w
        return matvec(self.r.T, w)

    def solve(self, y: torch.Tensor) -> torch.Tensor:  # R^-1 y
        return torch.linalg.solve_triangular(self.r, y, upper=True)

    def solve_t(self, v: torch.Tensor) -> torch.Tensor:  # R^-T v
        return torch.linalg.solve_triangular(self.r.T, v, upper=False)


class Bordered:
    """R with R^T R = [[S + B B^T, B], [B^T, I]] on coordinates [p | c]: the Cholesky factor of that
    Gram with the c coordinates first, [[I, B^T], [0, R_S]] (R_S^T R_S = S), its rows in that order
    (R u = [u_c + B^T u_p; R_S u_p]). A solve reads R_S and B once each, where the formed factor's
    triangle is (n_p + n_c)^2 / 2."""

    def __init__(self, r_s: torch.Tensor, b: torch.Tensor) -> None:
        self.r_s, self.b = r_s, b
        self.like = r_s  # (its dtype and device)

    @property
    def n(self) -> int:
        return sum(self.b.shape)

    def apply(self, u: torch.Tensor) -> torch.Tensor:
        up, uc = u[: self.b.shape[0]], u[self.b.shape[0] :]
        return torch.cat([uc + matvec(self.b.T, up), matvec(self.r_s, up)])

    def apply_t(self, w: torch.Tensor) -> torch.Tensor:
        wc, wp = w[: self.b.shape[1]], w[self.b.shape[1] :]
        return torch.cat([matvec(self.b, wc) + matvec(self.r_s.T, wp), wc])

    def solve(self, y: torch.Tensor) -> torch.Tensor:
        yc, yp = y[: self.b.shape[1]], y[self.b.shape[1] :]
        up = torch.linalg.solve_triangular(self.r_s, yp, upper=True)
        return torch.cat([up, yc - matvec(self.b.T, up)])

    def solve_t(self, v: torch.Tensor) -> torch.Tensor:
        vp, vc = v[: self.b.shape[0]], v[self.b.shape[0] :]
        wp = torch.linalg.solve_triangular(self.r_s.T, vp - matvec(self.b, vc), upper=False)
        return torch.cat([vc, wp])


@dataclass
class BorderedGram:
    """The Gram [[H, B], [B^T, C]] on coordinates [p | c], C = I when ``cc`` is None: the c
    coordinates whitened by the Cholesky factor of their own block, exactly (unshifted), so that
    the identity stands for that block to the factor's backward error, ~eps of the block's norm,
    below the rounding of the block itself (a Schur complement, formed by cancellation)."""

    h: torch.Tensor  # (n_p, n_p), the caller's: overwritten by its Schur complement in ``factor``
    b: torch.Tensor  # (n_p, n_c)
    cc: torch.Tensor | None = None

    def formed(self) -> torch.Tensor:
        n_p, n_c = self.b.shape
        g = self.h.new_empty(n_p + n_c, n_p + n_c)
        g[:n_p, :n_p], g[:n_p, n_p:], g[n_p:, :n_p] = self.h, self.b, self.b.T
        if self.cc is None:
            g[n_p:, n_p:] = torch.eye(n_c, dtype=g.dtype, device=g.device)
        else:
            g[n_p:, n_p:] = self.cc
        return g

    def factor(self) -> Bordered | None:
        """The factor with the c coordinates first (an identity block, ``cc`` None): the Cholesky
        factor of S = H - B B^T, a Gram and a factor of n_p where the formed Gram's are of
        n_p + n_c (measured at the reference shape, n_p 2016 and n_c 1024: ~70 against ~210 ms
        with the c block whitened). None when S is not numerically positive definite."""
        assert self.cc is None
        s = gram(self.b.T, add_to=self.h, alpha=-1.0)
        r_s, info = torch.linalg.cholesky_ex(s, upper=True)
        return Bordered(r_s, self.b) if int(info) == 0 else None
