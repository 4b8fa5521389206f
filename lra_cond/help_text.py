"""Help and error text shared by every command: the program name, plain text from docstrings,
aligned help rows, one-line parse errors."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

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


def parse_error_message(error: Exception, command: str) -> str:
    """jsonargparse's message spans lines (and would come after a full usage text): one line."""
    message = " ".join(str(error).split())
    return f"{message} (see: {prog()} {command} --help)"
