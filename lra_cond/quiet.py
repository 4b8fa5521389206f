"""Third-party console noise that says nothing about the user's run, kept out of the console.

Lightning advertises a cloud logger at every fit (``💡 Tip: ... litlogger``), and its pytree helper
warns that torch deprecated an ``isinstance`` check it makes (on ``validate``/``test``). Both are
dropped by their exact text, so any other message of those loggers, and every warning that
concerns the run, still shows.
"""

from __future__ import annotations

import logging
import warnings

NOISE = ("litlogger",)  # Lightning's advertisement of its cloud logger
DEPRECATED = r".*isinstance\(treespec, LeafSpec\)` is deprecated"  # lightning/pytorch/utilities/_pytree.py


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in NOISE)


def quiet_third_party() -> None:
    """Install the filters (idempotent)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
    warnings.filterwarnings("ignore", message=DEPRECATED)
