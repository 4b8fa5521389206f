"""Test-only callback that records what the optimizer actually uses at every step of a real ``fit``.

Passed on the command line as ``--trainer.callbacks+=schedule_hooks.RecordSchedule`` with ``tests/``
on PYTHONPATH; the library never imports this module.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl


class RecordSchedule(pl.Callback):
    """Writes ``[[global_step, lr, beta1], ...]`` of the first param group, read just before each
    optimizer step (so the values that step uses), to ``path`` at the end of training."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: list[list[float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        group = optimizer.param_groups[0]
        self.rows.append([trainer.global_step, group["lr"], group["betas"][0]])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Path(self.path).write_text(json.dumps(self.rows))
