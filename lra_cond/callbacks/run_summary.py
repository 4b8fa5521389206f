"""Records best validation accuracy (and its step), totals, and the test accuracy of the tested
checkpoint into ``metrics.json``, with what a reader of the results needs besides: the validation
and test splits' label counts (the frequent-class rate), the fit's wall-clock seconds and the
machines it ran on."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from lra_cond.callbacks.epochs import epochs_at
from lra_cond.run_dir import read_metrics, run_dir_of, update_metrics


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device: torch.device) -> str:
    """``2 x AMD EPYC, 1 thread, torch 2.13.0+cpu`` (or the GPU's name on CUDA)."""
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, {os.cpu_count()} cores"
    else:
        where = f"{os.cpu_count()} x {cpu_model()}, {torch.get_num_threads()} thread(s)"
    return f"{where}, torch {torch.__version__}"


def label_counts(datamodule: Any) -> dict[str, list[int]]:
    """Examples per class of the validation and test splits of an ``LraDataModule`` ({} otherwise)."""
    splits, spec = getattr(datamodule, "splits", None), getattr(datamodule, "spec", None)
    if splits is None or spec is None:
        return {}
    return {
        name: np.bincount(np.asarray(splits[name]["label"]), minlength=spec.num_classes).tolist()
        for name in ("val", "test")
        if name in splits
    }


class RunSummary(pl.Callback):
    def __init__(self) -> None:
        self.best_val_acc: float | None = None
        self.best_val_step: int | None = None
        self.val_history: list[list[float]] = []
        self.seconds_before = 0.0  # spent by earlier processes of this fit (from the checkpoint)
        self.started: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.monotonic()
        if trainer.is_global_zero and run_dir_of(trainer):
            machines = list(read_metrics(run_dir_of(trainer)).get("machines") or [])
            here = machine_description(pl_module.device)
            counts = label_counts(getattr(trainer, "datamodule", None))
            update_metrics(
                run_dir_of(trainer), machines=[*machines, *([here] if here not in machines else [])]
            )
            if counts:
                update_metrics(run_dir_of(trainer), label_counts=counts)

    def seconds(self) -> float:
        return self.seconds_before + (0.0 if self.started is None else time.monotonic() - self.started)

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
        # Ctrl-C or SIGTERM during fit: metrics.json says how far the run got, and what stopped it
        # (ResumeCheckpoint raises KeyboardInterrupt("SIGTERM") on a SIGTERM).
        if isinstance(exception, KeyboardInterrupt) and trainer.state.fn == "fit" and trainer.global_step > 0:
            what = str(exception) or "Ctrl-C"
            self._write(trainer, stopped=f"interrupted ({what}) at step {trainer.global_step}")

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
            seconds=round(self.seconds(), 1),
            **more,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_val_acc": self.best_val_acc,
            "best_val_step": self.best_val_step,
            "val_history": self.val_history,
            "seconds": self.seconds(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_val_acc = state_dict["best_val_acc"]
        self.best_val_step = state_dict["best_val_step"]
        self.val_history = state_dict["val_history"]
        self.seconds_before = float(state_dict.get("seconds", 0.0))
