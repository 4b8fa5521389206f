"""TensorBoard extras for comparing runs: a custom-scalars layout (all layers' κ in one chart) written
at fit start, and the hparams tab written once at fit end: the run's setup (task, preset, attention
and its options, init and its parameters, seed, steps, batch, lr and warm-up, the κ probe's
settings, model size) with hp metrics from ``metrics.json`` (best val accuracy; steps-to-target when
a target was set; final κ when the monitor is on)."""

from __future__ import annotations

import json
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


def hp_metrics(metrics: dict[str, Any], target: bool = True, kappa: bool = True) -> dict[str, float]:
    """hp metrics from a run's metrics.json, NaN where not measured. ``hp/steps_to_target`` only when
    the run had a target and ``hp/final_kappa`` only with the monitor on: the columns depend on the
    run's setup (the same for the runs of one comparison), not on its outcome, and a run without a
    target shows no column of NaN."""
    history = metrics.get("cond_history") or []
    final_kappa = history[-1].get("kappa_mean") if history else None
    values = dict(zip(HP_METRICS, (metrics.get("best_val_acc"), metrics.get("steps_to_target"), final_kappa)))
    keep = {"hp/best_val_acc": True, "hp/steps_to_target": target, "hp/final_kappa": kappa}
    return {k: math.nan if v is None else float(v) for k, v in values.items() if keep[k]}


# The HPARAMS table shows five columns at first: TensorBoard sorts those whose values "differ" first,
# then by name, and checks the first five. These are marked so: what tells the runs of a comparison
# apart (init, seed) and what tells a smoke test from a study (preset, max_steps, lr).
FIRST_COLUMNS = ("init", "seed", "preset", "max_steps", "lr")


def first_columns(experiment: Any, names: tuple[str, ...]) -> Any:
    """The experiment summary of ``torch.utils.tensorboard.summary.hparams`` with ``names`` marked as
    the columns that differ between runs, so the HPARAMS tab shows them first."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    value = experiment.value[0]
    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
    for info in data.experiment.hparam_infos:
        info.differs = info.name in names
    value.metadata.plugin_data.content = data.SerializeToString()
    return experiment


def _shown(value: Any) -> str | float | bool:
    """An hparams value as the HPARAMS tab shows it well: numbers with a fractional part stay numbers
    (lr), integers become text (TensorBoard writes every number with 5 significant digits, so a seed
    0 read "0.0000" and 5000 steps "5000.0"), dicts and lists JSON."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is None else value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def run_hparams(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """The HPARAMS columns of a run (see the module doc)."""
    from lra_cond.callbacks.condition_monitor import ConditionNumberMonitor

    hp = pl_module.hparams
    data = trainer.datamodule
    cond = next((c for c in trainer.callbacks if isinstance(c, ConditionNumberMonitor)), None)
    params = {
        "task": hp.get("task"),
        "preset": getattr(data, "preset", None),
        "attention": hp.get("attention"),
        "attention_args": hp.get("attention_args") or {},
        "init": hp.get("init"),
        "init_args": hp.get("init_args") or {},
        # seed_everything exports the seed it set; the run folder is named after it.
        "seed": int(os.environ.get("PL_GLOBAL_SEED", "-1")),
        "max_steps": trainer.max_steps,
        "batch_size": getattr(data, "batch_size", None),
        "lr": hp.get("lr"),
        "warmup_steps": hp.get("warmup_steps"),
        "schedule": hp.get("schedule"),
        "cond.every_n_steps": cond.every_n_steps if cond else 0,
        "cond.probe_tokens": cond.probe_tokens if cond else None,
        "cond.method": cond.method if cond else None,
    }
    out: dict[str, Any] = {k: _shown(v) for k, v in params.items()}
    out["num_params"] = sum(p.numel() for p in pl_module.parameters())  # a number: for scatter plots
    return out


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
        params = run_hparams(trainer, pl_module)
        from lra_cond.callbacks.epochs_to_target import EpochsToTarget

        target = any(isinstance(c, EpochsToTarget) and c.active for c in trainer.callbacks)
        kappa = params["cond.every_n_steps"] != "0"
        metrics = hp_metrics(read_metrics(run_dir_of(trainer)), target=target, kappa=kappa)
        from torch.utils.tensorboard.summary import hparams

        for logger in _tensorboard_loggers(trainer):
            # What Lightning's log_hyperparams writes (the hp metrics as scalars, then the session),
            # with FIRST_COLUMNS first; hparams.yaml keeps the model's own hparams. Called after the
            # trainer's teardown finalized the logger: writing the scalars reopens the SummaryWriter's
            # events file (``metrics`` always holds hp/best_val_acc), whose public ``file_writer``
            # then takes the session's summaries; flush so the session is on disk before the best
            # checkpoint is tested.
            logger.log_metrics(metrics)
            experiment, start, end = hparams(params, metrics)
            writer = logger.experiment.file_writer
            for summary in (first_columns(experiment, FIRST_COLUMNS), start, end):
                writer.add_summary(summary)
            logger.experiment.flush()
