"""Fit's command-line conventions on top of LightningCLI: ``--task T`` loads ``configs/defaults.yaml``
and ``configs/T.yaml`` before any other argument (so later flags override them); ``--attention`` and
``--init`` are shortcuts for ``--model.attention`` and ``--model.init``."""

from __future__ import annotations

from pathlib import Path

from lra_cond.errors import UserError

# The task configs: inside the package in an install (a wheel ships configs/ as lra_cond/configs/,
# see pyproject.toml), beside it in a source checkout.
_PACKAGE = Path(__file__).resolve().parent.parent
CONFIG_DIR = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"
SHORTCUTS = {"--attention": "--model.attention", "--init": "--model.init"}
# model.max_len is linked from data.max_len (one length for the data and the position table).
ALIASES = {"--model.max_len": "--data.max_len"}


def pop_option(args: list[str], name: str) -> str | None:
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
    task = pop_option(rest, "--task")
    prefix: list[str] = []
    if task is not None:
        TASKS.get(task)
        prefix += ["--config", str(CONFIG_DIR / "defaults.yaml")]
        task_config = CONFIG_DIR / f"{task}.yaml"
        if task_config.is_file():
            prefix += ["--config", str(task_config)]
        prefix += ["--data.task", task]
    for short, full in SHORTCUTS.items():
        value = pop_option(rest, short)
        if value is not None:
            (ATTENTIONS if short == "--attention" else INITS).get(value)
            rest += [full, value]
    for alias, full in ALIASES.items():
        value = pop_option(rest, alias)
        if value is not None:
            rest += [full, value]
    return [command, *prefix, *rest]
