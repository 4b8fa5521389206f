"""Command line: ``python -m lra_cond {fit,validate,test,prepare,compare,report} ...``.

Trainer subcommands go through a LightningCLI subclass. ``--task T`` loads ``configs/defaults.yaml``
and ``configs/T.yaml`` before any other argument (so later flags override them); ``--attention``
and ``--init`` are shortcuts for ``--model.attention`` and ``--model.init``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lra_cond.errors import Interrupted, OneLineParser, UserError

# The task configs: inside the package in an install (a wheel ships configs/ as lra_cond/configs/,
# see pyproject.toml), beside it in a source checkout.
_PACKAGE = Path(__file__).resolve().parent
CONFIG_DIR = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"
TRAINER_COMMANDS = ("fit", "validate", "test")
COMMANDS = (*TRAINER_COMMANDS, "prepare", "bench", "compare", "report")
SHORTCUTS = {"--attention": "--model.attention", "--init": "--model.init"}
# model.max_len is linked from data.max_len (one length for the data and the position table).
ALIASES = {"--model.max_len": "--data.max_len"}
# One line per command in the top-level help.
COMMAND_HELP = {
    "fit": "train one run into its run folder, then test its best checkpoint",
    "validate": "evaluate a checkpoint on the validation split (--ckpt_path FILE or last); writes nothing",
    "test": "evaluate a checkpoint on the test split (--ckpt_path FILE or last); writes nothing",
    "prepare": "build a task's prepared data cache",
    "compare": "fit several inits x seeds (reusing finished runs), then write a report",
    "report": "rebuild the comparison report from existing run folders: report RUNS_DIR",
    "bench": "time training steps at a shape (one JSON line)",
}
HELP_WIDTH = 100


# reStructuredText markup in docstrings that become help texts -> plain text.
RST_MARKUP = (
    (re.compile(r":[\w:]+:`~?([^`]+)`"), r"\1"),  # :class:`LraModel`, :func:`~a.b`
    (re.compile(r"`([^`<]+?)\s*<([^>]+)>`_{1,2}"), r"\1 (\2)"),  # `text <url>`_
    (re.compile(r"``([^`]+)``"), r"\1"),  # ``literal``
    (re.compile(r"`([^`]+)`_{0,2}"), r"\1"),  # `ref`_, `title`
)


def plain_text(text: str) -> str:
    """``text`` without reStructuredText markup (help comes from docstrings)."""
    for pattern, repl in RST_MARKUP:
        text = pattern.sub(repl, text)
    return text


def prog() -> str:
    """The program name as invoked: ``lra-cond`` (the console script) or ``python -m lra_cond``."""
    return "lra-cond" if Path(sys.argv[0]).name.startswith("lra-cond") else "python -m lra_cond"


def help_row(name: str, text: str, width: int = 20) -> str:
    """``  NAME   text`` with the text wrapped under itself (plain text, for --help)."""
    indent = " " * (width + 2)
    body = textwrap.wrap(text, HELP_WIDTH - len(indent), break_on_hyphens=False) or [""]
    head = f"  {name:<{width}}" if len(name) < width else f"  {name}\n{indent}"
    return head + f"\n{indent}".join(body)


def top_help() -> str:
    from lra_cond.data import cache
    from lra_cond.data.tasks import TASKS
    from lra_cond.init import INITS
    from lra_cond.models.attention import ATTENTIONS

    me = prog()
    lines = [
        f"usage: {me} COMMAND [options]",
        "",
        "Long Range Arena benchmark suite for studying attention-weight initialization.",
        "",
        "commands:",
        *[help_row(name, text, 10) for name, text in COMMAND_HELP.items()],
        "",
        "shortcuts of fit, validate and test (and compare's --task, --attention):",
        help_row(
            "--task TASK",
            f"one of: {', '.join(TASKS.names())} (loads configs/defaults.yaml and configs/TASK.yaml first)",
        ),
        help_row("--attention NAME", f"one of: {', '.join(ATTENTIONS.names())} (default softmax)"),
        help_row("--init NAME", f"one of: {', '.join(INITS.names())} (default default)"),
        "",
        "where things go:",
        help_row("data", f"$LRA_DATA, else ~/.cache/lra_cond (here: {cache.default_data_dir()})", 10),
        help_row(
            "runs",
            "RUN_ROOT/<task>[-<preset>][-<run_name>]/<attention>/<init>/seed<k>/ (RUN_ROOT: "
            "--run_root, default runs)",
            10,
        ),
        "",
        "examples:",
        f"  {me} fit --task listops --init conditioned",
        f"  {me} fit --task listops --data.preset tiny --trainer.max_steps 100   # a smoke run",
        f"  {me} COMMAND --help",
    ]
    return "\n".join(lines)


def _pop_option(args: list[str], name: str) -> str | None:
    """Remove ``name VALUE`` or ``name=VALUE`` from ``args``; return VALUE (last one wins)."""
    value = None
    i = 0
    while i < len(args):
        if args[i] == name:
            if i + 1 >= len(args):
                raise UserError(f"{name} needs a value")
            value = args[i + 1]
            del args[i : i + 2]
        elif args[i].startswith(name + "="):
            value = args[i].split("=", 1)[1]
            del args[i]
        else:
            i += 1
    return value


def expand_shortcuts(argv: list[str]) -> list[str]:
    """Turn ``fit --task T --attention A --init I ...`` into plain LightningCLI arguments."""
    from lra_cond.data.tasks import TASKS
    from lra_cond.init import INITS
    from lra_cond.models.attention import ATTENTIONS

    command, rest = argv[0], list(argv[1:])
    task = _pop_option(rest, "--task")
    prefix: list[str] = []
    if task is not None:
        TASKS.get(task)
        prefix += ["--config", str(CONFIG_DIR / "defaults.yaml")]
        task_config = CONFIG_DIR / f"{task}.yaml"
        if task_config.is_file():
            prefix += ["--config", str(task_config)]
        prefix += ["--data.task", task]
    for short, full in SHORTCUTS.items():
        value = _pop_option(rest, short)
        if value is not None:
            (ATTENTIONS if short == "--attention" else INITS).get(value)
            rest += [full, value]
    for alias, full in ALIASES.items():
        value = _pop_option(rest, alias)
        if value is not None:
            rest += [full, value]
    return [command, *prefix, *rest]


@contextmanager
def one_line_argparse_errors() -> Iterator[None]:
    """Plain ``argparse`` parsers (``bench``'s) raise a one-line ``UserError`` like ``OneLineParser``."""
    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = OneLineParser.error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved  # type: ignore[method-assign]


def parse_error_message(error: Exception, command: str) -> str:
    """jsonargparse's message spans lines (and would come after a full usage text): one line."""
    message = " ".join(str(error).split())
    return f"{message} (see: {prog()} {command} --help)"


def prepare_main(argv: list[str]) -> None:
    from lra_cond.data import cache
    from lra_cond.data.tasks import TASKS

    p = OneLineParser(
        prog=f"{prog()} prepare",
        description="Build a task's prepared data cache.",
    )
    p.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS.names())}")
    p.add_argument("--preset", default="full", help="full (the LRA splits) or tiny (smoke-test size)")
    p.add_argument("--data-dir", default=None, help="data root (default: $LRA_DATA, else ~/.cache/lra_cond)")
    p.add_argument(
        "--source",
        default=None,
        help="downloaded data to read (official release folder or a local export); without it, synthetic "
        "tasks are generated, tiny presets use a fixture, and hub datasets are fetched",
    )
    p.add_argument("--seed", type=int, default=0, help="generator seed (synthetic tasks)")
    p.add_argument("--workers", type=int, default=None, help="generator processes (default: all cores)")
    args = p.parse_args(argv)
    spec = TASKS.get(args.task)
    data_dir = Path(args.data_dir) if args.data_dir else cache.default_data_dir()
    out = spec.prepare(data_dir, args.preset, source=args.source, seed=args.seed, workers=args.workers)
    print(f"prepared {args.task} ({args.preset}) at {out}")


