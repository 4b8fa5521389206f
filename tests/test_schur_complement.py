"""The whole head's Schur complement of the value block, whitened (``jacobian._schur_whitened``),
against a dense float64 reference."""

from __future__ import annotations

import pytest
import torch

from lra_cond.conditioning import jacobian


@pytest.mark.parametrize("definite", [True, False])
def test_the_schur_complement_is_whitened(definite: bool) -> None:
    """``_schur_whitened``: H = G - C^T C on [p | c], its c block whitened by R_c (R_c^T R_c = H_cc):
    the returned Gram is T^T H T with T = diag(I, R_c^-1), compared in H's own coordinates (the
    whitening of a nearly null direction amplifies either side's rounding alike). Where H_cc is
    singular (a c column whose rows are only C's), R_c is shifted and H's whitened block formed:
    the same congruence."""
    gen = torch.Generator().manual_seed(3)
    n_p, n_c, m = 9, 5, 7
    a = torch.randn(40, n_p + n_c, generator=gen, dtype=torch.float64)
    c = torch.randn(m, n_p + n_c, generator=gen, dtype=torch.float64)
    if not definite:
        a[:, -1] = 0.0
    g = a.T @ a + c.T @ c
    whitened, r_c = jacobian._schur_whitened(
        g[:n_p, :n_p].clone(), g[:n_p, n_p:].clone(), g[n_p:, n_p:].clone(), c[:, :n_p], c[:, n_p:]
    )
    eye = torch.eye(n_c, dtype=g.dtype)
    assert torch.equal(whitened[n_p:, n_p:], eye) == definite  # the c block exactly I when definite
    t_inv = torch.block_diag(torch.eye(n_p, dtype=g.dtype), r_c)
    raw = t_inv.T @ whitened @ t_inv
    h = a.T @ a
    torch.testing.assert_close(raw, h, rtol=0, atol=1e-12 * float(h.abs().max()))
