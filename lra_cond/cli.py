"""Command line: ``python -m lra_cond {fit,validate,test,prepare,compare,report} ...``.

Trainer subcommands go through a LightningCLI subclass. ``--task T`` loads ``configs/defaults.yaml``
and ``configs/T.yaml`` before any other argument (so later flags override them); ``--attention``
and ``--init`` are shortcuts for ``--model.attention`` and ``--model.init``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lra_cond.errors import OneLineParser, UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
TRAINER_COMMANDS = ("fit", "validate", "test")
COMMANDS = (*TRAINER_COMMANDS, "prepare", "bench", "compare", "report")
SHORTCUTS = {"--attention": "--model.attention", "--init": "--model.init"}
# model.max_len is linked from data.max_len (one length for the data and the position table).
ALIASES = {"--model.max_len": "--data.max_len"}
USAGE = """usage: python -m lra_cond COMMAND [options]

commands:
  fit | validate | test   train / evaluate (LightningCLI; add --help for all options)
  prepare                 build a task's prepared data cache
  bench                   time training steps at a shape (one JSON line)
  compare                 fit several inits x seeds (reusing finished runs), then write a report
  report RUNS_DIR         rebuild the comparison report from existing run folders

example:
  python -m lra_cond fit --task listops --init conditioned
"""


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
    return f"{message} (see: python -m lra_cond {command} --help)"


def prepare_main(argv: list[str]) -> None:
    from lra_cond.data import cache
    from lra_cond.data.tasks import TASKS

    p = OneLineParser(prog="python -m lra_cond prepare", description="Build a prepared data cache.")
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


def run_lightning(argv: list[str]) -> None:
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lra_cond.lightning_cli import LraCLI

    # LightningCLI parses sys.argv, set to the expanded arguments: DDP re-executes
    # ``python -m lra_cond`` + sys.argv[1:] for the other ranks, which must parse the same way.
    saved, sys.argv = sys.argv, [sys.argv[0], *expand_shortcuts(argv)]
    try:
        LraCLI()
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
            print(USAGE)
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
            run_lightning(argv)
        else:
            raise UserError(f"unknown command '{argv[0]}'; valid commands: {', '.join(COMMANDS)}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        sys.exit(2)
