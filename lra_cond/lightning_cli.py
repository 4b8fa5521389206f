"""The LightningCLI subclass behind ``fit``/``validate``/``test``: run folders, default callbacks,
and testing the best checkpoint after ``fit``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from rich.console import Console

from lra_cond.callbacks import ConditionNumberMonitor, EpochsToTarget, RunSummary, TensorBoardSummary
from lra_cond.data import LraDataModule
from lra_cond.models.module import LraModel


def run_name(task: str, attention: str, init: str) -> str:
    return f"{task}/{attention}/{init}"


class LraCLI(LightningCLI):
    def __init__(self, args: list[str] | None = None) -> None:
        super().__init__(
            LraModel,
            LraDataModule,
            seed_everything_default=0,
            auto_configure_optimizers=False,  # LraModel configures AdamW + its schedule
            save_config_kwargs={"overwrite": True},
            trainer_defaults={
                "callbacks": [
                    ModelCheckpoint(
                        monitor="val/acc",
                        mode="max",
                        save_last=True,
                        filename="best-step{step}",
                        auto_insert_metric_name=False,
                    ),
                    LearningRateMonitor(logging_interval="step"),
                    RunSummary(),
                    TensorBoardSummary(),
                ],
            },
            args=args,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--run_root", default="runs", help="runs go to RUN_ROOT/<task>/<attention>/<init>/seed<k>"
        )
        parser.link_arguments("data.task", "model.task")
        # One length setting: the model's position table is as long as the data's truncation
        # (None on both sides = the task's maximum).
        parser.link_arguments("data.max_len", "model.max_len")
        # On by default: --cond.every_n_steps N (0 disables), --cond.method, --cond.probe_tokens ...
        parser.add_lightning_class_args(ConditionNumberMonitor, "cond")
        # Inactive unless --target.acc A or --target.from_run RUN_DIR is given; --target.stop true.
        parser.add_lightning_class_args(EpochsToTarget, "target")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        cfg = self.config[self.subcommand]
        if cfg.trainer.logger in (None, True):
            # One folder per run: runs/<task>/<attention>/<init>/seed<k>/ (TensorBoard overlays inits).
            kwargs["logger"] = TensorBoardLogger(
                save_dir=cfg.run_root,
                name=run_name(cfg.data.task, cfg.model.attention, cfg.model.init),
                version=f"seed{cfg.seed_everything}",
                default_hp_metric=False,
            )
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        trainer = self.trainer
        if trainer.fast_dev_run or trainer.interrupted:
            return
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and ckpt.best_model_path:
            # Test the best-by-validation checkpoint, not the last weights.
            trainer.test(self.model, datamodule=self.datamodule, ckpt_path="best")
        else:
            Console(stderr=True).print(
                "[yellow]warning:[/] no validation ran, so there is no best checkpoint; "
                "testing the final weights (lower --trainer.val_check_interval)"
            )
            trainer.test(self.model, datamodule=self.datamodule)
