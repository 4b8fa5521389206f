"""Linear attention's head Jacobian, measured in its eps -> 0 limit: its closed form, the key/value
statistics it reaches the output through (a support), and its symmetries."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from lra_cond.conditioning.families import base as jac
from lra_cond.linalg import RANK_RTOL, triangular_condition
from lra_cond.models.attention.linear import feature_map

T = TypeVar("T")


def feature_map_derivative(x: torch.Tensor) -> torch.Tensor:
    """elu'(x): 1 where x > 0, exp(x) (= phi(x)) elsewhere."""
    return torch.where(x > 0, torch.ones_like(x), torch.exp(x))


class LinearJacobian(jac.FamilyJacobian, family="linear"):
    """Measured at eps = 0: scaling a sequence's (S, z) together is then an exact symmetry (with eps > 0
    it is broken only by eps, and those directions' singular values, ~eps * sigma_max, would set
    kappa). phi > 0, so the denominator stays positive."""

    measured_at = {"eps": 0.0}

    def parts(self, inp: jac.HeadInputs) -> dict[str, jac.Part]:
        """With phi = elu + 1, S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j), den_i = phi(q_i) . z and
        A_i = S^T phi(q_i) / den_i (eps = 0):
            dA_i/dq_i = (S^T - A_i z^T) diag(phi'(q_i)) / den_i                    (query-local)
            dA_i/dW_K[b, c] = phi(q_i)[b] / den_i (U[:, b, c] - A_i Z[b, c]),
                U = sum_j v_j (x) phi'(k_j) (x) x_j,  Z = sum_j phi'(k_j) (x) x_j  (per sequence)
            dA_i/dW_V[b, c] = e_b (P X)_i[c],  P_ij = phi(q_i) . phi(k_j) / den_i."""
        parts: dict[str, list[torch.Tensor]] = {b: [] for b in inp.blocks}
        for x in inp.xs:
            q, k, v = inp.projected(x)
            phi_q, phi_k = feature_map(q), feature_map(k)
            z, s = phi_k.sum(0), phi_k.T @ v  # (d,), (d, d)
            den = phi_q @ z  # (L,)
            a = (phi_q @ s) / den[:, None]
            if "q" in parts:
                dphi_q = feature_map_derivative(q)
                g = (s.T[None] - a[:, :, None] * z[None, None, :]) * (dphi_q / den[:, None])[:, None, :]
                parts["q"].append(jac.Factored("query_local", g, x))
            if "k" in parts:
                dphi_k = feature_map_derivative(k)
                u = torch.einsum("ja,jb,jc->abc", v, dphi_k, x)
                zz = dphi_k.T @ x  # (d, D')
                coef = phi_q / den[:, None]  # (L, d): phi(q_i)[b] / den_i
                inner = u[None] - a[:, :, None, None] * zz[None, None]  # (L, a, b, c)
                parts["k"].append(coef[:, None, :, None] * inner)
            if "v" in parts:
                p = (phi_q @ phi_k.T) / den[:, None]
                parts["v"].append(jac.value_block(p @ x, inp.d))
        return {b: jac.stack_sequences(ps) for b, ps in parts.items()}

    def _cached(self, key: tuple, compute: Callable[[], T]) -> T:
        """A per-head quantity of the probe, computed once per probe: the scopes (the whole
        head, each block alone) and the support and symmetries of a scope ask for the same ones."""
        cache = self.cache
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    def _statistics_jacobian(self, inp: jac.HeadInputs, blocks: list[str]) -> _Statistics:
        """The per-sequence statistics (S_b, z_b) and their Jacobian G with respect to the K/V blocks
        in ``blocks``, factored once. Kept for one set of blocks at a time: only a scope's support
        and symmetries share it, and the probe takes its scopes one after the other (G, its
        factor and basis are large)."""
        cache = self.cache
        for key in [k for k in cache if k[0] == "statistics" and k[2] != tuple(blocks)]:
            del cache[key]
        return self._cached(
            ("statistics", inp.h, tuple(blocks)),
            lambda: _Statistics(self._statistics_values(inp), *_statistics_blocks(inp, blocks)),
        )

    def _query_directions(self, inp: jac.HeadInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``_feature_directions`` of head h (it depends on the head's W_Q and the probe only)."""
        return self._cached(("query_directions", inp.h), lambda: _feature_directions(inp))

    def _output_weights(self, inp: jac.HeadInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per probe sequence, (w, A) with w_i = phi(q_i) / den_i and A_i the head's output (L, d
        each): every product with J_psi reads them, so they are formed once per head."""

        def compute() -> list[tuple[torch.Tensor, torch.Tensor]]:
            out = []
            for x in inp.xs:
                q, k, v = inp.projected(x)
                phi_q, phi_k = feature_map(q), feature_map(k)
                den = phi_q @ phi_k.sum(0)
                out.append((phi_q / den[:, None], (phi_q @ (phi_k.T @ v)) / den[:, None]))
            return out

        return self._cached(("output_weights", inp.h), compute)

    def _through_statistics(self, inp: jac.HeadInputs, m: torch.Tensor) -> torch.Tensor:
        """J_psi M for M (B (d^2 + d), r) in the statistics layout: the head output's Jacobian with
        respect to the statistics, dA_i = (dS^T phi_i - A_i dz^T phi_i) / den_i, applied to M
        without forming J_psi (T d x B (d^2 + d))."""
        d, per, k = inp.d, inp.d * inp.d + inp.d, m.shape[1]
        # each sequence's rows written in place (a cat of them copied the whole output again each call)
        out = m.new_empty(sum(len(x) for x in inp.xs) * d, k)
        start = 0
        for s_idx, (x, (w, a)) in enumerate(zip(inp.xs, self._output_weights(inp))):
            block = m[s_idx * per : (s_idx + 1) * per]
            m_s, m_z = block[: d * d].reshape(d, d * k), block[d * d :]
            via_s = out[start : start + len(x) * d].view(len(x), d * k)
            torch.matmul(w, m_s, out=via_s)  # sum_b w_ib M[(b, a), k]
            via_s = via_s.view(len(x), d, k)
            via_s.addcmul_(a[:, :, None], (w @ m_z)[:, None, :], value=-1.0)  # in place: one pass
            start += len(x) * d
        return out

    def support(self, inp: jac.HeadInputs) -> jac.Support | None:
        """Keys and values enter only through each sequence's S = sum phi(k) v^T and z = sum phi(k):
        J sees (W_K, W_V) only through the row space of the small (S, z)-Jacobian G, of dimension
        <= B (d^2 + d) against 2 d D' parameters (B sequences). The probe works on J P, P an
        orthonormal basis of that row space; its complement (>= 2 d D' - B (d^2 + d) directions per
        head, every direction that leaves every (S_b, z_b) fixed) is null. J P = J_psi G P is formed
        through the statistics (``_through_statistics``: T d^2 r flops instead of T d 2 d D' r)."""
        blocks = [b for b in ("k", "v") if b in inp.blocks]
        if not blocks:
            return None
        st = self._statistics_jacobian(inp, blocks)
        if st.p.shape[1] >= st.n_params:
            return None  # no reduction: G has full column rank
        columns = self._through_statistics(inp, st.gp)

        def product(m: torch.Tensor) -> torch.Tensor:  # J_psi (G P M)
            return self._through_statistics(inp, st.gp @ m)

        def gram() -> torch.Tensor:  # (G P)^T (J_psi^T J_psi) (G P)
            return self._statistics_congruence(inp, st.gp)

        return jac.Support("key_value_statistics", tuple(blocks), st.p, columns, product, gram)

    def _statistics_congruence(self, inp: jac.HeadInputs, m: torch.Tensor) -> torch.Tensor:
        """M^T J_psi^T J_psi M for M (B (d^2 + d), r) in the statistics layout, through J_psi's
        Gram in closed form (per sequence, with w_i = phi(q_i) / den_i):
            [(b, a), (b', a')] = delta_aa' sum_i w_ib w_ib',  [(b, a), z_b'] = -sum_i w_ib A_ia w_ib',
            [z_b, z_b'] = sum_i |A_i|^2 w_ib w_ib':
        T d^3 + B (d^2 + d)^2 r flops where the columns' Gram costs T d r^2."""
        d, per = inp.d, inp.d * inp.d + inp.d
        out = m.new_zeros(m.shape[1], m.shape[1])
        for s_idx, (w, a) in enumerate(self._output_weights(inp)):
            block = m[s_idx * per : (s_idx + 1) * per]
            m_s, m_z = block[: d * d], block[d * d :]
            cross = -torch.einsum("ib,ia,ic->bac", w, a, w).reshape(d * d, d)
            # the (S, S) part applied as (W^T W) (x) I_d, never formed: d^3 r flops where the dense
            # d^2 x d^2 block's product takes d^4 r (~2.2 of the 4.7 GFLOP of one call, reference shape)
            on_s = ((w.T @ w) @ m_s.reshape(d, -1)).reshape(d * d, -1) + cross @ m_z
            on_z = cross.T @ m_s + ((w * a.square().sum(1, keepdim=True)).T @ w) @ m_z
            out += m_s.T @ on_s + m_z.T @ on_z
        return out

    def _statistics_values(self, inp: jac.HeadInputs) -> torch.Tensor:
        """Every sequence's (S_b, z_b), flattened and stacked: (B (d^2 + d),)."""
        out = []
        for x in inp.xs:
            phi_k, v = feature_map(x @ inp.w["k"].T), x @ inp.w["v"].T
            out.append(torch.cat([(phi_k.T @ v).reshape(-1), phi_k.sum(0)]))
        return torch.cat(out)

    def _unseen_statistics(self, inp: jac.HeadInputs, stats: torch.Tensor) -> torch.Tensor:
        """``_unseen_directions`` of head h (it depends on the head's weights and the probe only),
        from the statistics and outputs the head already formed."""
        outputs = [a for _, a in self._output_weights(inp)]
        return self._cached(("unseen_statistics", inp.h), lambda: _unseen_directions(inp, stats, outputs))

    def symmetries(self, inp: jac.HeadInputs) -> dict[str, dict[str, torch.Tensor]]:
        """Two groups, each kept to the combinations the K/V parameters of the scope can realise
        (``_reachable``; phi = elu + 1 is not homogeneous, so a sequence's own scale, say, may be out
        of reach while a combination is not):

        * ``unseen_statistics``: changes of a sequence's (S_b, z_b) that none of its queries sees
          (``_unseen_directions``): at eps = 0 its scale always, and far more in a sequence with
          fewer tokens than the head dimension; a parameter direction theta whose G theta is one
          of them is null;
        * ``feature_gauge``: dA_i = 0 whenever dphi_i = (E_b + c_i I) phi_i for the tokens i of
          sequence b and (dS_b, dz_b) = -E_b^T (S_b, z_b) plus an unseen change (S^T - A_i z^T
          kills phi_i, so any c_i is free): the query-side solutions come from
          ``_feature_directions``; the K/V side from G."""
        kv = [b for b in ("k", "v") if b in inp.blocks]
        d, dim = inp.d, inp.dim
        per = d * d + d
        st = self._statistics_jacobian(inp, kv) if kv else None
        stats = st.stats if st is not None else self._statistics_values(inp)
        unseen = self._unseen_statistics(inp, stats)
        groups: dict[str, dict[str, torch.Tensor]] = {}
        if kv:
            combos, theta = _reachable(unseen, st, float(stats.norm()))
            if combos.shape[1]:
                parts = theta.T.reshape(-1, len(kv), d, dim)
                groups["unseen_statistics"] = {b: parts[:, i] for i, b in enumerate(kv)}
        if "q" in inp.blocks:
            dq, e = self._query_directions(inp)
            # (dS_b, dz_b) = -E_b^T (S_b, z_b) for every sequence, one column per direction
            per_sequence = stats.reshape(len(inp.xs), per)
            s_mats, z_vecs = per_sequence[:, : d * d].reshape(-1, d, d), per_sequence[:, d * d :]
            ds = -torch.einsum("msbc,sbv->mscv", e, s_mats).reshape(len(e), len(inp.xs), d * d)
            dz = -torch.einsum("msbc,sb->msc", e, z_vecs)
            targets = torch.cat([ds, dz], 2).reshape(len(e), -1).T
            combos, theta = _reachable(torch.cat([targets, unseen], 1), st, float(stats.norm()))
            if combos.shape[1]:
                dq = torch.cat([dq, dq.new_zeros(unseen.shape[1], d, dim)])
                group = {"q": torch.einsum("jm,jbc->mbc", combos, dq)}
                if kv:
                    parts = theta.T.reshape(-1, len(kv), d, dim)
                    group.update({b: parts[:, i] for i, b in enumerate(kv)})
                groups["feature_gauge"] = group
        return groups


def _unseen_directions(inp: jac.HeadInputs, stats: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor:
    """A basis of the statistics changes no query sees, (B (d^2 + d), m) in the statistics layout,
    at the statistics' size: per sequence the null space of J_psi, {(dS, dz) : Phi dS = diag(Phi dz) A}
    (Phi: its query features, (L, d); A: its outputs). With Phi = U Sigma V^T of rank r,
    dS = Phi^+ diag(Phi dz) A + N W for N the d - r features no query holds (V's last columns) and
    any W, the dz those whose diag(Phi dz) A lies in range(Phi): every dz where r = L (a sequence
    no longer than d), else generically dz ~ z alone (the scale). So (d - r) d + |dz| directions a
    sequence: a short one (L < d) leaves most of its d^2 + d statistics unseen. ``stats``: every
    sequence's (S, z) (``_statistics_values``); ``outputs``: each sequence's A."""
    d, per = inp.d, inp.d * inp.d + inp.d
    columns = []
    for s_idx, (x, a) in enumerate(zip(inp.xs, outputs)):
        phi_q = feature_map(x @ inp.w["q"].T)
        u, sv, vh = torch.linalg.svd(phi_q, full_matrices=True)
        r = int((sv > RANK_RTOL * sv[0]).sum())
        u_r = u[:, :r]
        lifted = phi_q.T[:, :, None] * a[None]  # (d, L, d): diag(Phi e_c) A for each dz = e_c
        if r == len(x):
            dz = torch.eye(d, dtype=x.dtype, device=x.device)
        else:
            off = lifted - u_r @ (u_r.T @ lifted)  # its part out of range(Phi)
            _, s_off, vh_off = torch.linalg.svd(off.reshape(d, -1).T, full_matrices=False)
            s_off = torch.cat([s_off, s_off.new_zeros(d - s_off.numel())])
            scale = float(torch.linalg.matrix_norm(lifted.reshape(d, -1), ord=2))
            dz = vh_off[s_off <= RANK_RTOL * scale].T  # (d, m_z)
        ds = vh[:r].T @ ((u_r.T @ torch.einsum("cla,cm->mla", lifted, dz)) / sv[:r, None])  # Phi^+ R
        block = x.new_zeros(per, dz.shape[1] + (d - r) * d)
        block[: d * d, : dz.shape[1]] = ds.reshape(dz.shape[1], d * d).T
        block[d * d :, : dz.shape[1]] = dz
        # dS = n e_a^T for each feature direction n no query holds and each value coordinate a
        unheld = torch.einsum("bn,ac->banc", vh[r:].T, torch.eye(d, dtype=x.dtype, device=x.device))
        block[: d * d, dz.shape[1] :] = unheld.reshape(d * d, -1)
        if block.shape[1] == 1 and r == d:
            # the scale alone (a long sequence): (S, z) itself, as before (an orthonormal column
            # there let two near-null directions of a trained layer through verification, measured)
            columns.append(stats[s_idx * per : (s_idx + 1) * per, None])
        else:
            # orthonormal columns at the statistics' size, as _reachable judges every residual
            # against it (dS = Phi^+ ... grows as 1 / sigma_min(Phi); unscaled, next to a 254-token
            # sequence, a 32-token one lost one direction of K's scope and an 8-token one's
            # residual SVD did not converge)
            columns.append(torch.linalg.qr(block).Q * stats.norm())
    return torch.block_diag(*columns)  # sequence s's rows, its own columns


def _feature_directions(inp: jac.HeadInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Query-side directions (dW_Q, E) with phi'(q_i) * (dW_Q x_i) = (E_s + c_i I) phi(q_i) at every
    probe token i (of sequence s) for some c_i: ((m, d, D'), (m, B, d, d)), a basis of the
    solutions.

    A sequence whose query features are independent (no more tokens than d, ``_is_short``) can give
    its tokens any dphi through its own E_s (E_s Phi_s^T = dPhi_s^T is solvable), so only the other
    sequences' tokens constrain (dW_Q, E, c); E_s follows from dW_Q (the minimum-norm solution: the
    rest, E_s Phi_s^T = 0, changes the statistics only where its queries do not look, which
    ``_unseen_directions`` covers). The others share one E, as for one sequence: an E per long
    sequence is valid too, but no measured probe needed it, and keeping the shared E keeps every
    probe without a short sequence on the construction its kappa was checked on (a trained layer's
    verification is that sensitive: see ``_unseen_directions``).

    Row b of that system reads phi'_b * (X u_b) = Phi E_b + c * phi_b (u_b, E_b: rows b of dW_Q, E;
    columns over the long sequences' tokens), so it splits by row once c is known. With c = 0 the
    solutions of row b are the null space of A_b = [phi'_b * X, -Phi] (features whose queries
    keep one sign over the probe give them: phi = q + 1 is affine in x where q > 0, phi' = phi
    where q <= 0, and a token where a feature leaves its sign costs one condition). A c != 0 is
    solvable when every c * phi_b lies in range(A_b) (c constant always is: E = I); each such c
    adds one direction across the rows."""
    d, dim = inp.d, inp.dim
    q_all = [seq @ inp.w["q"].T for seq in inp.xs]
    short = [_is_short(feature_map(q)) for q in q_all]
    x = torch.cat([seq for seq, s in zip(inp.xs, short) if not s] or [inp.xs[0][:0]])
    q = x @ inp.w["q"].T
    phi = feature_map(q)
    dphi = feature_map_derivative(q)
    homogeneous, complements, solvers = [], [], []
    for b in range(d if len(x) else 0):
        a_b = torch.cat([dphi[:, b, None] * x, -phi], 1)  # (T, D' + d)
        u_b, s_b, vh_b = torch.linalg.svd(a_b, full_matrices=True)
        rank = int((s_b > RANK_RTOL * s_b[0]).sum())
        for vec in vh_b[rank:]:
            homogeneous.append((b, vec))
        complements.append(u_b[:, rank:].T * phi[:, b])  # rows: conditions on c
        solvers.append((u_b[:, :rank], s_b[:rank], vh_b[:rank]))
    if not len(x):  # every sequence short: any dW_Q
        eye = torch.eye(d * dim, dtype=inp.xs[0].dtype, device=inp.xs[0].device)
        dq, e_long = eye.reshape(-1, d, dim), eye.new_zeros(d * dim, d, d)
    else:
        conditions = torch.cat(complements)
        if conditions.shape[0]:
            # tall, so vh_c is complete; from its triangular factor (same s and Vh): the SVD of the
            # tall matrix forms its left vectors too
            r_c = torch.linalg.qr(conditions, mode="r").R
            _, s_c, vh_c = torch.linalg.svd(r_c, full_matrices=False)
            s_c = torch.cat([s_c, s_c.new_zeros(len(x) - s_c.numel())])
            c_basis = vh_c[s_c <= RANK_RTOL * float(s_c[0])].T
        else:
            c_basis = torch.eye(len(x), dtype=x.dtype, device=x.device)
        m = len(homogeneous) + c_basis.shape[1]
        dq, e_long = x.new_zeros(m, d, dim), x.new_zeros(m, d, d)
        for j, (b, vec) in enumerate(homogeneous):
            dq[j, b], e_long[j, b] = vec[:dim], vec[dim:]
        for j, c in enumerate(c_basis.T, start=len(homogeneous)):
            for b, (u_b, s_b, vh_b) in enumerate(solvers):  # the minimum-norm solution of row b
                vec = vh_b.T @ ((u_b.T @ (c * phi[:, b])) / s_b)
                dq[j, b], e_long[j, b] = vec[:dim], vec[dim:]
    per_sequence = []
    for seq, q_s, is_short in zip(inp.xs, q_all, short):
        if not is_short:
            per_sequence.append(e_long)
            continue
        # E_s = (Phi_s^+ dPhi_s)^T, dPhi_s = phi'(q_s) * (X_s dW_Q^T), per direction
        d_phi = feature_map_derivative(q_s) * torch.einsum("lc,mbc->mlb", seq, dq)
        per_sequence.append((torch.linalg.pinv(feature_map(q_s)) @ d_phi).transpose(1, 2))
    return dq, torch.stack(per_sequence, 1)


def _is_short(phi: torch.Tensor) -> bool:
    """Whether a sequence's query features (L, d) are independent (full row rank: L <= d)."""
    if len(phi) > phi.shape[1]:
        return False
    s = torch.linalg.svdvals(phi)
    return bool(s[-1] > RANK_RTOL * s[0])


# Relative residual below which a statistics target counts as reached by the K/V parameters: reached
# targets leave ~1e-15 (round-off), out-of-reach ones O(1); the probe verifies each group anyway.
REACH_RTOL = 1e-9


GBlock = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a diagonal block of G: its rows, columns, entries


def _statistics_blocks(inp: jac.HeadInputs, blocks: list[str]) -> tuple[int, list[GBlock], torch.Tensor]:
    """G = d (S_b, z_b) / d (W_K, W_V) in closed form, as independent diagonal blocks (rows into
    the statistics, columns into the parameters, the block): with phi'_j = elu'(k_j),
        dS[b, a] / dW_K[b, c] = sum_j phi'_jb v_ja x_jc,  dz[b] / dW_K[b, c] = sum_j phi'_jb x_jc,
        dS[b, a] / dW_V[a, c] = sum_j phi_jb x_jc,
    so W_K's row b reaches only (S[b, :], z[b]) and W_V's row a only S[:, a]: d blocks each, of
    B (d + 1) x D' and B d x D' (instead of one B (d^2 + d) x 2 d D' matrix). With both blocks the
    two couple through S: one dense block.

    Every sum above is a combination of the input rows x_j, so G vanishes on the input's null
    directions (e.g. a LayerNorm's): the columns are taken in an orthonormal basis V_x of the rows'
    span (input coordinates x V_x), which leaves G of full column rank where it is tall (several
    probe sequences) instead of rank-deficient by 2 d per null direction. Returns (number of
    parameters in those coordinates, blocks, V_x)."""
    d = inp.d
    per = d * d + d
    n_seq = len(inp.xs)
    device = inp.w["k"].device
    seq = torch.arange(n_seq, device=device)[:, None] * per
    ar = torch.arange(d, device=device)
    _, sv, vh = torch.linalg.svd(torch.cat(inp.xs), full_matrices=False)
    rank = int((sv > RANK_RTOL * sv[0]).sum())
    v_x = vh[:rank].T if rank else torch.eye(inp.dim, dtype=vh.dtype, device=device)  # (D', r_x)
    dim = v_x.shape[1]
    n_k, n_c = [], []  # per sequence: (d, d, r_x) K-side sums, (d, r_x) z sums; (d, r_x) V-side sums
    for x in inp.xs:
        k, xr = x @ inp.w["k"].T, x @ v_x
        if "k" in blocks:
            dphi = feature_map_derivative(k)
            n_k.append((torch.einsum("jb,ja,jc->bac", dphi, x @ inp.w["v"].T, xr), dphi.T @ xr))
        if "v" in blocks:
            n_c.append(feature_map(k).T @ xr)
    values = torch.cat(n_c) if n_c else None  # V: the same block for every a
    k_parts, v_parts = [], []
    for row in range(d):  # W_K's row b, W_V's row a
        cols = torch.arange(row * dim, (row + 1) * dim, device=device)
        if "k" in blocks:
            k_rows = torch.cat([(seq + row * d + ar).flatten(), (seq + d * d + row).flatten()])
            k_mat = torch.cat(
                [torch.stack([ns[row] for ns, _ in n_k]).reshape(-1, dim)] + [nz[row][None] for _, nz in n_k]
            )
            k_parts.append((k_rows, cols, k_mat))
        if "v" in blocks:
            v_parts.append(((seq[:, :, None] + ar[None, :, None] * d + row).flatten(), cols, values))
    if blocks != ["k", "v"]:  # one block alone: its d diagonal blocks
        return d * dim, k_parts + v_parts, v_x
    # both: W_K's and W_V's rows reach the same rows of S, so G is one block
    g = inp.w["k"].new_zeros(n_seq * per, 2 * d * dim)
    for rows, cols, mat in k_parts + [(rows, cols + d * dim, mat) for rows, cols, mat in v_parts]:
        g[rows[:, None], cols[None, :]] = mat
    everything = (torch.arange(n_seq * per, device=device), torch.arange(2 * d * dim, device=device))
    return 2 * d * dim, [(*everything, g)], v_x


class _Statistics:
    """(S_b, z_b) stacked (``stats``) and their Jacobian G given as independent diagonal blocks,
    each factored once: an orthonormal basis ``p`` of G's row space, G P (``gp``), G's range
    (``residual``) and G^+ (``min_norm``); statistics no block reaches are out of range.

    A block is usually wide (one probe sequence) and of full row rank: a QR B^T = Q R (``_factor``)
    gives its basis, every target on its rows is in range, B^+ t = Q R^-T t (a QR, not an SVD, of
    the block). A tall block (several probe sequences) of full
    column rank is factored B = U R by Householder QR (U kept as its reflectors): its basis is the
    identity, B^+ t = R^-1 U^T t. Otherwise the rank is decided on an SVD: on singular values accurate to
    eps * sigma_max (through the Gram, null and genuine values below ~1e-6 blur)."""

    def __init__(self, stats: torch.Tensor, n_params: int, blocks: list[GBlock], v_x: torch.Tensor) -> None:
        self.stats, self.v_x = stats, v_x  # parameters in input coordinates x V_x (see _statistics_blocks)
        self._n_reduced = n_params
        self.n_params = n_params // v_x.shape[1] * v_x.shape[0]  # in the parameters' own layout
        self._blocks, factored, widths = [], {}, []
        for rows, cols, mat in blocks:
            if id(mat) not in factored:
                factored[id(mat)] = _factor(mat)
            self._blocks.append((rows, cols, mat, factored[id(mat)]))
            basis = factored[id(mat)][0]
            widths.append(mat.shape[1] if basis is None else basis.shape[1])
        p = stats.new_zeros(n_params, sum(widths))
        whole = len(blocks) == 1 and tuple(blocks[0][2].shape) == (len(stats), n_params)
        if whole and self._blocks[0][3][0] is None:  # G alone, of full column rank: G P = G
            self.gp = blocks[0][2]  # (no copy: the tiny split's is 4224 x 4096 a head)
        else:
            self.gp = stats.new_zeros(len(stats), sum(widths))
        start = 0
        for (rows, cols, mat, (basis, r, span, sv)), width in zip(self._blocks, widths):
            if basis is None:  # the identity, never formed
                p[cols, torch.arange(start, start + width, device=p.device)] = 1.0
            else:
                p[cols, start : start + width] = basis
            if span is None:  # mat^T = Q R gives mat Q = R^T (Q orthonormal to ~eps): no product
                self.gp[rows, start : start + width] = r.T
            elif sv is None:  # full column rank: the basis is the identity
                if self.gp is not mat:
                    self.gp[rows, start : start + width] = mat
            else:
                self.gp[rows, start : start + width] = mat @ basis
            start += width
        self.p = self._expand(p)

    def _expand(self, m: torch.Tensor) -> torch.Tensor:
        """Parameter directions in input coordinates x V_x -> the parameters' layout (d D' each row)."""
        r_x, k = self.v_x.shape[1], m.shape[1]
        rows = m.shape[0] // r_x
        # V_x times each row's block, as one batched matmul (not an einsum: docs/benchmarks.md)
        return torch.matmul(self.v_x, m.reshape(rows, r_x, k)).reshape(rows * self.v_x.shape[0], k)

    def residual(self, targets: torch.Tensor) -> torch.Tensor:
        """targets minus their projection on range(G)."""
        out = targets.clone()
        for rows, _, _, (_, _, span, _) in self._blocks:
            if span is None:
                out[rows] = 0.0  # full row rank: every target on these rows is reached
            else:
                out[rows] = targets[rows] - span.project(targets[rows])
        return out

    def min_norm(self, targets: torch.Tensor) -> torch.Tensor:
        """G^+ targets (for targets in range(G): the minimum-norm theta with G theta = targets)."""
        out = targets.new_zeros(self._n_reduced, targets.shape[1])
        for rows, cols, _, (basis, r, span, sv) in self._blocks:
            t = targets[rows]
            if span is None:
                out[cols] = basis @ torch.linalg.solve_triangular(r.T, t, upper=False)
            elif sv is None:  # mat = U R, full column rank
                out[cols] = torch.linalg.solve_triangular(r, span.coordinates(t), upper=True)
            else:
                out[cols] = basis @ (span.coordinates(t) / sv[:, None])
        return self._expand(out)


class _Range:
    """An orthonormal basis U of a block's range: the SVD's U, or a tall block's Householder
    reflectors (U their first n columns, applied and never formed)."""

    def __init__(self, u: torch.Tensor | None = None, reflectors: tuple | None = None) -> None:
        self.u, self.reflectors = u, reflectors

    def coordinates(self, t: torch.Tensor) -> torch.Tensor:  # U^T t
        if self.u is not None:
            return self.u.T @ t
        a, tau = self.reflectors  # type: ignore[misc]
        return torch.ormqr(a, tau, t, transpose=True)[: a.shape[1]]

    def project(self, t: torch.Tensor) -> torch.Tensor:  # U U^T t
        if self.u is not None:
            return self.u @ (self.u.T @ t)
        a, tau = self.reflectors  # type: ignore[misc]
        y = torch.ormqr(a, tau, t, transpose=True)
        y[a.shape[1] :] = 0.0
        return torch.ormqr(a, tau, y)


# A block is taken as of full rank when its R's estimated condition number is below this (from
# below, usually within ~2x: ``triangular_condition``): far under the SVD's rank cut (1 / RANK_RTOL
# = 1e10), so an underestimate cannot turn a rank-deficient block into a full one.
FULL_RANK_KAPPA = 1e8


def _factor(
    mat: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None, _Range | None, torch.Tensor | None]:
    """How a statistics block is factored, by Householder QR of its tall side when R shows full
    rank: a wide ``mat`` as mat^T = Q R, (row-space basis Q, R, None, None); a tall one as
    mat = U R, (None: the identity, R, its range as U's reflectors (U never formed: it only meets
    targets), None). Otherwise the rank is the SVD's: (basis, None, the SVD's range, s)."""
    wide = mat.shape[0] <= mat.shape[1]
    a, tau = torch.geqrf(mat.T if wide else mat)
    r = a[: min(mat.shape)].triu()
    if triangular_condition(r) <= FULL_RANK_KAPPA:
        if wide:
            return torch.linalg.householder_product(a, tau), r, None, None
        return None, r, _Range(reflectors=(a, tau)), None
    u, sv, vh = torch.linalg.svd(mat, full_matrices=False)
    rank = int((sv > RANK_RTOL * sv[0]).sum())
    return vh[:rank].T, None, _Range(u[:, :rank]), sv[:rank]


def _reachable(
    targets: torch.Tensor, st: _Statistics | None, reference: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The combinations C (m, k, orthonormal) of the statistics targets (columns of ``targets``)
    that lie in the range of G (residual <= REACH_RTOL * ``reference``, the size of the
    statistics), and the minimum-norm parameter directions theta (n, k) with G theta = targets C.
    No G (a scope without K/V) reaches only the zero target."""
    residual = st.residual(targets) if st is not None else targets
    # rh must be complete (m x m); a tall residual gives it without the (rows x rows) U
    _, s, rh = torch.linalg.svd(residual, full_matrices=residual.shape[0] < residual.shape[1])
    s_full = torch.cat([s, s.new_zeros(targets.shape[1] - s.numel())])
    combos = rh[s_full <= REACH_RTOL * reference].T
    if st is None:
        return combos, targets.new_zeros(0, combos.shape[1])
    return combos, st.min_norm(targets @ combos)
