"""Statistics over seeds: mean ± std, steps-to-target from a validation history, speedup with a
bootstrap interval. Definitions here are the ones the report states in its text."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# A run whose accuracy equals the target reaches it. Accuracies are logged as float32 (k / n held to
# ~3e-8), so the target, a mean of several, can sit ~1e-8 above a run's equal accuracy; 1e-6 is far
# below one example of any split (5e-4 on ListOps' 2000).
TARGET_TOL = 1e-6
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


# Two-sided 95% quantiles of Student's t by degrees of freedom (1..30), then the normal's 1.96.
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_interval(values: Sequence[float | None]) -> tuple[float, float, float] | None:
    """Mean and 95% Student-t interval of the values that are not None: mean -/+ t(0.975, n - 1)
    s / sqrt(n); the interval is (nan, nan) with one value."""
    s = summarize(values)
    if s is None:
        return None
    if s.n < 2:
        return s.mean, math.nan, math.nan
    t = T_975[s.n - 2] if s.n - 2 < len(T_975) else 1.96
    half = t * s.std / math.sqrt(s.n)
    return s.mean, s.mean - half, s.mean + half


def log10_summary(values: Sequence[float | None]) -> Summary | None:
    """Mean ± std of log10 of the positive values: a geometric mean and its spread in decades, the
    scale on which condition numbers of 1e3 and 1e9 average meaningfully."""
    return summarize([math.log10(v) for v in values if v is not None and v > 0])


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy ``p`` measured on ``n`` independent examples."""
    return math.sqrt(p * (1 - p) / n)


@dataclass(frozen=True)
class Speedup:
    percent: float  # 100 * (1 - mean(steps_init) / mean(steps_default)) over the paired seeds
    low: float | None  # 95% paired percentile-bootstrap interval; None with fewer than two pairs
    high: float | None


def speedup(steps_init: Sequence[int | None], steps_default: Sequence[int | None]) -> Speedup | None:
    """Relative reduction of the mean steps-to-target versus default, in percent, seed by seed: over
    the seeds (positions of the two lists) where both runs reached the target. A run that never
    reached it is censored (it would need more steps than the run had, by how many is unknown), so
    its seed leaves the comparison rather than counting as the run's length.

    Interval: paired percentile bootstrap, resampling those seeds with replacement
    (``BOOTSTRAP_RESAMPLES`` resamples, numpy generator seeded ``BOOTSTRAP_SEED``), the 2.5th and
    97.5th percentiles of the resampled speedups; None with fewer than two such seeds.
    """
    pairs = [(a, b) for a, b in zip(steps_init, steps_default) if a is not None and b is not None]
    if not pairs:
        return None
    a = np.asarray([p[0] for p in pairs], dtype=np.float64)
    b = np.asarray([p[1] for p in pairs], dtype=np.float64)
    if b.mean() <= 0:
        return None
    point = 100.0 * (1.0 - a.mean() / b.mean())
    if a.size < 2:
        return Speedup(point, None, None)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    idx = rng.integers(0, a.size, (BOOTSTRAP_RESAMPLES, a.size))
    ma, mb = a[idx].mean(axis=1), b[idx].mean(axis=1)
    ok = mb > 0  # a resample of default steps all at step 0 has no defined ratio
    boot = 100.0 * (1.0 - ma[ok] / mb[ok])
    low, high = np.percentile(boot, [2.5, 97.5])
    return Speedup(point, float(low), float(high))
