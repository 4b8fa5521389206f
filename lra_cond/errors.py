"""User-facing errors: the CLI prints these as one line, without a traceback."""

from __future__ import annotations

import argparse
from typing import NoReturn


class UserError(Exception):
    """Bad input the user can fix; the message says what was wrong and how to fix it."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises ``UserError`` (one line) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see: {self.prog} --help)")
