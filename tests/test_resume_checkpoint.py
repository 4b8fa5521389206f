"""ResumeCheckpoint saves a cadence step's last.ckpt after the validation that follows it, so it has
to know at the end of a training batch whether Lightning validates next. Lightning decides inside
its training loop (a private method); ``_validation_follows`` applies the same rule to the trainer's
public state. Here it is checked against the validations a real Trainer runs, on the cadences fit
accepts: a number of steps across epochs, per epoch, a fraction of an epoch, every n-th epoch,
with limits, gradient accumulation, a stop request, no validation, and an unsized dataset."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lra_cond.callbacks.resume_checkpoint import _validation_follows


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Unsized(IterableDataset):
    """Ten examples with no ``__len__``: Lightning cannot count the epoch's batches."""

    def __iter__(self):
        for i in range(10):
            yield [torch.full((2,), float(i))]


class Record(pl.Callback):
    """The batches after which ``_validation_follows`` predicts a validation, and those Lightning
    validated after (by the batch's index across epochs)."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.predicted: list[int] = []
        self.validated: list[int] = []
        self.stop_at = stop_at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.stop_at is not None and trainer.global_step == self.stop_at:
            trainer.should_stop = True  # as a callback before ResumeCheckpoint would
        if _validation_follows(trainer):
            self.predicted.append(trainer.fit_loop.epoch_loop.total_batch_idx)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validated.append(trainer.fit_loop.epoch_loop.total_batch_idx)


STEPS = {"check_val_every_n_epoch": None}  # val_check_interval counts steps across epochs (fit's configs)


def loader(n: int = 10) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2)), batch_size=1)


@pytest.mark.parametrize(
    "options, stop_at, data",
    [
        ({**STEPS, "max_steps": 23, "val_check_interval": 4}, None, None),
        ({"max_epochs": 3}, None, None),
        ({"max_epochs": 3, "val_check_interval": 0.3}, None, None),
        ({"max_epochs": 4, "check_val_every_n_epoch": 2, "val_check_interval": 3}, None, None),
        ({"max_epochs": 3, "limit_train_batches": 7, "val_check_interval": 3}, None, None),
        ({"max_epochs": 2, "limit_train_batches": 0.5}, None, None),
        ({**STEPS, "max_steps": 9, "accumulate_grad_batches": 2, "val_check_interval": 4}, None, None),
        ({**STEPS, "max_steps": 20, "val_check_interval": 4}, 6, None),  # a stop request at step 6
        ({**STEPS, "max_steps": 20, "min_steps": 9, "val_check_interval": 4}, 6, None),  # too early
        ({**STEPS, "max_steps": 12, "val_check_interval": 3, "limit_val_batches": 0}, None, None),
        ({"max_epochs": 2}, None, "unsized"),
        ({"max_epochs": 2, "limit_train_batches": 4}, None, "unsized"),
        ({**STEPS, "max_steps": 14, "val_check_interval": 3}, None, "unsized"),
    ],
)  # fmt: skip
def test_validation_follows_predicts_lightnings_validations(options, stop_at, data, tmp_path) -> None:
    record = Record(stop_at)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[record],
        **options,
    )
    train = DataLoader(Unsized(), batch_size=1) if data == "unsized" else loader()
    trainer.fit(Tiny(), train_dataloaders=train, val_dataloaders=loader(3))
    assert record.predicted == record.validated
    if options.get("limit_val_batches") != 0:
        assert record.validated  # the case validates at all
