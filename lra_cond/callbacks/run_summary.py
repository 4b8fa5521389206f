"""Records best validation accuracy (and its step), totals, and the test accuracy of the tested
checkpoint into ``metrics.json``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lra_cond.callbacks.epochs import epochs_at
from lra_cond.run_dir import run_dir_of, update_metrics


class RunSummary(pl.Callback):
    def __init__(self) -> None:
        self.best_val_acc: float | None = None
        self.best_val_step: int | None = None
        self.val_history: list[list[float]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        acc = trainer.callback_metrics.get("val/acc")
        if acc is None:
            return
        acc = float(acc)
        step = trainer.global_step
        self.val_history.append([step, acc])
        if self.best_val_acc is None or acc > self.best_val_acc:
            self.best_val_acc, self.best_val_step = acc, step
        self._write(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Ctrl-C during fit: metrics.json says how far the run got, and that it was interrupted.
        if isinstance(exception, KeyboardInterrupt) and trainer.state.fn == "fit" and trainer.global_step > 0:
            self._write(trainer, stopped=f"interrupted (Ctrl-C) at step {trainer.global_step}")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = trainer.callback_metrics.get("test/acc")
        if acc is not None and trainer.is_global_zero and run_dir_of(trainer):
            update_metrics(run_dir_of(trainer), test_acc=float(acc), test_ckpt=trainer.ckpt_path)

    def _write(self, trainer: pl.Trainer, **more: Any) -> None:
        if not trainer.is_global_zero or not run_dir_of(trainer):
            return
        epochs = epochs_at(trainer)
        update_metrics(
            run_dir_of(trainer),
            best_val_acc=self.best_val_acc,
            best_val_step=self.best_val_step,
            val_history=self.val_history,
            total_steps=trainer.global_step,
            total_epochs=epochs,
            **more,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_val_acc": self.best_val_acc,
            "best_val_step": self.best_val_step,
            "val_history": self.val_history,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_val_acc = state_dict["best_val_acc"]
        self.best_val_step = state_dict["best_val_step"]
        self.val_history = state_dict["val_history"]
