"""Assemble the comparison report (report.md, summary.json, PNGs) from run folders, and the
``python -m lra_cond report RUNS_DIR`` entry point."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from lra_cond.cli import prog
from lra_cond.errors import OneLineParser
from lra_cond.report.collect import Run, collect_runs, config_differences
from lra_cond.report.plots import plot_all
from lra_cond.report.table import BASELINE, build_rows, definitions, markdown_table, target_accuracy

REPORT_DIR = "compare"


def warnings_for(runs: list[Run]) -> list[str]:
    out = []
    for init in dict.fromkeys(r.init for r in runs):
        n = sum(r.init == init for r in runs)
        if n < 2:
            out.append(
                f"init `{init}` has {n} seed: no std, no speedup interval; run at least two seeds "
                "(e.g. --seeds 0,1,2)."
            )
    if not any(r.init == BASELINE for r in runs):
        out.append(f"no `{BASELINE}` init runs: no target accuracy, steps-to-target or speedup.")
    ref = runs[0]
    for r in runs[1:]:
        diff = config_differences(ref.config, r.config)
        if diff:
            out.append(
                f"config of `{r.init}/seed{r.seed}` differs from `{ref.init}/seed{ref.seed}` apart from "
                f"init and seed: {', '.join(diff)} — the comparison is not like for like."
            )
    for r in runs:
        if not r.config:
            out.append(f"`{r.init}/seed{r.seed}` has no config.yaml: its config cannot be checked.")
        if not r.finished:
            out.append(f"`{r.init}/seed{r.seed}` has no test accuracy (unfinished run?).")
    return out


def _finished(run: Run) -> str:
    m = run.metrics
    return f"{m.get('total_steps')} steps" + ("" if run.finished else ", not finished")


def write_report(runs: list[Run], out_dir: Path, title: str) -> Path:
    """Write ``out_dir/report.md`` (+ summary.json and PNGs) for ``runs``; return the report path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = target_accuracy(runs)
    rows = build_rows(runs, target)
    plots = plot_all(runs, out_dir, title)
    warns = warnings_for(runs)
    lines = [f"# Init comparison: {title}", ""]
    if warns:
        lines += ["## Warnings", "", *[f"- **warning:** {w}" for w in warns], ""]
    lines += ["## Results", "", markdown_table(rows), "", definitions(target), ""]
    lines += ["## Plots", ""]
    captions = {
        "val_acc": "Validation accuracy vs step",
        "kappa": "Mean κ(J) (left) and κ(X) of the probe inputs (right) over layers vs step (log scale)",
        "weights_kappa": "Condition numbers of the stacked W_Q, W_K, W_V vs step (log scale)",
    }
    for key, caption in captions.items():
        path = plots.get(key)
        lines.append(f"![{caption}]({path.name})" if path else f"- {caption}: no data in these runs.")
        lines.append("")
    # Relative to the folder holding compare/, so `compare` and `report` write identical files.
    lines += ["## Runs (folders next to this report's folder)", ""]
    lines += [f"- `{r.init}/seed{r.seed}`: {_finished(r)}" for r in runs] + [""]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    summary = {
        "target_acc": target,
        "rows": [asdict(row) for row in rows],
        "warnings": warns,
        "runs": [f"{r.init}/seed{r.seed}" for r in runs],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return report


def report_title(runs_dir: Path) -> str:
    """``<task>[-<preset>][-<run_name>]/<attention>``: the last two parts of the runs folder."""
    return "/".join(Path(runs_dir).resolve().parts[-2:])


def report_main(argv: list[str]) -> None:
    p = OneLineParser(
        prog=f"{prog()} report",
        description="Rebuild the init-comparison report from run folders RUNS_DIR/<init>/seed<k>/.",
    )
    p.add_argument("runs_dir", help="e.g. runs/listops/softmax")
    args = p.parse_args(argv)
    runs_dir = Path(args.runs_dir)
    runs = collect_runs(runs_dir)
    report = write_report(runs, runs_dir / REPORT_DIR, report_title(runs_dir))
    print(f"report written to {report}")
