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
    log10_summary,
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
    steps_per_seed: dict[int, int | None] = field(default_factory=dict)  # None: not reached (censored)
    speedup: Speedup | None = None
    kappa_start: list[Summary | None] = field(default_factory=list)  # log10 κ(J) per layer
    kappa_end: list[Summary | None] = field(default_factory=list)


def _layer_kappas(run: Run, which: str) -> list[float | None]:
    """κ(J) of each layer at step 0 (``start``) or at the last measurement (``end``)."""
    history = run.metrics.get("cond_history") or []
    if which == "start":
        history = [e for e in history if e.get("step") == 0]
    if not history:
        return []
    return [layer.get("kappa") for layer in history[0 if which == "start" else -1].get("layers") or []]


def _per_layer(group: list[Run], which: str) -> list[Summary | None]:
    kappas = [_layer_kappas(r, which) for r in group]
    layers = max((len(k) for k in kappas), default=0)
    return [log10_summary([k[i] if i < len(k) else None for k in kappas]) for i in range(layers)]


def target_accuracy(runs: list[Run]) -> float | None:
    """The paper's target: the default init's best val accuracy, averaged over its seeds."""
    s = summarize([r.metrics.get("best_val_acc") for r in runs if r.init == BASELINE])
    return None if s is None else s.mean


def max_steps(runs: list[Run]) -> int | None:
    """The runs' training length (their config's trainer.max_steps), for 'not reached by N'."""
    steps = {((r.config or {}).get("trainer") or {}).get("max_steps") for r in runs} - {None, -1}
    return max(steps) if steps else None


def build_rows(runs: list[Run], target: float | None) -> list[InitRow]:
    inits = list(dict.fromkeys(r.init for r in runs))
    rows = []
    for init in inits:
        group = [r for r in runs if r.init == init]
        steps: dict[int, int | None] = {}
        epochs: list[float | None] = []
        for r in group:
            step = None if target is None else first_step_reaching(r.metrics.get("val_history") or [], target)
            per_epoch = steps_per_epoch(r.metrics)
            steps[r.seed] = step
            epochs.append(None if step is None or per_epoch is None else step / per_epoch)
        rows.append(
            InitRow(
                init=init,
                seeds=[r.seed for r in group],
                best_val=summarize([r.metrics.get("best_val_acc") for r in group]),
                test=summarize([r.metrics.get("test_acc") for r in group]),
                steps=summarize(list(steps.values())),
                epochs=summarize(epochs),
                reached=sum(s is not None for s in steps.values()),
                steps_per_seed=steps,
                kappa_start=_per_layer(group, "start"),
                kappa_end=_per_layer(group, "end"),
            )
        )
    base = next((row for row in rows if row.init == BASELINE), None)
    if base is not None:
        for row in rows:
            seeds = sorted(set(row.steps_per_seed) & set(base.steps_per_seed))
            row.speedup = speedup(
                [row.steps_per_seed[s] for s in seeds], [base.steps_per_seed[s] for s in seeds]
            )
    return rows


def _fmt(s: Summary | None, spec: str, scale: float = 1.0) -> str:
    if s is None:
        return "n/a"
    std = "n/a" if math.isnan(s.std) else format(s.std * scale, spec)
    return f"{format(s.mean * scale, spec)} ± {std}"


def _fmt_layers(layers: list[Summary | None]) -> str:
    return " / ".join(_fmt(s, ".2f") for s in layers) if layers else "n/a"


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
    "log10 κ(J) step 0 (per layer)",
    "log10 κ(J) end (per layer)",
)


def markdown_table(rows: list[InitRow], length: int | None = None, has_target: bool = True) -> str:
    """The per-init table; ``length`` (the runs' max_steps) says by when a target was not reached.
    Without a target (``has_target`` false) nothing can be reached: those cells are n/a."""
    never = ("not reached" + (f" by {length}" if length else "")) if has_target else "n/a"
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [
            row.init,
            ",".join(map(str, row.seeds)),
            _fmt(row.best_val, ".2f", 100),
            _fmt(row.test, ".2f", 100),
            _fmt(row.steps, ".0f") if row.reached else never,
            _fmt(row.epochs, ".3g") if row.reached else never,
            f"{row.reached}/{len(row.seeds)}" if has_target else "n/a",
            _fmt_speedup(row.speedup, row.init),
            _fmt_layers(row.kappa_start),
            _fmt_layers(row.kappa_end),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def steps_by_seed_table(rows: list[InitRow], length: int | None = None) -> str:
    """Steps to target seed by seed (the pairs the speedup compares), censored runs as such."""
    never = "not reached" + (f" by {length}" if length else "")
    seeds = sorted({s for row in rows for s in row.steps_per_seed})
    lines = ["| seed | " + " | ".join(row.init for row in rows) + " |", "|" + "---|" * (len(rows) + 1)]
    for seed in seeds:
        cells = []
        for row in rows:
            if seed not in row.steps_per_seed:
                cells.append("–")
            else:
                step = row.steps_per_seed[seed]
                cells.append(never if step is None else str(step))
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
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


def definitions(
    target: float | None, reason: str = f"no `{BASELINE}` init runs", noise: tuple[float, int] | None = None
) -> str:
    """The text under the table: every number's definition, so the report stands alone. ``reason``
    says why there is no target (see ``no_target_reason``); ``noise``: the binomial SE (points) of
    one validation accuracy at the target, and the validation split's size."""
    target_text = (
        f"**Target accuracy: {100 * target:.2f}%** = mean over seeds of the `{BASELINE}` init's best "
        "validation accuracy (as in the paper), read from validation alone."
        if target is not None
        else f"**Target accuracy: n/a** ({reason}), so steps-to-target and speedup are n/a."
    )
    lines = [
        target_text,
        "",
        "- Values are mean ± std over seeds; std is the sample standard deviation (ddof=1), n/a with one "
        "seed.",
        "- Steps to target: first validation step whose accuracy is ≥ the target, computed from each run's "
        "`val_history`; epochs to target = that step / training batches per epoch. A run that never reaches "
        "the target is censored: it counts in *reached* (k/n) and in the seed-by-seed table as not reached, "
        "never in a mean as its length.",
        "- Speedup vs default = 1 − mean(steps to target of the init) / mean(steps to target of default), in "
        "%, over the seeds where both runs reached the target (seeds are paired: a seed fixes the data "
        "order, so its runs see the same batches; positive = fewer steps). 95% interval: paired percentile "
        "bootstrap "
        f"over those seeds, {BOOTSTRAP_RESAMPLES} resamples, numpy generator seed {BOOTSTRAP_SEED}; n/a with "
        "fewer than two such seeds.",
        "- log10 κ(J): condition number of the attention Jacobian over its non-null spectrum "
        "(`cond_history`), per layer (layer 0 / layer 1 / ...), as the mean ± std over seeds of log10 κ (a "
        "geometric mean and its spread in decades), at step 0 and at the last measurement; n/a when the "
        "run has no condition-number history.",
    ]
    if noise is not None:
        se, n = noise
        lines.append(
            f"- Evaluation noise: one accuracy measured on the {n}-example validation split has a binomial "
            f"standard error of {se:.2f} points at the target; differences of that size between runs are "
            "within the noise of a single evaluation."
        )
    return "\n".join(lines)
