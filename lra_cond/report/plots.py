"""PNG plots of a comparison: val accuracy, mean κ(J) and weight condition numbers vs step, one line
per init (mean over seeds) with a min–max band over seeds."""

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


def aggregate(series: Iterable[Series]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean, min and max over the seeds that have a value at each step."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for s in series:
        for step, value in s:
            by_step[int(step)].append(float(value))
    steps = np.array(sorted(by_step))
    values = [np.array(by_step[s]) for s in steps]
    return (
        steps,
        np.array([v.mean() for v in values]),
        np.array([v.min() for v in values]),
        np.array([v.max() for v in values]),
    )


def _draw(ax: plt.Axes, runs: list[Run], series_of: Callable[[Run], Series]) -> bool:
    drawn = False
    for init in dict.fromkeys(r.init for r in runs):
        group = [r for r in runs if r.init == init]
        series = [s for s in map(series_of, group) if s]
        if not series:
            continue
        steps, mean, low, high = aggregate(series)
        (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=f"{init} (n={len(series)})")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        drawn = True
    return drawn


def _val_acc(run: Run) -> Series:
    return [(s, 100 * a) for s, a in run.metrics.get("val_history") or []]


def _kappa_mean(run: Run) -> Series:
    return [
        (e["step"], e["kappa_mean"])
        for e in run.metrics.get("cond_history") or []
        if e.get("kappa_mean") is not None
    ]


def _kappa_x_mean(run: Run) -> Series:
    """kappa of each layer's probe input X (the paper's bound grows with it), mean over layers."""
    out = []
    for e in run.metrics.get("cond_history") or []:
        ks = [layer["kappa_x"] for layer in e.get("layers", []) if layer.get("kappa_x") is not None]
        if ks:
            out.append((e["step"], float(np.mean(ks))))
    return out


def _weights_kappa(block: str) -> Callable[[Run], Series]:
    def series(run: Run) -> Series:
        out = []
        for e in run.metrics.get("cond_history") or []:
            ks = [layer["weights"][block]["stacked"] for layer in e.get("layers", []) if "weights" in layer]
            if ks:
                out.append((e["step"], float(np.mean(ks))))
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


def plot_all(
    runs: list[Run],
    out_dir: Path,
    title: str,
    target: float | None = None,
    chance: float | None = None,
    setup: str = "",
    frequent: float | None = None,
) -> dict[str, Path | None]:
    """Write val_acc.png, kappa.png, weights_kappa.png; None for a plot without data. ``setup`` (a
    line: steps, batch, lr, ...) goes under the accuracy plot's title."""
    written: dict[str, Path | None] = {}
    band = "line: mean over seeds, band: min–max over seeds"

    heading = "\n".join(t for t in (title, setup, band) if t)
    fig, ok = val_acc_figure(runs, heading, target, chance, frequent)
    if ok:
        written["val_acc"] = _finish(fig, out_dir / "val_acc.png")
    else:
        plt.close(fig)
        (out_dir / "val_acc.png").unlink(missing_ok=True)  # no stale plot from an earlier report
        written["val_acc"] = None

    fig, (ax, ax_x) = plt.subplots(1, 2, figsize=(12, 4.5))
    ok = _draw(ax, runs, _kappa_mean)
    ok_x = _draw(ax_x, runs, _kappa_x_mean)
    if ok:
        ax.set_yscale("log")
        ax.set(xlabel="optimizer step", ylabel="κ(J), mean over layers", title="attention Jacobian κ(J)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(title="init")
        ax_x.set(xlabel="optimizer step", ylabel="κ(X), mean over layers", title="probe input κ(X)")
        if ok_x:
            ax_x.set_yscale("log")
            ax_x.grid(alpha=0.3, which="both")
        fig.suptitle(f"{title} ({band})")
        written["kappa"] = _finish(fig, out_dir / "kappa.png")
    else:
        plt.close(fig)
        (out_dir / "kappa.png").unlink(missing_ok=True)
        written["kappa"] = None

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=True)
    ok = False
    for ax, block in zip(axes, "qkv"):
        ok |= _draw(ax, runs, _weights_kappa(block))
        ax.set(xlabel="optimizer step", title=f"κ(W_{block.upper()}), all heads stacked")
        ax.grid(alpha=0.3, which="both")
    if ok:
        for ax in axes:
            ax.set_yscale("log")
        axes[0].set_ylabel("condition number, mean over layers")
        axes[0].legend(title="init")
        fig.suptitle(f"{title} — weight condition numbers ({band})")
        written["weights_kappa"] = _finish(fig, out_dir / "weights_kappa.png")
    else:
        plt.close(fig)
        (out_dir / "weights_kappa.png").unlink(missing_ok=True)
        written["weights_kappa"] = None
    return written
