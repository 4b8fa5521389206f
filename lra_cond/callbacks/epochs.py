"""Training steps in epochs: the paper's LRA "epochs" are optimizer steps, so metrics.json records
both; an epoch is the trainer's training batches per epoch."""

from __future__ import annotations

import lightning.pytorch as pl


def epochs_at(trainer: pl.Trainer, step: int | None = None) -> float | None:
    """``step`` optimizer steps (default: the trainer's global step) in fractional epochs, or None
    when an epoch has no known length (no batches, or an endless loader)."""
    batches = trainer.num_training_batches
    step = trainer.global_step if step is None else step
    return step / batches if batches and batches != float("inf") else None
