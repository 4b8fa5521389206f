"""The training progress bar: the run's optimizer steps out of ``max_steps`` with an ETA for the run.

Lightning's rich bar counts batches of the current epoch (``Epoch 0/-2 ... 0/3000``) with a 30-second
speed estimate, and shows the logger's ``v_num`` (here the tail of ``seed0``). This one counts
``trainer.global_step`` out of the run's total (``max_steps``, or ``max_epochs`` x steps per epoch),
starts at the resumed step after ``--ckpt_path last``, and estimates the time left from the average
pace since this process started training (validations and condition-number probes included), so
the ETA is for the run, not the epoch. Validation and test bars are Lightning's.

When the output is not a terminal (a log file: ``compare --jobs``, a batch job), a bar cannot be
redrawn, so after every validation the bar prints one plain line instead:
``step 1250/5000 · val/acc 0.3520 · 0:21:30 elapsed · 0:58:12 left · 0.71 s/step``.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import (
    BatchesProcessedColumn,
    CustomTimeColumn,
    MetricsTextColumn,
    ProcessingSpeedColumn,
)
from rich.console import Console
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


def plain_line(step: int, total: float, acc: float | None, elapsed: float, steps_done: int) -> str:
    """One progress line for a log: step, validation accuracy, elapsed and left (at the pace since
    this process started training), seconds per step."""
    parts = [f"step {step}/{int(total)}" if math.isfinite(total) else f"step {step}"]
    if acc is not None:
        parts.append(f"val/acc {acc:.4f}")
    parts.append(f"{timedelta(seconds=int(elapsed))} elapsed")
    if steps_done > 0:
        if math.isfinite(total):
            parts.append(f"{timedelta(seconds=int(elapsed * max(0.0, total - step) / steps_done))} left")
        parts.append(f"{elapsed / steps_done:.2f} s/step")
    return " · ".join(parts)


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar with one training bar for the whole run (see the module doc)."""

    def __init__(self, *args: Any, console_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._lines = Console(**(console_kwargs or {}))  # where the bar draws; not a terminal: a log
        super().__init__(*args, console_kwargs=console_kwargs, **kwargs)
        self._start: tuple[float, int] | None = None  # (time, step) when this process began training

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = (time.monotonic(), trainer.global_step)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if (
            self._lines.is_terminal
            or self._start is None
            or trainer.sanity_checking
            or trainer.state.fn != "fit"
        ):
            return
        acc = trainer.callback_metrics.get("val/acc")
        elapsed, first = time.monotonic() - self._start[0], self._start[1]
        step = trainer.global_step
        line = plain_line(
            step, total_steps(trainer), None if acc is None else float(acc), elapsed, step - first
        )
        self._lines.print(line, highlight=False, soft_wrap=True)

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
        # What Lightning's bar does here, on the run's step: the training task, then the metrics column.
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=trainer.global_step, visible=True)
            columns = [c for c in self.progress.columns if isinstance(c, MetricsTextColumn)]
            if columns:
                metrics = self.get_metrics(trainer, pl_module)
                for column in columns:
                    column.update(metrics)
        self.refresh()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version: the tail of "seed0", not a metric
        return items
