"""Assemble the comparison report (report.md, summary.json, PNGs) from run folders."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lra_cond.report.check import check_run
from lra_cond.report.collect import BASELINE, Run, collect_runs, config_differences
from lra_cond.report.plots import plot_all
from lra_cond.report.published import published
from lra_cond.report.stats import binomial_se, t_interval
from lra_cond.report.table import (
    build_rows,
    definitions,
    markdown_table,
    max_steps,
    no_target_reason,
    steps_by_seed_table,
    target_accuracy,
)
from lra_cond.run_dir import config_value

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
    if target_accuracy(runs) is None:
        out.append(f"{no_target_reason(runs)}: no target accuracy, steps-to-target or speedup.")
    ref = runs[0]
    for r in runs[1:]:
        diff = config_differences(ref.config, r.config)
        if diff:
            out.append(
                f"config of `{r.init}/seed{r.seed}` differs from `{ref.init}/seed{ref.seed}` apart from "
                f"init and seed: {', '.join(diff)} — the comparison is not like for like."
            )
    first_on: dict[str, str] = {}  # each prepared dataset (data_sha256) -> the first run on it
    for r in runs:
        if r.metrics.get("data_sha256"):
            first_on.setdefault(r.metrics["data_sha256"], f"`{r.init}/seed{r.seed}`")
    if len(first_on) > 1:  # same config, another prepare (regenerated or re-downloaded data)
        names = ", ".join(f"{run} ({sha[:12]})" for sha, run in first_on.items())
        out.append(
            f"runs were trained on {len(first_on)} different prepared datasets (data_sha256; first run on "
            f"each: {names}) — the comparison is not like for like; rerun them on one prepared copy."
        )
    for r in runs:
        unseparated = unseparated_probes(r)
        if unseparated:
            out.append(
                f"`{r.init}/seed{r.seed}`: κ(J) has no separated cut at {len(unseparated)} probe(s) "
                f"({', '.join(unseparated[:4])}{', ...' if len(unseparated) > 4 else ''}): there κ depends "
                "on where rtol falls in a continuous spectrum (docs/conditioning.md)."
            )
    for r in runs:
        if not r.config:
            out.append(f"`{r.init}/seed{r.seed}` has no config.yaml: its config cannot be checked.")
        if not r.finished:
            out.append(f"`{r.init}/seed{r.seed}` has no test accuracy (unfinished run?).")
    return out


def unseparated_probes(run: Run) -> list[str]:
    """ "step S layer L" of every probe the monitor flagged as having no separated cut (runs
    recorded before the flag existed have none)."""
    out = []
    for probe in run.metrics.get("cond_history") or []:
        for i, layer in enumerate(probe.get("layers", [])):
            if layer.get("cut_separated") is False:
                out.append(f"step {probe['step']} layer {i}")
    return out


def _finished(run: Run) -> str:
    """Steps, and where recorded the fit's wall-clock time over all its processes and machines."""
    m = run.metrics
    text = f"{m.get('total_steps')} steps" + ("" if run.finished else ", not finished")
    seconds, machines = m.get("seconds"), m.get("machines")
    if isinstance(seconds, (int, float)) and seconds >= 0:
        minutes = round(seconds / 60)
        text += f", {minutes // 60} h {minutes % 60:02d} min wall"
    if isinstance(machines, list) and machines and all(isinstance(x, str) for x in machines):
        text += f" on {'; '.join(machines)}"
    return text


def probe_sizes(runs: list[Run]) -> list[int]:
    """The real tokens the runs' probes held (``n_tokens`` in metrics.json's ``cond_history``),
    sorted: the monitor takes whole examples, so on short ones this differs from probe_tokens."""
    sizes = {
        layer["n_tokens"]
        for run in runs
        for probe in run.metrics.get("cond_history") or []
        for layer in probe.get("layers") or []
        if isinstance(layer.get("n_tokens"), int)
    }
    return sorted(sizes)


