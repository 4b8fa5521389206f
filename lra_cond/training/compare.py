"""The sweep orchestrator behind ``python -m lra_cond compare``: fit every (init, seed) in turn as a
``fit`` subprocess, reusing finished runs and resuming interrupted ones, then write the report;
``--plan`` prints the commands. ``--config STUDY.yaml`` reads the same options from a file (see
:func:`study_args`).

What a run folder holds, and whether a run is finished, comes from ``lra_cond.run_dir``."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from lra_cond import run_dir
from lra_cond.checks import validation_gap
from lra_cond.errors import Interrupted, UserError
from lra_cond.report.build import REPORT_DIR, report_title, write_report
from lra_cond.report.collect import IGNORED_KEYS, Run, init_order, load_config
from lra_cond.run_dir import State, read_metrics
from lra_cond.yaml_files import strict

RESUMABLE = set(run_dir.RESUME_MAY_CHANGE)

# Set per run by compare itself; in the overrides they would silently break the comparison.
RESERVED = (
    "--init",
    "--model.init",
    "--seed_everything",
    "--task",
    "--data.task",
    "--attention",
    "--model.attention",
    "--ckpt_path",
)


# Keys of a study config (``compare --config FILE``): compare's own options, and ``fit``.
STUDY_KEYS = ("task", "attention", "inits", "seeds", "run_root", "run_name", "fit")


def _cli_value(value: Any) -> str:
    """A YAML value as one command-line word, the way LightningCLI parses it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def study_args(path: str) -> list[str]:
    """The compare arguments a study config stands for.

    The file is a YAML mapping of compare's options (``task``, ``attention``, ``inits``, ``seeds`` as
    lists or comma-separated strings, ``run_root``) and ``fit``: a mapping of fit options without
    their leading ``--`` (``trainer.max_steps: 5000``), passed to every fit in file order. Arguments
    given on the command line after it override it.
    """
    file = Path(path)
    if not file.is_file():
        raise UserError(f"no such study config: {path}")
    try:
        study = strict(yaml.safe_load)(file.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(study, dict):
        raise UserError(f"{path}: a study config is a mapping with keys {', '.join(STUDY_KEYS)}")
    unknown = [k for k in study if k not in STUDY_KEYS]
    if unknown:
        raise UserError(f"{path}: unknown key '{unknown[0]}'; valid keys: {', '.join(STUDY_KEYS)}")
    args: list[str] = []
    for key in STUDY_KEYS[:-1]:
        if key in study:
            value = study[key]
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            args += [f"--{key}", text]
    fit = study.get("fit") or {}
    if not isinstance(fit, dict):
        raise UserError(f"{path}: 'fit' must map fit options to values, e.g. 'trainer.max_steps: 5000'")
    for key, value in fit.items():
        args += [f"--{str(key).removeprefix('--')}", _cli_value(value)]
    return args


def fit_args(task: str, attention: str, init: str, seed: int, overrides: list[str]) -> list[str]:
    head = ["fit", "--task", task, "--attention", attention, "--init", init]
    return [*head, "--seed_everything", str(seed), *overrides]


def resolved_config(args: list[str], with_defaults: bool = False) -> Any:
    """The config a ``fit`` with these arguments would save as config.yaml (parsed, nothing built);
    ``with_defaults``: and every option's default, in the same form."""
    from lra_cond.training.lightning_cli import parse_only

    cli = parse_only(args, errors_for="compare")  # a bad fit override: one line, before any run
    # Dumped exactly like fit writes config.yaml.
    config = yaml.safe_load(cli.resolved_config_text())
    return (config, cli.option_defaults()) if with_defaults else config


def run_fit(cmd: list[str], threads: int | None = None) -> int:
    """Run one fit (with ``threads`` intra-op threads if given) and return its exit status. Ctrl-C is
    passed on to it, once per press: the fit runs in its own session (the terminal's SIGINT reaches
    compare alone) and stops gracefully at the end of its step with last.ckpt saved (a second Ctrl-C
    stops it at once); compare waits for it."""
    env = (
        None
        if threads is None
        else {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    )
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)
    previous = signal.signal(signal.SIGINT, lambda *_: proc.send_signal(signal.SIGINT))
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


def compare(
    task: str,
    attention: str,
    inits: list[str],
    seeds: list[int],
    overrides: list[str],
    run_root: str = "runs",
    run_name: str | None = None,
    plan: bool = False,
    jobs: int = 1,
    threads: int | None = None,
) -> Path | None:
    """Fit every (init, seed) of one task and attention family (``overrides``: more fit arguments,
    passed to every fit), in turn or ``jobs`` at a time with ``threads`` intra-op threads each
    (default: the cores split between them), then write the report; return its path. ``plan``:
    print one fit command per line instead, run nothing."""
    from lra_cond.data.tasks import TASKS
    from lra_cond.init import INITS
    from lra_cond.models.attention import ATTENTIONS

    TASKS.get(task)
    ATTENTIONS.get(attention)
    for name in inits:
        INITS.get(name)  # unknown names fail here, before any run
    for o in overrides:
        if o.split("=", 1)[0] in RESERVED:
            name = o.split("=", 1)[0]
            raise UserError(
                f"{name} is set by compare itself; use compare's --task, --attention, --inits, --seeds"
            )
    run_dir.check_run_name(run_name)
    overrides = [
        *overrides,
        "--run_root",
        run_root,
        *(["--run_name", run_name] if run_name else []),
    ]
    pairs = [(init, seed) for seed in seeds for init in inits]  # seed-major: paired runs finish together

    # Every fit's options checked as fit checks them, before a plan is printed or anything runs.
    reference, defaults = resolved_config(fit_args(task, attention, inits[0], seeds[0], overrides), True)
    owned = {
        "data.task": task,
        "model.attention": attention,
        "model.init": inits[0],
        "seed_everything": seeds[0],
        "run_root": run_root,
        "run_name": run_name,
    }
    for key, ours in owned.items():
        theirs = run_dir.config_value(reference, key)
        if theirs != ours:
            raise UserError(
                f"the fit options set {key} to {theirs!r}, which compare sets itself ({ours!r} for this "
                "fit): remove it from the fit options (or from the config file they name); choose it "
                "with compare's own --task, --attention, --inits, --seeds, --run_root, --run_name"
            )
    gap = validation_gap(reference.get("trainer") or {})
    if gap:
        raise UserError(
            f"no fit of this compare would validate ({gap}), so the report would have no accuracies, target "
            "or steps-to-target; lower --trainer.val_check_interval or raise --trainer.max_steps"
        )
    if plan:
        for init, seed in pairs:
            cmd = fit_args(task, attention, init, seed, overrides)
            print(shlex.join(["python", "-m", "lra_cond", *cmd]))
        return None

    where = {"preset": reference["data"]["preset"], "name": reference.get("run_name")}
    runs_dir = run_dir.runs_dir(run_root, task, attention, **where)
    # Decide every job first, so a conflicting folder stops compare before any training.
    plan = []
    for init, seed in pairs:
        folder = run_dir.RunFolder(run_dir.run_path(run_root, task, attention, init, seed, **where))
        state = folder.state()
        if state is not State.EMPTY:
            # The run's own config, apart from what a resume may change (how it is run and watched).
            diff = [
                k
                for k in run_dir.config_differences(
                    reference, load_config(folder.path), IGNORED_KEYS, defaults
                )
                if k not in RESUMABLE
            ]
            if diff:
                raise UserError(
                    f"{folder.path} was run with a different config ({', '.join(diff)}); move it away or "
                    "use another --run_root"
                )
        if state is State.STARTED and not folder.restartable():
            raise UserError(
                f"{folder.path} holds {folder.describe()}: there is nothing to resume; move it away (or use "
                "another --run_root) and rerun compare"
            )
        # A run that stopped before its first checkpoint (killed, not diverged) starts again.
        action = {State.FINISHED: "reuse", State.UNFINISHED: "resume", State.STARTED: "resume"}.get(
            state, "fit"
        )
        plan.append((init, seed, folder.path, action))

    if jobs > 1:
        threads = threads or max(1, (os.cpu_count() or 1) // jobs)
        max_steps = int((reference.get("trainer") or {}).get("max_steps") or 0)
        _fit_side_by_side(task, attention, overrides, plan, runs_dir, jobs, threads, max_steps)
    for i, (init, seed, path, action) in enumerate(plan if jobs == 1 else [], 1):
        head = f"[{i}/{len(plan)}] {init} seed {seed}"
        if action == "reuse":
            print(f"{head}: reusing finished run {path}", flush=True)
            continue
        cmd = fit_args(task, attention, init, seed, overrides)
        if action == "resume":
            cmd += ["--ckpt_path", "last"]
        print(f"{head}: {'resuming' if action == 'resume' else 'fitting'} -> {path}", flush=True)
        rc = run_fit([sys.executable, "-m", "lra_cond", *cmd], threads)
        if rc in (Interrupted.EXIT_STATUS, Interrupted.SIGTERM_STATUS):
            raise Interrupted(
                f"interrupted (Ctrl-C) during the fit of {init} seed {seed} ({path}); rerun compare to "
                "continue: finished runs are reused and this one resumes from its last.ckpt"
            )
        if rc != 0:
            raise UserError(
                f"fit of {init} seed {seed} failed (exit {rc}, output above); rerun compare to resume"
            )

    runs = [Run(init, seed, d, read_metrics(d), load_config(d)) for init, seed, d, _ in plan]
    order = init_order(inits)
    runs.sort(key=lambda r: (order.index(r.init), r.seed))
    report = write_report(runs, runs_dir / REPORT_DIR, report_title(runs_dir))
    print(f"report written to {report}")
    return report


def _fit_side_by_side(
    task: str,
    attention: str,
    overrides: list[str],
    plan: list[tuple[str, int, Path, str]],
    runs_dir: Path,
    jobs: int,
    threads: int,
    max_steps: int,
) -> None:
    """The fits and resumes of ``plan``, ``jobs`` at a time, each logging to
    ``<runs_dir>/compare/logs/<init>-seed<k>.log``; finished runs are reused as they are."""
    from lra_cond.training.side_by_side import Fit, run_side_by_side

    fits = []
    for init, seed, path, action in plan:
        if action == "reuse":
            print(f"{init} seed {seed}: reusing finished run {path}", flush=True)
            continue
        cmd = [sys.executable, "-m", "lra_cond", *fit_args(task, attention, init, seed, overrides)]
        if action == "resume":
            cmd += ["--ckpt_path", "last"]
        log = runs_dir / REPORT_DIR / "logs" / f"{init}-seed{seed}.log"
        fits.append(Fit(f"{init} seed {seed}", cmd, path, log, max_steps))
    if not fits:
        return
    print(f"{len(fits)} fit(s), {jobs} at a time with {threads} thread(s) each", flush=True)
    run_side_by_side(fits, jobs, threads)
    stops = (Interrupted.EXIT_STATUS, Interrupted.SIGTERM_STATUS)
    interrupted = [f for f in fits if f.returncode in stops]
    unstarted = [f for f in fits if f.returncode is None]
    failed = [f for f in fits if f.returncode not in (None, 0, *stops)]
    if failed:
        names = "; ".join(f"{f.label} (exit {f.returncode}, log {f.log})" for f in failed)
        raise UserError(f"fit failed: {names}; rerun compare to resume the others")
    if interrupted or unstarted:
        stopped = ", ".join(f.label for f in interrupted) or "none"
        raise Interrupted(
            f"interrupted: stopped {stopped} at their last checkpoints; {len(unstarted)} not started; rerun "
            "compare to continue (finished runs are reused, stopped ones resume from last.ckpt)"
        )
