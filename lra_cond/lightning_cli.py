"""The LightningCLI subclass behind ``fit``/``validate``/``test``: run folders, default callbacks,
resumable checkpoints, and testing the best checkpoint after ``fit``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from rich.console import Console

from lra_cond.callbacks import ConditionNumberMonitor, EpochsToTarget, RunSummary, TensorBoardSummary
from lra_cond.callbacks.finite_guard import FiniteGuard
from lra_cond.callbacks.resume_checkpoint import ResumeCheckpoint
from lra_cond.callbacks.rng_state import RngState
from lra_cond.data import LraDataModule
from lra_cond.errors import UserError
from lra_cond.models.module import LraModel, check_schedule

# A parse error raises (instead of printing usage and exiting) so the CLI can print it as one line.
PARSER_KWARGS = {"exit_on_error": False, **{c: {"exit_on_error": False} for c in ("fit", "validate", "test")}}


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
                        filename="best-step{step}",
                        auto_insert_metric_name=False,
                    ),
                    LearningRateMonitor(logging_interval="step", log_momentum=True),  # lr and beta1
                    RunSummary(),
                    TensorBoardSummary(),
                    RngState(),
                    FiniteGuard(),
                ],
            },
            parser_kwargs=PARSER_KWARGS,
            args=args,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # On by default: --cond.every_n_steps N (0 disables), --cond.method, --cond.probe_tokens ...
        parser.add_lightning_class_args(ConditionNumberMonitor, "cond")
        # Inactive unless --target.acc A or --target.from_run RUN_DIR is given; --target.stop true.
        parser.add_lightning_class_args(EpochsToTarget, "target")
        parser.add_argument(
            "--run_root", default="runs", help="runs go to RUN_ROOT/<task>/<attention>/<init>/seed<k>"
        )
        parser.add_argument(
            "--checkpoint_every",
            type=int,
            default=250,
            help="write checkpoints/last.ckpt every N training steps (and at the end); "
            "resume an interrupted run with --ckpt_path last",
        )
        parser.link_arguments("data.task", "model.task")
        # One length setting: the model's position table is as long as the data's truncation
        # (None on both sides = the task's maximum).
        parser.link_arguments("data.max_len", "model.max_len")

    def before_instantiate_classes(self) -> None:
        if self.subcommand != "fit":
            return
        cfg = self.config[self.subcommand]
        # -1 is Lightning's "no step limit" (max_epochs then ends the run); 0 would train nothing.
        steps = cfg.trainer.max_steps
        if steps == 0 or steps < -1:
            raise UserError(f"trainer.max_steps must be positive (or -1 for no step limit), got {steps}")
        # The schedule's length is known here unless max_epochs sets it (then configure_optimizers
        # checks); refusing now leaves an earlier run's folder untouched.
        epochs = cfg.trainer.max_epochs
        if steps != -1:
            check_schedule(cfg.model.warmup_steps, steps, "trainer.max_steps")
        elif epochs == -1:
            check_schedule(cfg.model.warmup_steps, float("inf"), "")
        every = cfg.checkpoint_every
        if every <= 0:
            raise UserError(f"checkpoint_every must be positive (steps between checkpoints), got {every}")

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
        if self.subcommand == "fit":
            # After the best-by-validation ModelCheckpoint, so last.ckpt holds its updated state.
            resume = ResumeCheckpoint(every_n_train_steps=cfg.checkpoint_every)
            self.trainer_defaults["callbacks"] = [*self.trainer_defaults["callbacks"], resume]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        """``--ckpt_path last`` means this run folder's checkpoints/last.ckpt; say what happens."""
        cfg = self.config_init[self.subcommand]
        if cfg.ckpt_path != "last" or not self.trainer.log_dir:
            return
        last = Path(self.trainer.log_dir) / "checkpoints" / "last.ckpt"
        console = Console(stderr=True)
        if last.is_file():
            console.print(f"resuming from {last}")
            cfg.ckpt_path = str(last)
        else:
            console.print(f"[yellow]note:[/] no {last} yet: starting this run from scratch")
            cfg.ckpt_path = None

    def after_fit(self) -> None:
        trainer = self.trainer
        if trainer.fast_dev_run or trainer.interrupted:
            return
        ckpt = trainer.checkpoint_callback  # the first ModelCheckpoint: best by val/acc
        if ckpt is not None and ckpt.best_model_path:
            # Test the best-by-validation checkpoint, not the last weights.
            trainer.test(self.model, datamodule=self.datamodule, ckpt_path=ckpt.best_model_path)
        else:
            Console(stderr=True).print(
                "[yellow]warning:[/] no validation ran, so there is no best checkpoint; "
                "testing the final weights (lower --trainer.val_check_interval)"
            )
            trainer.test(self.model, datamodule=self.datamodule)
