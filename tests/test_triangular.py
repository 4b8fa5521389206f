"""The square factors of a preconditioned Gram (``conditioning.triangular``) and the whole head's
bordered Schur complement (``routes._schur_whitened``), against dense float64 references."""

from __future__ import annotations

import pytest
import torch

from lra_cond.conditioning import extremes, routes
from lra_cond.conditioning.coordinates import Preconditioner
from lra_cond.conditioning.extremes import Bordered, BorderedGram, Upper


def _bordered_gram(n_p: int, n_c: int, seed: int = 0) -> tuple[BorderedGram, torch.Tensor]:
    """A Gram's bordered form (its c coordinates whitened by their block's Cholesky factor) and the
    whitened Gram formed densely: R_c^-T-congruence of the c rows and columns, that block left as
    the congruence computes it (not set to I)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(3 * (n_p + n_c), n_p + n_c, generator=gen, dtype=torch.float64)
    a[:, n_p:] *= torch.logspace(0, 3, n_c, dtype=torch.float64)  # c columns badly scaled: whitened
    g = a.T @ a
    r_c = torch.linalg.cholesky(g[n_p:, n_p:], upper=True)
    t = torch.block_diag(torch.eye(n_p, dtype=g.dtype), torch.linalg.inv(r_c))
    whitened = t.T @ g @ t
    b = torch.linalg.solve_triangular(r_c, g[:n_p, n_p:], upper=True, left=False)
    return BorderedGram(g[:n_p, :n_p].clone(), b), whitened


def test_the_bordered_factor_factors_the_whitened_gram() -> None:
    """R = [[I, B^T], [0, R_S]] in the c-first row order: R^T R equals the densely whitened Gram to
    rounding, its solves invert its products, and the inverse Gram equals that of a formed
    Cholesky factor of the same Gram."""
    bordered, whitened = _bordered_gram(30, 12)
    assert torch.allclose(bordered.formed(), whitened, rtol=0, atol=1e-12 * float(whitened.abs().max()))
    r = bordered.factor()
    assert isinstance(r, Bordered) and r.n == 42
    eye = torch.eye(42, dtype=torch.float64)
    dense_r = r.apply(eye)
    assert torch.equal(r.apply_t(eye), dense_r.T)
    scale = float(whitened.abs().max())
    torch.testing.assert_close(dense_r.T @ dense_r, whitened, rtol=0, atol=1e-11 * scale)
    u = torch.randn(42, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(r.solve(r.apply(u)), u, rtol=0, atol=1e-10)
    torch.testing.assert_close(r.solve_t(r.apply_t(u)), u, rtol=0, atol=1e-10)
    upper = Upper(torch.linalg.cholesky(whitened, upper=True))
    torch.testing.assert_close(r.solve(r.solve_t(u)), upper.solve(upper.solve_t(u)), rtol=1e-9, atol=0)


def test_a_bordered_gram_whose_schur_complement_is_not_definite_has_no_factor() -> None:
    """S = H - B B^T with a negative direction: no factor (the caller falls back as for a formed
    Gram whose Cholesky failed), and ``_triangular`` then takes Householder QR of the rows."""
    bordered, _ = _bordered_gram(10, 4)
    bordered.h[0, 0] -= 1e3 * float(bordered.h.diagonal().max())
    assert bordered.factor() is None
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randn(40, 14, generator=gen, dtype=torch.float64)]
    t = Preconditioner()
    t.add_dense(torch.eye(14, dtype=torch.float64))
    bordered, _ = _bordered_gram(10, 4)
    bordered.h[0, 0] -= 1e3 * float(bordered.h.diagonal().max())
    r, route, formed = extremes._triangular(rows, t, use_qr=False, g=bordered)
    assert route == "qr" and formed is None
    torch.testing.assert_close(r.T @ r, rows[0].T @ rows[0])


def test_a_regularised_or_shifted_bordered_gram_is_factored_formed() -> None:
    """With a regulariser (its projector is added to the whole Gram) or a c block that is not the
    identity, the bordered Gram is formed and factored whole: R^T R equals it."""
    bordered, whitened = _bordered_gram(10, 4)
    cc = whitened[10:, 10:] * 1.5
    shifted = BorderedGram(bordered.h.clone(), bordered.b, cc)
    r, route, formed = extremes._triangular([], Preconditioner(), use_qr=False, g=shifted)
    assert route == "cholesky" and isinstance(r, torch.Tensor)
    expected = whitened.clone()
    expected[10:, 10:] = cc
    torch.testing.assert_close(formed, expected)
    basis = torch.linalg.qr(torch.randn(14, 2, dtype=torch.float64)).Q
    reg = extremes.Regulariser(basis)
    bordered, whitened = _bordered_gram(10, 4)
    r, _, formed = extremes._triangular([], Preconditioner(), use_qr=False, g=bordered, reg=reg)
    beta = float(whitened.diagonal().mean())
    torch.testing.assert_close(r.T @ r, whitened + beta * basis @ basis.T)


@pytest.mark.parametrize("definite", [True, False])
def test_the_schur_complement_is_whitened_and_bordered(definite: bool) -> None:
    """``_schur_whitened``: H = G - C^T C on [p | c], its c block whitened by R_c (R_c^T R_c = H_cc):
    the bordered Gram is T^T H T with T = diag(I, R_c^-1), compared in H's own coordinates (the
    whitening of a nearly null direction amplifies either side's rounding alike). Where H_cc is
    singular (a c column whose rows are only C's), R_c is shifted and H's whitened block formed
    (``cc``): the same congruence."""
    gen = torch.Generator().manual_seed(3)
    n_p, n_c, m = 9, 5, 7
    a = torch.randn(40, n_p + n_c, generator=gen, dtype=torch.float64)
    c = torch.randn(m, n_p + n_c, generator=gen, dtype=torch.float64)
    if not definite:
        a[:, -1] = 0.0
    g = a.T @ a + c.T @ c
    bordered, r_c = routes._schur_whitened(
        g[:n_p, :n_p].clone(), g[:n_p, n_p:].clone(), g[n_p:, n_p:].clone(), c[:, :n_p], c[:, n_p:]
    )
    assert (bordered.cc is None) == definite
    t_inv = torch.block_diag(torch.eye(n_p, dtype=g.dtype), r_c)
    raw = t_inv.T @ bordered.formed() @ t_inv
    h = a.T @ a
    torch.testing.assert_close(raw, h, rtol=0, atol=1e-12 * float(h.abs().max()))
