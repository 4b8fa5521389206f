"""PNG plots of a comparison: val accuracy, κ(J) and κ(X) per layer and weight condition numbers vs
step, one line per init with a min–max band over seeds. Condition numbers span decades between
seeds and layers, so their lines are geometric means (an arithmetic mean is the largest value's)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from lra_cond.report.collect import Run  # noqa: E402

Series = list[tuple[int, float]]


def geometric_mean(values: Iterable[float]) -> float:
    """10 ** the mean of log10: the centre of values spread over decades."""
    return float(10 ** np.log10(np.asarray(list(values), dtype=np.float64)).mean())


def aggregate(
    series: Iterable[Series], geometric: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean (``geometric``: 10 ** the mean of log10), min and max over the seeds that have a
    value at each step."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for s in series:
        for step, value in s:
            by_step[int(step)].append(float(value))
    steps = np.array(sorted(by_step))
    values = [np.array(by_step[s]) for s in steps]
    return (
        steps,
        np.array([geometric_mean(v) if geometric else v.mean() for v in values]),
        np.array([v.min() for v in values]),
        np.array([v.max() for v in values]),
    )


def _draw(ax: plt.Axes, runs: list[Run], series_of: Callable[[Run], Series], geometric: bool = False) -> bool:
    drawn = False
    for init in dict.fromkeys(r.init for r in runs):
        group = [r for r in runs if r.init == init]
        series = [s for s in map(series_of, group) if s]
        if not series:
            continue
        steps, mean, low, high = aggregate(series, geometric)
        (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=f"{init} (n={len(series)})")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        drawn = True
    return drawn


def _val_acc(run: Run) -> Series:
    return [(s, 100 * a) for s, a in run.metrics.get("val_history") or []]


def _layer_values(key: str, layer: int) -> Callable[[Run], Series]:
    """A layer's ``key`` (``kappa``: κ(J), ``kappa_x``: κ of its probe input) at every probe."""

    def series(run: Run) -> Series:
        out = []
        for e in run.metrics.get("cond_history") or []:
            layers = e.get("layers") or []
            value = layers[layer].get(key) if layer < len(layers) else None
            if value is not None and value > 0:
                out.append((e["step"], float(value)))
        return out

    return series


def _n_layers(runs: list[Run]) -> int:
    return max(
        (len(e.get("layers") or []) for r in runs for e in r.metrics.get("cond_history") or []), default=0
    )


def _weights_kappa(block: str) -> Callable[[Run], Series]:
    """κ of the stacked W_block, geometric mean over layers."""

    def series(run: Run) -> Series:
        out = []
        for e in run.metrics.get("cond_history") or []:
            ks = [layer["weights"][block]["stacked"] for layer in e.get("layers", []) if "weights" in layer]
            if ks:
                out.append((e["step"], geometric_mean(ks)))
        return out

    return series


def _finish(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def val_acc_figure(
    runs: list[Run],
    title: str,
    target: float | None = None,
    chance: float | None = None,
    frequent: float | None = None,
) -> tuple[plt.Figure, bool]:
    """Validation accuracy vs step per init, with the target accuracy, the chance level and the
    test split's frequent-class rate (what always answering that class scores) as horizontal lines;
    and whether any run had a validation."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = _draw(ax, runs, _val_acc)
    if target is not None:
        ax.axhline(
            100 * target,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"target {100 * target:.2f}% (default, best val)",
        )
    if chance is not None:
        ax.axhline(
            100 * chance, color="grey", linestyle=":", linewidth=1, label=f"chance {100 * chance:.0f}%"
        )
    if frequent is not None:
        ax.axhline(
            100 * frequent,
            color="tab:red",
            linestyle="-.",
            linewidth=1,
            label=f"frequent class {100 * frequent:.1f}% (test split)",
        )
    ax.set(xlabel="optimizer step", ylabel="validation accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    if ok:
        ax.legend(title="init")
    return fig, ok


KAPPA_ROWS = [("kappa", "attention Jacobian κ(J)"), ("kappa_x", "probe input κ(X)")]


def kappa_figure(runs: list[Run], title: str) -> tuple[plt.Figure, bool]:
    """κ(J) (top row) and κ(X) of the probe input (bottom row) vs step, one column per layer, log
    scale; and whether any run had a probe."""
    n = max(_n_layers(runs), 1)
    fig, axes = plt.subplots(2, n, figsize=(5.5 * n + 1, 8), squeeze=False, sharex=True)
    ok = False
    for layer in range(n):
        for row, (key, name) in enumerate(KAPPA_ROWS):
            ax = axes[row][layer]
            if _draw(ax, runs, _layer_values(key, layer), geometric=True):
                ok = True
                ax.set_yscale("log")
            ax.set(title=f"{name}, layer {layer}", ylabel=name.split(" ")[-1])
            ax.grid(alpha=0.3, which="both")
        axes[1][layer].set_xlabel("optimizer step")
    if ok:
        axes[0][0].legend(title="init")
    fig.suptitle(title)
    return fig, ok


def weights_figure(runs: list[Run], title: str) -> tuple[plt.Figure, bool]:
    """κ of the stacked W_Q, W_K, W_V vs step, log scale; and whether any run had a probe."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=True)
    ok = False
    for ax, block in zip(axes, "qkv"):
        ok |= _draw(ax, runs, _weights_kappa(block), geometric=True)
        ax.set(xlabel="optimizer step", title=f"κ(W_{block.upper()}), all heads stacked")
        ax.grid(alpha=0.3, which="both")
    if ok:
        for ax in axes:
            ax.set_yscale("log")
        axes[0].set_ylabel("condition number, geometric mean over layers")
        axes[0].legend(title="init")
    fig.suptitle(title)
    return fig, ok


def plot_all(
    runs: list[Run],
    out_dir: Path,
    title: str,
    target: float | None = None,
    chance: float | None = None,
    setup: str = "",
    frequent: float | None = None,
) -> dict[str, Path | None]:
    """Write val_acc.png, kappa.png, weights_kappa.png; None for a plot without data (and no stale
    file from an earlier report). ``setup`` (a line: steps, batch, lr, ...) goes under the accuracy
    plot's title."""
    band = "band: min–max over seeds"
    heading = "\n".join(t for t in (title, setup, f"line: mean over seeds, {band}") if t)
    figures = {
        "val_acc": val_acc_figure(runs, heading, target, chance, frequent),
        "kappa": kappa_figure(runs, f"{title} (line: geometric mean over seeds, {band})"),
        "weights_kappa": weights_figure(
            runs, f"{title}: weight condition numbers (line: geometric mean over seeds, {band})"
        ),
    }
    written: dict[str, Path | None] = {}
    for name, (fig, ok) in figures.items():
        path = out_dir / f"{name}.png"
        if ok:
            written[name] = _finish(fig, path)
        else:
            plt.close(fig)
            path.unlink(missing_ok=True)
            written[name] = None
    return written
