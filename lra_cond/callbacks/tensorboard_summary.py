"""TensorBoard extras for comparing runs: a custom-scalars layout (all layers' κ in one chart) written
at fit start, and the hparams tab (task, attention, init, seed, lr, model size) with hp metrics
(best val accuracy, steps-to-target, final κ) written once at fit end from ``metrics.json``."""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lra_cond.run_dir import read_metrics, run_dir_of

# Regexes are allowed in custom-scalar "Multiline" charts: every layer's tag lands in one chart.
# The kappa charts use the log10 tags: kappa spans 1e3-1e10 across layers, and on a linear axis every
# curve but the largest sits at 0.
LAYOUT = {
    "condition number (log10)": {
        "log10 κ(J) all layers": ["Multiline", [r"cond/log10_kappa/layer\d+", "cond/log10_kappa/mean"]],
        "log10 κ(X) of each layer's probe input": ["Multiline", [r"cond/log10_kappa_x/layer\d+"]],
        "log10 κ(J_Q), κ(J_K), κ(J_V) all layers": ["Multiline", [r"cond/log10_kappa_[qkv]/layer\d+"]],
        "log10 κ(W) stacked Q/K/V all layers": ["Multiline", [r"cond/log10_weights/[qkv]/layer\d+"]],
    },
    "accuracy": {"val/test accuracy": ["Multiline", ["val/acc", "test/acc"]]},
}
HP_METRICS = ("hp/best_val_acc", "hp/steps_to_target", "hp/final_kappa")


def _tensorboard_loggers(trainer: pl.Trainer) -> list[TensorBoardLogger]:
    return [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]


def hp_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """hp metrics from a run's metrics.json; NaN where not measured (keeps the columns in the tab)."""
    history = metrics.get("cond_history") or []
    final_kappa = history[-1].get("kappa_mean") if history else None
    values = (metrics.get("best_val_acc"), metrics.get("steps_to_target"), final_kappa)
    return {k: math.nan if v is None else float(v) for k, v in zip(HP_METRICS, values)}


class TensorBoardSummary(pl.Callback):
    """Rank-zero writer of the custom-scalars layout and the hparams session (fit only)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for logger in _tensorboard_loggers(trainer):
            logger.experiment.add_custom_scalars(LAYOUT)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or not run_dir_of(trainer) or trainer.interrupted:
            return
        hp = pl_module.hparams
        params = {
            "task": hp.get("task"),
            "attention": hp.get("attention"),
            "init": hp.get("init"),
            # seed_everything exports the seed it set; the run folder is named after it.
            "seed": int(os.environ.get("PL_GLOBAL_SEED", "-1")),
            "lr": hp.get("lr"),
            "num_params": sum(p.numel() for p in pl_module.parameters()),
        }
        metrics = hp_metrics(read_metrics(run_dir_of(trainer)))
        for logger in _tensorboard_loggers(trainer):
            # Called after the trainer's teardown finalized the logger: log_hyperparams reopens the
            # writer; flush so the session is on disk before the best checkpoint is tested.
            logger.log_hyperparams(params, metrics=metrics)
            logger.experiment.flush()
