from __future__ import annotations

from typing import TYPE_CHECKING

from lra_cond.data.tasks import TASKS, TaskSpec

if TYPE_CHECKING:
    from lra_cond.data.datamodule import LraDataModule

__all__ = ["LraDataModule", "TASKS", "TaskSpec"]


def __getattr__(name: str) -> type:
    # LraDataModule on first use: it imports Lightning (~7 s here), which the registry's users
    # (``--help``, ``prepare``) never need (``--help``: 9.5 -> 3.8 s, measured)
    if name == "LraDataModule":
        from lra_cond.data.datamodule import LraDataModule

        return LraDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
