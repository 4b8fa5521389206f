"""``checkpoints/last.ckpt`` on a step cadence, for ``--ckpt_path last`` after a crash.

Kept apart from the best-by-validation ModelCheckpoint: in Lightning 2.6 a monitoring
ModelCheckpoint rewrites ``last.ckpt`` only when the monitored metric improved, and one that also
saved every N steps would rank step-time saves by a stale ``val/acc``.

When a checkpoint step is also a validation step, ``last.ckpt`` is written again after the
validation. Resuming from the pre-validation file would make Lightning skip that validation (it
counts it as done), losing its entry in the validation history and its chance to be the best.
Files are written atomically by Lightning, so a kill during a save leaves the previous one intact.

A run folder that was moved (another ``--run_root``) is resumed in its new place: before any
callback state is loaded, the checkpoint's paths are pointed at this folder, so the best checkpoint
and its score survive the move.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lra_cond.checkpoints import relocate_callback_paths


class ResumeCheckpoint(ModelCheckpoint):
    def __init__(self, every_n_train_steps: int) -> None:
        super().__init__(every_n_train_steps=every_n_train_steps, save_top_k=0, save_last=True)
        self.every = every_n_train_steps

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or trainer.fast_dev_run or not self.dirpath:
            return
        if trainer.global_step > 0 and trainer.global_step % self.every == 0:
            path = Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
            trainer.save_checkpoint(path)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Every callback's on_load_checkpoint runs before any callback's load_state_dict.
        if self.dirpath:
            relocate_callback_paths(checkpoint, self.dirpath)
