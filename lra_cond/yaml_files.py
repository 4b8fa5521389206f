"""YAML as the suite reads it: a key given twice in one mapping is an error, not the second value
silently winning (PyYAML's and jsonargparse's default). Used for study configs and, through
jsonargparse's public ``set_loader``, for every ``--config`` file and YAML option value of fit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from lra_cond.errors import UserError


def duplicate_key(text: str) -> str | None:
    """The first key given twice in one mapping of ``text`` ("'lr' on line 5"), or None."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None  # the loader reports malformed YAML itself
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        return f"'{key.value}' on line {key.start_mark.line + 1}"
                    seen.add(key.value)
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return None


def strict(load: Callable[[str], Any]) -> Callable[[str], Any]:
    """``load`` refusing a key given twice."""

    def load_strict(text: str) -> Any:
        twice = duplicate_key(text) if isinstance(text, str) else None
        if twice:
            raise UserError(f"a YAML key is given twice: {twice}; keep one (the second would silently win)")
        return load(text)

    return load_strict


def install_for_jsonargparse() -> None:
    """fit's config files and option values: jsonargparse's own YAML loader, made strict."""
    import jsonargparse

    loader = jsonargparse.get_loader("yaml")
    if not getattr(loader, "strict", False):
        load = strict(loader)
        load.strict = True  # type: ignore[attr-defined]
        jsonargparse.set_loader("yaml", load, exceptions=(yaml.YAMLError, UserError))


def check_config_file(path: str) -> None:
    """A ``--config`` file a user gives: readable text YAML with no key given twice (a binary file or
    a duplicate is one line naming the file, before anything is parsed)."""
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        return  # jsonargparse reports a missing file
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--config {path} is not a YAML text file (not UTF-8 at byte {e.start})") from None
    twice = duplicate_key(text)
    if twice:
        raise UserError(f"--config {path}: a YAML key is given twice: {twice}; keep one")
