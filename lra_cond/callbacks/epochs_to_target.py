"""Steps (and fractional epochs) until validation accuracy first reaches a target.

The paper's LRA "epochs" are in fact optimizer steps, so both are recorded: ``steps_to_target`` is
``global_step`` at the first validation with ``val/acc >= target``; ``epochs_to_target`` is that
step divided by the training batches per epoch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lra_cond.callbacks.epochs import epochs_at
from lra_cond.errors import UserError, user_path
from lra_cond.run_dir import read_metrics, run_dir_of, update_metrics

# The accuracies fit logs at each validation (``LraModel``): what a target can be compared with.
METRICS = ("val/acc",)


class EpochsToTarget(pl.Callback):
    """Records when validation accuracy first reaches a target.

    Args:
        acc: target accuracy in [0, 1].
        from_run: a run folder (or its metrics.json) whose ``best_val_acc`` is the target, e.g. the
            default-init run of the same task and attention; exclusive with ``acc``.
        metric: the logged metric compared with the target.
        stop: stop training once the target is reached.
    """

    def __init__(
        self,
        acc: float | None = None,
        from_run: str | None = None,
        metric: str = "val/acc",
        stop: bool = False,
    ) -> None:
        if acc is not None and from_run is not None:
            raise UserError("give either target.acc or target.from_run, not both")
        if metric not in METRICS:  # a misspelt name would never be logged: the target never reached
            raise UserError(f"unknown target.metric '{metric}'; valid metrics: {', '.join(METRICS)}")
        if acc is not None and not 0.0 <= acc <= 1.0:
            raise UserError(f"target.acc must be in [0, 1] (a fraction, not a percentage), got {acc}")
        self.acc = acc
        self.from_run = from_run
        self.metric = metric
        self.stop = stop
        self.target: float | None = acc
        self.source: str | None = None if acc is None else "given"
        self.step: int | None = None
        self.epoch: float | None = None
        self.reached_acc: float | None = None

    @property
    def active(self) -> bool:
        return self.acc is not None or self.from_run is not None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.from_run is not None and self.target is None:
            path = Path(user_path(self.from_run))
            run_dir = path.parent if path.name == "metrics.json" else path
            best = read_metrics(run_dir).get("best_val_acc")
            if best is None:
                raise UserError(
                    f"target.from_run: no best_val_acc in {run_dir / 'metrics.json'}; "
                    "point it at a finished run folder or give target.acc"
                )
            self.target, self.source = float(best), str(run_dir)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.active or trainer.sanity_checking or trainer.state.fn != "fit" or self.step is not None:
            return
        value = trainer.callback_metrics.get(self.metric)
        if value is None or float(value) < self.target:
            return
        self.step = trainer.global_step
        self.epoch = epochs_at(trainer, self.step)
        self.reached_acc = float(value)
        self._write(trainer)
        self._log(trainer, pl_module)
        if self.stop:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.active:
            self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero and run_dir_of(trainer):
            update_metrics(
                run_dir_of(trainer),
                target_acc=self.target,
                target_source=self.source,
                target_metric=self.metric,
                steps_to_target=self.step,
                epochs_to_target=self.epoch,
                target_reached_acc=self.reached_acc,
            )

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Scalars at the step reached. (The hparams tab is written once, at fit end, by
        TensorBoardSummary: a second hparams session in the same run would confuse the tab.)"""
        if trainer.is_global_zero:
            metrics = {"target/steps_to_target": float(self.step)}
            if self.epoch is not None:
                metrics["target/epochs_to_target"] = self.epoch
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self.step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "source": self.source,
            "step": self.step,
            "epoch": self.epoch,
            "reached_acc": self.reached_acc,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in ("target", "source", "step", "epoch"):
            setattr(self, key, state_dict.get(key))
        self.reached_acc = state_dict.get("reached_acc")