def trainer_help(argv: list[str]) -> str:
    """The short help of ``fit``/``validate``/``test``: the options a researcher sets, each with the
    value this command line gives it (configs, then flags), and this command's run folder."""
    from lra_cond.data import cache
    from lra_cond.data.tasks import TASKS
    from lra_cond.init import INITS
    from lra_cond.lightning_cli import LraCLI, parse_only
    from lra_cond.models.attention import ATTENTIONS

    command, me = argv[0], prog()
    cli = parse_only([command, *(a for a in argv[1:] if a not in ("-h", "--help"))])
    cfg = cli.config[command]
    fit = command == "fit"

    def value(v: object) -> str:
        return "[none]" if v is None else f"[{json.dumps(v) if isinstance(v, (dict, list)) else v}]"

    rows = [
        (
            "--task TASK",
            f"one of: {', '.join(TASKS.names())}; loads configs/defaults.yaml and "
            f"configs/TASK.yaml before the other options {value(cfg.data.task)}",
        ),
        ("--attention NAME", f"one of: {', '.join(ATTENTIONS.names())} {value(cfg.model.attention)}"),
        ("--init NAME", f"one of: {', '.join(INITS.names())} {value(cfg.model.init)}"),
        (
            "--model.attention_args JSON",
            "the family's options, e.g. '{\"num_landmarks\": 32}' " + value(cfg.model.attention_args or {}),
        ),
        (
            "--model.init_args JSON",
            "the scheme's parameters, e.g. '{\"v_scale\": 2.0}' " + value(cfg.model.init_args or {}),
        ),
        (
            "--data.preset NAME",
            f"one of: {', '.join(TASKS.get(cfg.data.task).presets)} (tiny: a smoke "
            f"test) {value(cfg.data.preset)}",
        ),
        (
            "--data.data_dir DIR",
            "prepared data; default $LRA_DATA, else ~/.cache/lra_cond "
            + value(cfg.data.data_dir or str(cache.default_data_dir())),
        ),
        ("--data.batch_size N", f"examples per batch {value(cfg.data.batch_size)}"),
    ]
    if fit:
        rows += [
            ("--trainer.max_steps N", f"optimizer steps to train {value(cfg.trainer.max_steps)}"),
            (
                "--trainer.val_check_interval N",
                f"steps between validations {value(cfg.trainer.val_check_interval)}",
            ),
            ("--model.lr LR", f"peak learning rate {value(cfg.model.lr)}"),
            ("--model.warmup_steps N", f"steps of the rising lr {value(cfg.model.warmup_steps)}"),
            (
                "--cond.every_n_steps N",
                "measure the attention Jacobian's condition number at step 0, every N "
                f"steps and at the end; 0 switches the monitor off (faster) {value(cfg.cond.every_n_steps)}",
            ),
            ("--cond.probe_tokens N", f"tokens of the probe batch {value(cfg.cond.probe_tokens)}"),
        ]
    rows += [
        ("--seed_everything N", f"the seed; the run folder is seed<N> {value(cfg.seed_everything)}"),
        ("--run_root DIR", f"where run folders go {value(cfg.run_root)}"),
        (
            "--run_name NAME",
            f"a name for a variant of the study, added to the task's folder {value(cfg.run_name)}",
        ),
        (
            "--ckpt_path last",
            "resume this run folder's interrupted run"
            if fit
            else "the checkpoint to evaluate: a .ckpt file, or last (this run folder's last.ckpt)",
        ),
        (
            "--trainer.accelerator A",
            "cpu, gpu or auto; one GPU: --trainer.accelerator gpu --trainer.devices 1 "
            f"{value(cfg.trainer.accelerator)}",
        ),
        ("--config FILE", "a YAML file of these options; --print_config prints the resolved one"),
    ]
    what = {
        "fit": "Train one run into its run folder, then test its best checkpoint (by validation accuracy).",
        "validate": "Evaluate a checkpoint on the validation split; print the results, write nothing.",
        "test": "Evaluate a checkpoint on the test split; print the results, write nothing.",
    }[command]
    lines = [
        f"usage: {me} {command} --task TASK [--attention NAME] [--init NAME] [options]",
        "",
        what,
        "",
        "options ([value] = what this command line sets: configs/defaults.yaml and configs/TASK.yaml, "
        "then your flags):",
        *[help_row(name, text, 30) for name, text in rows],
        "",
        f"run folder of this command: {LraCLI.run_path(cfg)}",
        f"all options (Lightning's trainer, model, data, callbacks): {me} {command} --help-all",
    ]
    return "\n".join(lines)


