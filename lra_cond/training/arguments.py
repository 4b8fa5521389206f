"""Fit's command-line conventions on top of LightningCLI: ``--task T`` loads ``configs/defaults.yaml``
and ``configs/T.yaml`` before any other argument (so later flags override them); ``--attention`` and
``--init`` are shortcuts for ``--model.attention`` and ``--model.init``. A ``fit`` that sets
``--trainer.max_steps`` but no warm-up gets the task config's warm-up scaled to the same fraction of
its steps (the reference schedule's shape), with a note saying so; the tiny preset of a task whose
reference batch exceeds its tiny split gets the task's ``tiny_batch_size``."""

from __future__ import annotations

import sys
from pathlib import Path

from lra_cond.errors import UserError
from lra_cond.yaml_files import check_config_file

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


def _given(args: list[str], name: str) -> str | None:
    """The value of the last ``name VALUE`` / ``name=VALUE`` in ``args`` (None if absent)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def scaled_warmup(task_config: Path, args: list[str]) -> tuple[int, str] | None:
    """(warm-up, note) when ``args`` change ``trainer.max_steps`` from the task config's and give no
    warm-up nor config file of their own: the config's warm-up at the same fraction of the steps
    (e.g. ListOps' 1000 of 5000 -> 6 of 30). None otherwise (also for a max_steps that is not a
    plain number: fit reports it)."""
    steps = _given(args, "--trainer.max_steps")
    if (
        steps is None
        or _given(args, "--model.warmup_steps") is not None
        or _given(args, "--config") is not None
    ):
        return None
    import yaml

    config = yaml.safe_load(task_config.read_text()) or {}
    warmup = (config.get("model") or {}).get("warmup_steps")
    total = (config.get("trainer") or {}).get("max_steps")
    try:
        steps_n = int(steps)
    except ValueError:
        return None
    if (
        not isinstance(warmup, int)
        or not isinstance(total, int)
        or total <= 0
        or steps_n in (total, -1)
        or steps_n <= 0
    ):
        return None
    scaled = round(warmup * steps_n / total)
    if scaled == 1:  # the one-cycle schedule needs 0 or at least 2 warm-up steps
        scaled = 2 if steps_n > 2 else 0
    note = (
        f"note: warm-up scaled with --trainer.max_steps {steps_n}: {scaled} steps (the task config's "
        f"{warmup} of {total}); give --model.warmup_steps to choose"
    )
    return scaled, note


def _rank_zero() -> bool:
    """Whether this is the first process of a run: under DDP, Lightning starts the other ranks with
    the same command line (LOCAL_RANK set), and they expand it again without a second note."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return rank_zero_only.rank == 0


def expand_shortcuts(argv: list[str]) -> list[str]:
    """Turn ``fit --task T --attention A --init I ...`` into plain LightningCLI arguments."""
    from lra_cond.data.tasks import TASKS
    from lra_cond.init import INITS
    from lra_cond.models.attention import ATTENTIONS

    command, rest = argv[0], list(argv[1:])
    for i, arg in enumerate(rest):  # the user's config files, before anything reads them
        if arg == "--config" and i + 1 < len(rest):
            check_config_file(rest[i + 1])
        elif arg.startswith("--config="):
            check_config_file(arg.split("=", 1)[1])
    task = pop_option(rest, "--task")
    prefix: list[str] = []
    if task is not None:
        TASKS.get(task)
        prefix += ["--config", str(CONFIG_DIR / "defaults.yaml")]
        task_config = CONFIG_DIR / f"{task}.yaml"
        if task_config.is_file():
            prefix += ["--config", str(task_config)]
            warmup = scaled_warmup(task_config, rest) if command == "fit" else None
            if warmup is not None:
                rest += ["--model.warmup_steps", str(warmup[0])]
                if _rank_zero():
                    print(warmup[1], file=sys.stderr)
        tiny_batch = TASKS.get(task).tiny_batch_size
        if (
            tiny_batch
            and _given(rest, "--data.preset") == "tiny"
            and _given(rest, "--data.batch_size") is None
        ):
            rest += ["--data.batch_size", str(tiny_batch)]  # the reference batch exceeds the tiny split
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
