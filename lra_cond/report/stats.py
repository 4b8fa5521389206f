"""Statistics over seeds: mean ± std, steps-to-target from a validation history, speedup with a
bootstrap interval. Definitions here are the ones the report states in its text."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Float round-off guard: a run whose accuracy equals the target (e.g. every seed identical) reaches it.
TARGET_TOL = 1e-12
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Summary:
    mean: float
    std: float  # sample std (ddof=1); nan with fewer than two values
    n: int


def summarize(values: Sequence[float | None]) -> Summary | None:
    """Mean and sample standard deviation (ddof=1) of the values that are not None."""
    xs = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if xs.size == 0:
        return None
    std = float(xs.std(ddof=1)) if xs.size > 1 else math.nan
    return Summary(float(xs.mean()), std, int(xs.size))


def first_step_reaching(val_history: Sequence[Sequence[float]], target: float) -> int | None:
    """First validation step with accuracy >= target (history as ``[[step, acc], ...]``)."""
    for step, acc in sorted(val_history, key=lambda e: e[0]):
        if acc >= target - TARGET_TOL:
            return int(step)
    return None


def steps_per_epoch(metrics: dict) -> float | None:
    """Training batches per epoch, recovered from ``total_steps / total_epochs``."""
    steps, epochs = metrics.get("total_steps"), metrics.get("total_epochs")
    if not steps or not epochs:
        return None
    return steps / epochs


@dataclass(frozen=True)
class Speedup:
    percent: float  # 100 * (1 - mean(steps_init) / mean(steps_default))
    low: float | None  # 95% percentile-bootstrap interval; None with fewer than two runs per side
    high: float | None


def speedup(steps_init: Sequence[float], steps_default: Sequence[float]) -> Speedup | None:
    """Relative reduction of the mean steps-to-target versus default, in percent.

    Interval: percentile bootstrap, resampling the seeds of each init independently with
    replacement (``BOOTSTRAP_RESAMPLES`` resamples, numpy generator seeded ``BOOTSTRAP_SEED``), the
    2.5th and 97.5th percentiles of the resampled speedups.
    """
    a = np.asarray(steps_init, dtype=np.float64)
    b = np.asarray(steps_default, dtype=np.float64)
    if a.size == 0 or b.size == 0 or b.mean() <= 0:
        return None
    point = 100.0 * (1.0 - a.mean() / b.mean())
    if a.size < 2 or b.size < 2:
        return Speedup(point, None, None)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    ma = a[rng.integers(0, a.size, (BOOTSTRAP_RESAMPLES, a.size))].mean(axis=1)
    mb = b[rng.integers(0, b.size, (BOOTSTRAP_RESAMPLES, b.size))].mean(axis=1)
    ok = mb > 0  # a resample of default steps all at step 0 has no defined ratio
    boot = 100.0 * (1.0 - ma[ok] / mb[ok])
    low, high = np.percentile(boot, [2.5, 97.5])
    return Speedup(point, float(low), float(high))