def setup_of(runs: list[Run]) -> dict[str, str]:
    """The run setup a reader needs to tell a smoke test from a study, from the first run's
    config.yaml (the others are checked against it: see the warnings)."""
    config = next((r.config for r in runs if r.config), {})
    get = functools.partial(config_value, config)
    out: dict[str, str] = {}
    if get("data.task"):
        out["task"] = str(get("data.task"))
    preset = get("data.preset")
    if preset:
        out["preset"] = f"{preset}" + (" (the LRA splits)" if preset == "full" else " (not the LRA splits)")
    if get("model.attention"):
        args = get("model.attention_args")
        out["attention"] = f"{get('model.attention')}" + (f" {json.dumps(args)}" if args else "")
    steps, epochs = get("trainer.max_steps"), get("trainer.max_epochs")
    if steps is not None:
        out["training steps"] = f"{steps}" if steps != -1 else f"{epochs} epochs"
    if get("data.batch_size") is not None:
        out["batch"] = str(get("data.batch_size"))
    if get("model.lr") is not None:
        lr = f"{get('model.lr'):g}"
        if get("model.warmup_steps") is not None:
            lr += f", warm-up {get('model.warmup_steps')} steps"
        if get("model.schedule"):
            lr += f", {get('model.schedule')} schedule"
        out["peak lr"] = lr
    if get("trainer.val_check_interval") is not None:
        limit = get("trainer.limit_val_batches")
        part = f" (the first {limit} batches)" if isinstance(limit, int) and limit != 1 else ""
        out["validation"] = f"every {get('trainer.val_check_interval')} steps{part}"
    every = get("cond.every_n_steps")
    if every is not None:
        tokens, method = get("cond.probe_tokens"), get("cond.method")
        held = probe_sizes(runs)
        if held and held != [tokens]:  # the examples closest to the size asked (short ones)
            method = f"{method}; the probe holds {' or '.join(map(str, held))}"
        probe = f"{tokens} tokens ({method}), at step 0, every {every} steps and at the end"
        out["κ probe"] = "off" if every == 0 else probe
    seeds = {
        init: sorted(r.seed for r in runs if r.init == init) for init in dict.fromkeys(r.init for r in runs)
    }
    out["seeds"] = "; ".join(f"{init}: {', '.join(map(str, s))}" for init, s in seeds.items())
    return out


def split_counts(runs: list[Run], split: str) -> list[int] | None:
    """Examples per class of a split the runs were evaluated on (metrics.json's ``label_counts``)."""
    for run in runs:
        counts = (run.metrics.get("label_counts") or {}).get(split)
        if isinstance(counts, list) and counts and all(isinstance(c, int) for c in counts) and sum(counts):
            return counts
    return None


def frequent_class_rate(runs: list[Run]) -> float | None:
    """The test accuracy of always answering the test split's most frequent class."""
    counts = split_counts(runs, "test")
    return None if counts is None else max(counts) / sum(counts)


def reproduction(runs: list[Run]) -> list[str]:
    """The reproduction table: the default init's test accuracy (mean, 95% t-interval over seeds)
    beside the published numbers for this task and family and the test split's frequent-class rate;
    no lines without default runs with a test accuracy."""
    config = next((r.config for r in runs if r.config), {})
    task, attention = config_value(config, "data.task"), config_value(config, "model.attention")
    tests = [r.metrics.get("test_acc") for r in runs if r.init == BASELINE]
    interval = t_interval(tests)
    if interval is None:
        return []
    mean, low, high = (100 * v for v in interval)
    n = sum(t is not None for t in tests)
    ours = f"{mean:.2f}" + ("" if math.isnan(low) else f" [{low:.2f}, {high:.2f}]")
    seeds = f"{n} seed{'s' * (n != 1)}"
    lines = [
        "| test accuracy (%) | value |",
        "|---|---|",
        f"| `{BASELINE}` {attention}, this suite (mean [95% t-interval] over {seeds}) | {ours} |",
    ]
    ref = published(task, attention) if task and attention else None
    if ref is not None:
        paper = "n/a (no published number for this family)" if ref.accuracy is None else f"{ref.accuracy:.2f}"
        lines.append(f"| published: Nyströmformer (Xiong et al. 2021), {attention} | {paper} |")
        if ref.lra is not None:
            lra = f"LRA (Tay et al. 2021; its own model and schedule), {attention}"
            lines.append(f"| published: {lra} | {ref.lra:.2f} |")
        lines.append(
            f"| published reruns: xformers, softmax and Nyström-128 | {ref.rerun_low}–{ref.rerun_high} |"
        )
    frequent = frequent_class_rate(runs)
    if frequent is not None:
        lines.append(f"| always the most frequent class of our test split | {100 * frequent:.2f} |")
    return lines