def run_lightning(argv: list[str]) -> None:
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lra_cond.lightning_cli import LraCLI

    # LightningCLI parses sys.argv, set to the expanded arguments: DDP re-executes
    # ``python -m lra_cond`` + sys.argv[1:] for the other ranks, which must parse the same way.
    saved, sys.argv = sys.argv, [sys.argv[0], *expand_shortcuts(argv)]
    try:
        LraCLI(prog=prog())
    except Interrupted as e:
        if not e.resumable:
            raise
        again = [*argv]
        _pop_option(again, "--ckpt_path")
        raise Interrupted(
            f"{e}; continue with: {prog()} {shlex.join([*again, '--ckpt_path', 'last'])}"
        ) from None
    except ArgumentError as e:
        raise UserError(parse_error_message(e, argv[0])) from None
    except MisconfigurationException as e:  # Lightning's own "bad option" errors
        raise UserError(" ".join(str(e).split())) from None
    finally:
        sys.argv = saved


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(top_help())
            return
        if argv[0] == "prepare":
            prepare_main(argv[1:])
        elif argv[0] == "bench":
            from lra_cond.bench import bench_main

            with one_line_argparse_errors():
                bench_main(argv[1:])
        elif argv[0] == "compare":
            from lra_cond.report.compare import compare_main

            compare_main(argv[1:])
        elif argv[0] == "report":
            from lra_cond.report.build import report_main

            report_main(argv[1:])
        elif argv[0] in TRAINER_COMMANDS:
            if any(a in ("-h", "--help") for a in argv[1:]):
                print(trainer_help(argv))
                return
            # Lightning's full option list: jsonargparse's --help.
            run_lightning([a if a != "--help-all" else "--help" for a in argv])
        else:
            raise UserError(f"unknown command '{argv[0]}'; valid commands: {', '.join(COMMANDS)}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(Interrupted.EXIT_STATUS)
    except KeyboardInterrupt as e:  # outside training (which raises Interrupted): data generation, ...
        print(f"error: interrupted (Ctrl-C){f' {e}' if str(e) else ''}", file=sys.stderr)
        sys.exit(Interrupted.EXIT_STATUS)
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        sys.exit(2)
