"""The training progress bar: the run's optimizer steps out of ``max_steps`` with an ETA for the run.

Lightning's rich bar counts batches of the current epoch (``Epoch 0/-2 ... 0/3000``) with a 30-second
speed estimate, and shows the logger's ``v_num`` (here the tail of ``seed0``). This one counts
``trainer.global_step`` out of the run's total (``max_steps``, or ``max_epochs`` x steps per epoch),
starts at the resumed step after ``--ckpt_path last``, and estimates the time left from the average
pace since this process started training (validations and condition-number probes included), so
the ETA is for the run, not the epoch. Validation and test bars are Lightning's.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import (
    BatchesProcessedColumn,
    CustomTimeColumn,
    ProcessingSpeedColumn,
)
from rich.progress import Task
from rich.text import Text

STEPS = "steps_from"  # task field of the training bar: the step it started at (after a resume)


def _steps_done(task: Task) -> float | None:
    """Steps this process trained (the bar's completed minus where it started), None if not the step bar."""
    start = task.fields.get(STEPS)
    return None if start is None else task.completed - start


def run_eta(task: Task) -> float | None:
    """Seconds left for the run at the average pace since the bar started (None before a step)."""
    done = _steps_done(task)
    if not done or task.elapsed is None or task.total is None or not math.isfinite(task.total):
        return None
    return task.elapsed * max(0.0, task.total - task.completed) / done


class StepsColumn(BatchesProcessedColumn):
    """``step 120/5000`` for the training bar; ``completed/total`` for the others."""

    def render(self, task: Task) -> Text:
        if STEPS not in task.fields:
            return super().render(task)
        total = f"/{int(task.total)}" if task.total is not None and math.isfinite(task.total) else ""
        return Text(f"step {int(task.completed)}{total}", style=self.style)


class RunTimeColumn(CustomTimeColumn):
    """Elapsed • remaining, the remaining time of the training bar being the run's."""

    def render(self, task: Task) -> Text:
        if STEPS not in task.fields:
            return super().render(task)
        elapsed = task.finished_time if task.finished else task.elapsed
        eta = run_eta(task)
        shown = ["-:--:--" if t is None else str(timedelta(seconds=int(t))) for t in (elapsed, eta)]
        return Text(f"{shown[0]} • {shown[1]} left", style=self.style)


class PaceColumn(ProcessingSpeedColumn):
    """The training bar's average pace (``2.05 s/step`` or ``3.10 steps/s``); others as Lightning's."""

    def render(self, task: Task) -> Text:
        done = _steps_done(task)
        if done is None:
            return super().render(task)
        if not done or not task.elapsed:
            return Text("", style=self.style)
        rate = done / task.elapsed
        return Text(f"{1 / rate:.2f} s/step" if rate < 1 else f"{rate:.2f} steps/s", style=self.style)


def total_steps(trainer: pl.Trainer) -> float:
    """The run's optimizer steps: ``max_steps``, else ``max_epochs`` x steps per epoch (inf if unbounded)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return float(trainer.max_steps)
    try:
        return float(trainer.estimated_stepping_batches)
    except Exception:  # no finite limit known yet
        return math.inf


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar with one training bar for the whole run (see the module doc)."""

    def configure_columns(self, trainer: pl.Trainer) -> list:
        columns = super().configure_columns(trainer)
        replace = {
            BatchesProcessedColumn: StepsColumn(style=self.theme.batch_progress),
            CustomTimeColumn: RunTimeColumn(style=self.theme.time),
            ProcessingSpeedColumn: PaceColumn(style=self.theme.processing_speed),
        }
        return [replace.get(type(c), c) for c in columns]

    @staticmethod
    def train_description(trainer: pl.Trainer) -> str:
        return f"train, epoch {trainer.current_epoch}"

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.is_disabled or self.progress is None:
            return
        description = self.train_description(trainer)
        if self.theme.description:
            description = f"[{self.theme.description}]{description}"
        if self.train_progress_bar_id is None:
            self.train_progress_bar_id = self.progress.add_task(
                description,
                total=total_steps(trainer),
                completed=trainer.global_step,
                **{STEPS: trainer.global_step},
            )
        else:
            self.progress.update(self.train_progress_bar_id, description=description)
        self.refresh()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.is_disabled:
            return
        if self.train_progress_bar_id is None:  # a resume that starts mid-epoch
            self.on_train_epoch_start(trainer, pl_module)
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version: the tail of "seed0", not a metric
        return items