def chance_level(runs: list[Run]) -> float | None:
    """1 / number of classes of the runs' task (None for a task this suite does not know)."""
    from lra_cond.data.tasks import TASKS

    task = next((config_value(r.config, "data.task") for r in runs if r.config), None)
    return 1.0 / TASKS.get(task).num_classes if task in TASKS else None


def json_safe(value: Any) -> Any:
    """NaN and infinities (e.g. the std of one seed) as null: JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_report(runs: list[Run], out_dir: Path, title: str) -> Path:
    """Write ``out_dir/report.md`` (+ summary.json and PNGs) for ``runs``; return the report path."""
    for run in runs:  # before any file or folder is written
        check_run(run)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = target_accuracy(runs)
    rows = build_rows(runs, target)
    setup = setup_of(runs)
    brief = ", ".join(
        text
        for key, text in (
            ("preset", f"preset {setup.get('preset', '').split(' ')[0]}"),
            ("training steps", f"{setup.get('training steps')} steps"),
            ("batch", f"batch {setup.get('batch')}"),
            ("peak lr", f"lr {setup.get('peak lr', '').split(',')[0]}"),
        )
        if key in setup
    )
    frequent = frequent_class_rate(runs)
    plots = plot_all(
        runs, out_dir, title, target=target, chance=chance_level(runs), setup=brief, frequent=frequent
    )
    warns = warnings_for(runs)
    lines = [f"# Init comparison: {title}", ""]
    if warns:
        lines += ["## Warnings", "", *[f"- **warning:** {w}" for w in warns], ""]
    lines += ["## Setup", "", *[f"- {k}: {v}" for k, v in setup.items()], ""]
    reason = no_target_reason(runs) if target is None else ""
    val = split_counts(runs, "val")
    noise = None if target is None or val is None else (100 * binomial_se(target, sum(val)), sum(val))
    length = max_steps(runs)
    lines += [
        "## Results",
        "",
        markdown_table(rows, length, target is not None),
        "",
        definitions(target, reason, noise),
        "",
    ]
    if target is not None:
        lines += ["### Steps to target, seed by seed", "", steps_by_seed_table(rows, length), ""]
    repro = reproduction(runs)
    if repro:
        lines += ["### Reproduction", "", *repro, ""]
    lines += ["## Plots", ""]
    captions = {
        "val_acc": "Validation accuracy vs step",
        "kappa": "κ(J) (top) and κ(X) of the probe inputs (bottom) per layer vs step (log scale)",
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
        "frequent_class_test": frequent,
        "reproduction": repro,
        "setup": setup,
        "rows": [asdict(row) for row in rows],
        "warnings": warns,
        "runs": [f"{r.init}/seed{r.seed}" for r in runs],
    }
    text = json.dumps(json_safe(summary), indent=2, default=str, allow_nan=False)
    (out_dir / "summary.json").write_text(text + "\n")
    return report


def report_title(runs_dir: Path) -> str:
    """``<task>[-<preset>][-<run_name>]/<attention>``: the last two parts of the runs folder."""
    return "/".join(Path(runs_dir).resolve().parts[-2:])


def rebuild_report(runs_dir: Path) -> Path:
    """The report of the runs under ``runs_dir`` (``<init>/seed<k>/``), in ``runs_dir/compare/``."""
    runs = collect_runs(runs_dir)
    return write_report(runs, runs_dir / REPORT_DIR, report_title(runs_dir))
