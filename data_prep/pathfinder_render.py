"""Anti-aliased rendering of Pathfinder paddles and markers (numpy, small patches per shape).

A paddle is a ``length x thickness`` box convolved with a separable tent filter of half-width ``blur``
pixels (a smooth anti-aliasing kernel, evaluated in closed form); a marker is a disc of ``radius`` filtered
the same way along the radius. Intensity = contrast x coverage, combined by maximum (as the reference),
clipped to 1 and stored as ``round(255 v)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def tent_cdf(x: np.ndarray) -> np.ndarray:
    """CDF of the unit tent filter (support [-1, 1])."""
    return np.where(x < 0, 0.5 * np.clip(x + 1, 0, 1) ** 2, 1 - 0.5 * np.clip(1 - x, 0, 1) ** 2)


def box_tent(x: np.ndarray, width: np.ndarray | float, blur: float) -> np.ndarray:
    """A box of ``width`` centred at 0, convolved with a tent of half-width ``blur``, evaluated at x."""
    return tent_cdf((x + width / 2) / blur) - tent_cdf((x - width / 2) / blur)


def _stamp(canvas: np.ndarray, pad: int, patch: int, centres: np.ndarray, value_fn: Callable) -> None:
    """Max-combine ``value_fn(drow, dcol)`` on a patch x patch window around each centre."""
    base = np.floor(centres).astype(np.int64) - (patch // 2 - 1)
    steps = np.arange(patch)
    dr = (base[:, 0, None] + steps - centres[:, 0, None])[:, :, None]  # (n, P, 1)
    dc = (base[:, 1, None] + steps - centres[:, 1, None])[:, None, :]  # (n, 1, P)
    values = value_fn(dr, dc)  # (n, P, P)
    for (r, c), v in zip(base + pad, values):
        view = canvas[r : r + patch, c : c + patch]
        np.maximum(view, v, out=view)


def render(
    size: int,
    paddles: np.ndarray,
    contrasts: np.ndarray,
    thickness: float,
    markers: np.ndarray,
    marker_radius: float,
    marker_contrast: float = 1.0,
    blur: float = 1.0,
) -> np.ndarray:
    """Image (size x size, uint8) of paddles (n, 2, 2) with per-paddle contrast, plus round markers (m, 2)."""
    length = np.sqrt(((paddles[:, 1] - paddles[:, 0]) ** 2).sum(-1)) if len(paddles) else np.zeros(0)
    reach = max(
        math.hypot(float(length.max(initial=0)) / 2 + blur, thickness / 2 + blur), marker_radius + blur
    )
    patch = 2 * math.ceil(reach) + 2
    pad = patch
    canvas = np.zeros((size + 2 * pad, size + 2 * pad))
    if len(paddles):
        u = (paddles[:, 1] - paddles[:, 0]) / np.maximum(length, 1e-12)[:, None]
        ur, uc = u[:, 0, None, None], u[:, 1, None, None]
        lengths, gain = length[:, None, None], contrasts[:, None, None]

        def paddle_value(dr: np.ndarray, dc: np.ndarray) -> np.ndarray:
            along = dr * ur + dc * uc
            across = dr * uc - dc * ur
            return gain * box_tent(along, lengths, blur) * box_tent(across, thickness, blur)

        _stamp(canvas, pad, patch, paddles.mean(axis=1), paddle_value)
    if len(markers):

        def marker_value(dr: np.ndarray, dc: np.ndarray) -> np.ndarray:
            return marker_contrast * box_tent(np.sqrt(dr * dr + dc * dc), 2 * marker_radius, blur)

        _stamp(canvas, pad, patch, np.asarray(markers, dtype=float), marker_value)
    image = canvas[pad : pad + size, pad : pad + size]
    return np.rint(np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)
