"""User-facing errors: the CLI prints these as one line, without a traceback."""

from __future__ import annotations

import argparse
import os
from typing import Any, NoReturn


class UserError(Exception):
    """Bad input the user can fix; the message says what was wrong and how to fix it."""


class Interrupted(Exception):
    """The user (Ctrl-C) or a scheduler (SIGTERM) stopped a command; the CLI prints the message as
    one ``error:`` line and exits with 128 + the signal's number, the shell's convention: 130 for
    SIGINT, 143 for SIGTERM."""

    EXIT_STATUS = 130
    SIGTERM_STATUS = 143

    def __init__(self, message: str, resumable: bool = False, status: int = EXIT_STATUS) -> None:
        super().__init__(message)
        self.resumable = resumable  # fit: --ckpt_path last continues the run
        self.status = status


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with ``(default: X)`` after each option that has a default worth showing (not
    None or False, not required, not already stated in its help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if unset or action.required or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises ``UserError`` (one line) instead of printing usage and exiting, and shows
    the options' defaults in its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see: {self.prog} --help)")


def user_path(text: str) -> str:
    """A path option as a user means it: ``~`` and ``~user`` expanded (a shell does not expand them
    inside quotes, after ``--opt=``, or in an environment variable's value)."""
    return os.path.expanduser(text)
