"""The training progress bar, rendered to a string: steps out of the run's total (not batches of an
epoch), an ETA for the run from the average pace, no ``v_num``; and the loss logged on short runs."""

from __future__ import annotations

import io

import lightning.pytorch as pl
import pytest
import rich
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from rich.console import Console
from rich.progress import Progress
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lra_cond.callbacks.progress import STEPS, PaceColumn, RunTimeColumn, StepProgressBar, StepsColumn
from lra_cond.training.lightning_cli import log_interval


class Tiny(pl.LightningModule):
    """A model with a validation accuracy, as the suite's (``val/acc``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val/acc", 0.25)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def render_fit(tmp_path, monkeypatch, **trainer_kwargs) -> str:
    """A real fit (10 batches per epoch) with the bar writing to a string."""
    monkeypatch.setattr(rich, "_console", None)  # the bar reconfigures rich's global console
    out = io.StringIO()
    bar = StepProgressBar(console_kwargs={"file": out, "width": 200, "color_system": None})
    trainer = pl.Trainer(
        callbacks=[bar],
        # version "seed0", like a run folder: Lightning's bar showed its tail as "v_num: eed0"
        logger=TensorBoardLogger(tmp_path, name="run", version="seed0"),
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        **trainer_kwargs,
    )
    data = DataLoader(TensorDataset(torch.randn(40, 2)), batch_size=4)
    trainer.fit(Tiny(), data, data if trainer_kwargs.get("val_check_interval") else None)
    return out.getvalue()


def test_bar_counts_steps_of_max_steps_without_v_num(tmp_path, monkeypatch):
    text = render_fit(tmp_path, monkeypatch, max_steps=25, max_epochs=-1)
    last = [line for line in text.splitlines() if "train, epoch" in line][-1]
    assert "train, epoch 2 " in last and "step 25/25" in last and "left" in last
    assert "train/loss:" in last
    assert "v_num" not in text and "eed0" not in text and "Epoch 0/" not in text


def test_a_log_file_gets_one_plain_line_per_validation(tmp_path, monkeypatch):
    """Not a terminal (a StringIO here, a log file in use): after each validation one line that a
    reader of the log can follow, with the step, the accuracy, the time and the pace."""
    text = render_fit(tmp_path, monkeypatch, max_steps=20, max_epochs=-1, val_check_interval=5)
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert [line.split(" · ")[0] for line in lines] == ["step 5/20", "step 10/20", "step 15/20", "step 20/20"]
    assert all(
        " · val/acc 0.2500 · " in line and " elapsed · " in line and "s/step" in line for line in lines
    )
    assert lines[-1].split(" · ")[3] == "0:00:00 left"


def test_bar_total_is_max_epochs_times_steps_per_epoch_without_max_steps(tmp_path, monkeypatch):
    text = render_fit(tmp_path, monkeypatch, max_steps=-1, max_epochs=2)
    last = [line for line in text.splitlines() if "train, epoch" in line][-1]
    assert "step 20/20" in last and "train, epoch 1 " in last


def test_eta_is_for_the_run_at_the_average_pace_since_start():
    """A resumed run at step 250 of 500 that did 10 steps in 20 s (a validation included): 240 steps
    left at 2 s each. Lightning's epoch bar had no run total, and its 30-s speed window jumps with
    every validation."""
    now = [1000.0]
    columns = (StepsColumn(style=""), RunTimeColumn(style=""), PaceColumn(style=""))
    progress = Progress(*columns, get_time=lambda: now[0], console=Console(file=io.StringIO()))
    task = progress.add_task("train", total=500, completed=250, **{STEPS: 250})
    assert [str(c.render(progress.tasks[0])) for c in columns] == [
        "step 250/500",
        "0:00:00 • -:--:-- left",
        "",
    ]
    now[0] += 20.0
    progress.update(task, completed=260)
    assert [str(c.render(progress.tasks[0])) for c in columns] == [
        "step 260/500",
        "0:00:20 • 0:08:00 left",
        "2.00 s/step",
    ]
    # Validation and test bars (no step field) keep Lightning's columns.
    other = progress.add_task("Validation", total=63, completed=5)
    assert str(columns[0].render(progress.tasks[other])) == "5/63"


@pytest.mark.parametrize(
    "max_steps, every",
    [(8, 1), (40, 1), (100, 1), (500, 5), (5000, 50), (100000, 50), (-1, 50)],
)
def test_log_interval_gives_a_loss_curve_on_any_run_length(max_steps, every):
    assert log_interval(max_steps) == every
