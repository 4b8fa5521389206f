"""Per-init rows of the comparison (numbers) and their markdown rendering (report.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lra_cond.report.collect import BASELINE, Run
from lra_cond.report.stats import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    Speedup,
    Summary,
    first_step_reaching,
    speedup,
    steps_per_epoch,
    summarize,
)


@dataclass
class InitRow:
    init: str
    seeds: list[int]
    best_val: Summary | None
    test: Summary | None
    steps: Summary | None  # over the seeds that reached the target
    epochs: Summary | None
    reached: int
    steps_per_seed: list[int | None] = field(default_factory=list)
    speedup: Speedup | None = None
    kappa_start: Summary | None = None
    kappa_end: Summary | None = None


def _kappa_at(run: Run, which: str) -> float | None:
    """Mean κ(J) over layers at step 0 (``start``) or at the last measurement (``end``)."""
    history = run.metrics.get("cond_history") or []
    if which == "start":
        history = [e for e in history if e.get("step") == 0]
    return history[0 if which == "start" else -1].get("kappa_mean") if history else None


def target_accuracy(runs: list[Run]) -> float | None:
    """The paper's target: the default init's best val accuracy, averaged over its seeds."""
    s = summarize([r.metrics.get("best_val_acc") for r in runs if r.init == BASELINE])
    return None if s is None else s.mean


def build_rows(runs: list[Run], target: float | None) -> list[InitRow]:
    inits = list(dict.fromkeys(r.init for r in runs))
    rows = []
    for init in inits:
        group = [r for r in runs if r.init == init]
        steps: list[int | None] = []
        epochs: list[float | None] = []
        for r in group:
            step = None if target is None else first_step_reaching(r.metrics.get("val_history") or [], target)
            per_epoch = steps_per_epoch(r.metrics)
            steps.append(step)
            epochs.append(None if step is None or per_epoch is None else step / per_epoch)
        rows.append(
            InitRow(
                init=init,
                seeds=[r.seed for r in group],
                best_val=summarize([r.metrics.get("best_val_acc") for r in group]),
                test=summarize([r.metrics.get("test_acc") for r in group]),
                steps=summarize(steps),
                epochs=summarize(epochs),
                reached=sum(s is not None for s in steps),
                steps_per_seed=steps,
                kappa_start=summarize([_kappa_at(r, "start") for r in group]),
                kappa_end=summarize([_kappa_at(r, "end") for r in group]),
            )
        )
    base = next((row for row in rows if row.init == BASELINE), None)
    if base is not None:
        base_steps = [s for s in base.steps_per_seed if s is not None]
        for row in rows:
            row.speedup = speedup([s for s in row.steps_per_seed if s is not None], base_steps)
    return rows


def _fmt(s: Summary | None, spec: str, scale: float = 1.0) -> str:
    if s is None:
        return "n/a"
    std = "n/a" if math.isnan(s.std) else format(s.std * scale, spec)
    return f"{format(s.mean * scale, spec)} ± {std}"


def _fmt_speedup(sp: Speedup | None, init: str) -> str:
    if init == BASELINE:
        return "(baseline)"
    if sp is None:
        return "n/a"
    interval = "n/a" if sp.low is None else f"{sp.low:+.1f}, {sp.high:+.1f}"
    return f"{sp.percent:+.1f}% [{interval}]"


COLUMNS = (
    "init",
    "seeds",
    "best val acc (%)",
    "test acc (%)",
    "steps to target",
    "epochs to target",
    "reached",
    "speedup vs default (95% CI)",
    "κ(J) step 0",
    "κ(J) end",
)


def markdown_table(rows: list[InitRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [
            row.init,
            ",".join(map(str, row.seeds)),
            _fmt(row.best_val, ".2f", 100),
            _fmt(row.test, ".2f", 100),
            _fmt(row.steps, ".0f") if row.reached else "not reached",
            _fmt(row.epochs, ".3g") if row.reached else "not reached",
            f"{row.reached}/{len(row.seeds)}",
            _fmt_speedup(row.speedup, row.init),
            _fmt(row.kappa_start, ".3g"),
            _fmt(row.kappa_end, ".3g"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def no_target_reason(runs: list[Run]) -> str:
    """Why there is no target accuracy, in the words of what happened."""
    from lra_cond.checks import validation_gap

    base = [r for r in runs if r.init == BASELINE]
    if not base:
        return f"no `{BASELINE}` init runs"
    gaps = {validation_gap((r.config or {}).get("trainer") or {}) for r in base} - {None}
    why = f"no validation ran: {', '.join(sorted(gaps))}" if gaps else "no validation accuracy was recorded"
    return f"the {len(base)} `{BASELINE}` run{'s' * (len(base) != 1)} have no validation accuracy ({why})"


def definitions(target: float | None, reason: str = f"no `{BASELINE}` init runs") -> str:
    """The text under the table: every number's definition, so the report stands alone. ``reason``
    says why there is no target (see ``no_target_reason``)."""
    target_text = (
        f"**Target accuracy: {100 * target:.2f}%** = mean over seeds of the `{BASELINE}` init's best "
        "validation accuracy (as in the paper)."
        if target is not None
        else f"**Target accuracy: n/a** ({reason}), so steps-to-target and speedup are n/a."
    )
    return "\n".join(
        [
            target_text,
            "",
            "- Values are mean ± std over seeds; std is the sample standard deviation (ddof=1), "
            "n/a with one seed.",
            "- Steps to target: first validation step whose accuracy is ≥ the target, computed from each "
            "run's `val_history`; epochs to target = that step / training batches per epoch. Seeds that "
            "never reach the target are left out of the mean ± std and counted in *reached* (k/n).",
            "- Speedup vs default = 1 − mean(steps to target of the init) / mean(steps to target of "
            "default), in %, over the seeds that reached the target (positive = fewer steps). 95% "
            f"interval: percentile bootstrap, seeds of each init resampled independently with "
            f"replacement, {BOOTSTRAP_RESAMPLES} resamples, numpy generator seed {BOOTSTRAP_SEED}; n/a "
            "with fewer than two reaching seeds on either side.",
            "- κ(J): condition number of the attention Jacobian over its non-null spectrum "
            "(`cond_history`), mean over layers, at step 0 and at the last measurement; n/a when the "
            "run has no condition-number history.",
        ]
    )
