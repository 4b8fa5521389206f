"""Exact 2-D segment geometry for the Pathfinder generator (vectorised with numpy).

Points are (row, col) floats in pixel units; pixel (i, j) has its centre at (i, j).
"""

from __future__ import annotations

import numpy as np

FAR = 1e6  # coordinates of unused slots: never within any clearance of the image


def point_segment_sq(px, py, s0x, s0y, dx, dy, den):  # noqa: ANN001, ANN201 (broadcasting arrays)
    """Squared distance from points (px, py) to segments s0 + t d, t in [0, 1]; ``den = |d|^2``."""
    t = np.clip(((px - s0x) * dx + (py - s0y) * dy) / den, 0.0, 1.0)
    ex = px - s0x - t * dx
    ey = py - s0y - t * dy
    return ex * ex + ey * ey


def segment_distance_sq(
    a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray, crossing: bool = True
) -> np.ndarray:
    """Squared distances between segments ``a0-a1`` (..., K, 2) and ``b0-b1`` (..., M, 2): (..., K, M).

    The minimum of the four endpoint-to-segment distances, or 0 where the segments properly cross.
    Leading dimensions broadcast. ``crossing=False`` skips the crossing test: exact whenever one only
    asks "closer than keep?" with keep longer than every segment, because a crossing puts an endpoint
    of each segment within its own length of the other segment.
    """
    ax0, ay0, ax1, ay1 = (v[..., :, None] for v in (a0[..., 0], a0[..., 1], a1[..., 0], a1[..., 1]))
    bx0, by0, bx1, by1 = (v[..., None, :] for v in (b0[..., 0], b0[..., 1], b1[..., 0], b1[..., 1]))
    adx, ady, bdx, bdy = ax1 - ax0, ay1 - ay0, bx1 - bx0, by1 - by0
    aden = np.maximum(adx * adx + ady * ady, 1e-12)
    bden = np.maximum(bdx * bdx + bdy * bdy, 1e-12)
    d2 = np.minimum(
        np.minimum(
            point_segment_sq(ax0, ay0, bx0, by0, bdx, bdy, bden),
            point_segment_sq(ax1, ay1, bx0, by0, bdx, bdy, bden),
        ),
        np.minimum(
            point_segment_sq(bx0, by0, ax0, ay0, adx, ady, aden),
            point_segment_sq(bx1, by1, ax0, ay0, adx, ady, aden),
        ),
    )
    if not crossing:
        return d2
    # proper crossing: each segment's endpoints lie strictly on both sides of the other's line
    c1 = bdx * (ay0 - by0) - bdy * (ax0 - bx0)
    c2 = bdx * (ay1 - by0) - bdy * (ax1 - bx0)
    c3 = adx * (by0 - ay0) - ady * (bx0 - ax0)
    c4 = adx * (by1 - ay0) - ady * (bx1 - ax0)
    return np.where((c1 * c2 < 0) & (c3 * c4 < 0), 0.0, d2)


def segment_distance(a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """Euclidean distances between segments (see ``segment_distance_sq``)."""
    return np.sqrt(segment_distance_sq(a0, a1, b0, b1))


def unit(theta: np.ndarray | float) -> np.ndarray:
    """Unit vectors (row, col) for angles ``theta`` (radians); shape theta.shape + (2,)."""
    return np.stack([np.sin(theta), np.cos(theta)], axis=-1)


class BatchCanvas:
    """One piece list per row (image or attempt), padded with far-away pieces, for lockstep growth."""

    def __init__(self, rows: int, capacity: int, crossing: bool = True) -> None:
        self.crossing = crossing  # False only if every keep exceeds every piece length (see above)
        self.p0 = np.full((rows, capacity, 2), FAR)
        self.p1 = np.full((rows, capacity, 2), FAR)
        self.keep = np.zeros((rows, capacity))
        self.n = np.zeros(rows, dtype=np.int64)

    def add(self, rows: np.ndarray, q0: np.ndarray, q1: np.ndarray, keep: np.ndarray | float) -> np.ndarray:
        """Append one piece per row (q0, q1: (R, 2)); returns the positions written."""
        pos = self.n[rows]
        if len(pos) and pos.max() >= self.p0.shape[1]:
            raise RuntimeError("BatchCanvas capacity exceeded")
        self.p0[rows, pos], self.p1[rows, pos], self.keep[rows, pos] = q0, q1, keep
        self.n[rows] += 1
        return pos

    def truncate(self, rows: np.ndarray, n: np.ndarray) -> None:
        """Forget pieces of each row from its index ``n`` on (roll back failed snakes)."""
        drop = (np.arange(self.p0.shape[1])[None, :] >= n[:, None]) & (
            np.arange(self.p0.shape[1])[None, :] < self.n[rows][:, None]
        )
        r, c = np.nonzero(drop)
        self.p0[rows[r], c] = FAR
        self.p1[rows[r], c] = FAR
        self.keep[rows[r], c] = 0.0
        self.n[rows] = n

    def clear(
        self,
        rows: np.ndarray,
        q0: np.ndarray,
        q1: np.ndarray,
        ignore: np.ndarray | None = None,
        near: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Candidates ``q0-q1`` (R, C, 2) per row: True where they keep every piece's distance.

        ``ignore`` (R, k) lists piece positions to skip (a snake's own last pieces; -1 = none). ``near``
        = (centres (R, 2), radii (R,)) promises every candidate of a row lies within the radius of its
        centre, so pieces farther than ``radius + keep`` are skipped (exact pruning); the remaining
        pieces are gathered into a dense (R, M) block with M the largest count over rows.
        """
        p0, p1, keep = self.p0[rows], self.p1[rows], self.keep[rows]
        slots = np.arange(p0.shape[1])
        valid = slots[None, :] < self.n[rows][:, None]
        if ignore is not None:
            valid &= ~(slots[None, :, None] == ignore[:, None, :]).any(-1)
        if near is not None:
            c, radius = near
            dx, dy = p1[..., 0] - p0[..., 0], p1[..., 1] - p0[..., 1]
            d2 = point_segment_sq(
                c[:, 0, None],
                c[:, 1, None],
                p0[..., 0],
                p0[..., 1],
                dx,
                dy,
                np.maximum(dx * dx + dy * dy, 1e-12),
            )
            valid &= d2 <= (radius[:, None] + keep) ** 2
        m = int(valid.sum(1).max(initial=0))
        if m == 0:
            return np.ones(q0.shape[:2], dtype=bool)
        order = np.argsort(~valid, axis=1, kind="stable")[:, :m]
        g0 = np.take_along_axis(p0, order[..., None], 1)
        g1 = np.take_along_axis(p1, order[..., None], 1)
        gk = np.where(np.take_along_axis(valid, order, 1), np.take_along_axis(keep, order, 1), 0.0)
        d2 = segment_distance_sq(q0, q1, g0, g1, self.crossing)
        return (d2 >= (gk * gk)[:, None, :]).all(-1)
