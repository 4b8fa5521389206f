"""The LightningCLI subclass behind ``fit``/``validate``/``test``: run folders, default callbacks,
resumable checkpoints, and testing the best checkpoint after ``fit``.

What the commands may write (``lra_cond.run_dir`` owns the folder):

- ``fit`` writes one run folder, ``<run_root>/<task>/<attention>/<init>/seed<k>/``, and holds its
  lock while it runs, so a second ``fit`` into the same folder is refused. It starts only in a folder
  that holds no run; ``--ckpt_path last`` resumes the folder's own unfinished run when the command
  matches it (``run_dir.RESUME_MAY_CHANGE`` lists what a resume may change; the model's options are
  also checked against the checkpoint). ``config.yaml`` is written once, when a new run starts
  training. A ``fit`` that fails before training removes what it created.
- ``validate`` and ``test`` write nothing: they print their results. Their ``--ckpt_path`` (a file,
  or ``last`` for the run folder of the given options) must match the command's model options.
- Every option's range is checked before anything is built (``lra_cond.checks``).
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.seed import isolate_rng
from rich.console import Console

from lra_cond import run_dir
from lra_cond.callbacks import ConditionNumberMonitor, EpochsToTarget, RunSummary, TensorBoardSummary
from lra_cond.callbacks.finite_guard import FiniteGuard
from lra_cond.callbacks.progress import StepProgressBar
from lra_cond.callbacks.resume_checkpoint import ResumeCheckpoint
from lra_cond.callbacks.rng_state import RngState
from lra_cond.checkpoints import (
    AtomicCheckpointIO,
    best_checkpoint_name,
    hparams_differences,
    load_checkpoint,
)
from lra_cond.checks import check_model_args, check_seed, check_trainer_args, validation_gap
from lra_cond.cores import busy_cores, oversubscribed_note
from lra_cond.data import LraDataModule
from lra_cond.data.tasks import TASKS
from lra_cond.errors import Interrupted, UserError, user_path
from lra_cond.help_text import parse_error_message, plain_text, prog
from lra_cond.init import INITS
from lra_cond.models.attention import ATTENTIONS
from lra_cond.training.arguments import SHORTCUTS, expand_shortcuts
from lra_cond.training.module import LraModel, check_schedule
from lra_cond.yaml_files import install_for_jsonargparse

install_for_jsonargparse()  # fit's YAML: a key given twice is an error
COMMANDS = ("fit", "validate", "test")  # the Trainer methods LraCLI runs
# Lightning's special --ckpt_path values other than "last" name checkpoints of the running process.
LIGHTNING_CKPT_NAMES = ("best", "hpc", "registry")
# What seed_everything sets in the environment (for DDP ranks and dataloader workers).
SEED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
# Keys of metrics.json that describe how a run ended: a resumed run has not ended yet.
END_OF_RUN_KEYS = ("stopped", "test_acc", "test_ckpt")


def log_interval(max_steps: int) -> int:
    """``trainer.log_every_n_steps`` when the config leaves it null: about 100 points of the training
    loss and lr curves on any run length (every step of a short run), at most every 50 steps
    (Lightning's default, which logged nothing in a run shorter than 50 steps)."""
    return max(1, min(50, max_steps // 100)) if max_steps and max_steps > 0 else 50


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


class RunStart(pl.Callback):
    """When a ``fit`` starts training (rank zero): writes ``config.yaml`` and the data checksum of a
    new run, and marks in the lock file that training started."""

    def __init__(self) -> None:
        self.folder: run_dir.RunFolder | None = None
        self.config_text: str | None = None
        self.resume = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or self.folder is None:
            return
        self.folder.mark_training()
        if self.config_text is not None:
            run_dir.write_config(self.folder.path, self.config_text)
        data = getattr(trainer.datamodule, "data_sha256", None)
        if not self.resume and data:
            run_dir.update_metrics(self.folder.path, data_sha256=data)


class LraCLI(LightningCLI):
    """One ``fit``, ``validate`` or ``test``, built as Lightning's own example
    (``examples/pytorch/basics/autoencoder.py``) builds its CLI: ``LightningCLI(..., run=False)``
    parses the command's options from a list (``args``) and builds the model, the data and the
    trainer; ``run`` then calls ``trainer.fit`` (and ``trainer.test`` of the best checkpoint), or
    ``trainer.validate``/``trainer.test``, with the run folder locked and checked around those calls.

    The parser is the command's own: LightningCLI's options plus the Trainer method's arguments
    (``--ckpt_path``, ...), as LightningCLI's parser of that subcommand would have them. With
    ``run=False`` Lightning leaves ``--ckpt_path`` alone (its ``run=True`` would overwrite the command's
    model options with the checkpoint's): ``check_config`` checks it against the command instead.
    """

    def __init__(self, command: str, args: list[str], prog: str | None = None) -> None:
        if command not in COMMANDS:
            raise ValueError(f"not a trainer command: {command}")
        self.command = command
        self._method_args: list[str] = []  # the Trainer method's options (ckpt_path, weights_only, ...)
        self._folder: run_dir.RunFolder | None = None  # the locked run folder (fit, rank zero)
        self._resume: dict[str, Any] | None = None  # the checkpoint fit resumes from
        self._note: str | None = None
        self._run_start = RunStart()
        description = (inspect.getdoc(getattr(Trainer, command)) or "").split("\n", 1)[0]
        super().__init__(
            LraModel,
            LraDataModule,
            seed_everything_default=0,
            auto_configure_optimizers=False,  # LraModel configures AdamW + its schedule
            save_config_callback=None,  # config.yaml is written by RunStart, once
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
            # A parse error raises (instead of printing usage and exiting): the CLI prints it as one line.
            parser_kwargs={
                "exit_on_error": False,
                "description": description,
                **({"prog": prog} if prog else {}),
            },
            args=args,
            run=False,
        )

    def setup_parser(self, add_subcommands: bool, main_kwargs: Any, subparser_kwargs: Any) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        # Help texts come from docstrings (Lightning's are reStructuredText): plain text in --help.
        # argparse has no public list of a parser's actions and groups (its help formatter reads the
        # same private lists), and the texts must change before the formatter wraps them.
        parser = self.parser
        parser.description = plain_text(parser.description) if parser.description else None
        for action in parser._actions:
            if isinstance(action.help, str):
                action.help = plain_text(action.help)
        for group in parser._action_groups:
            for attr in ("title", "description"):
                if isinstance(getattr(group, attr, None), str):
                    setattr(group, attr, plain_text(getattr(group, attr)))

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # On by default: --cond.every_n_steps N (0 disables), --cond.method, --cond.probe_tokens ...
        parser.add_lightning_class_args(ConditionNumberMonitor, "cond")
        # Inactive unless --target.acc A or --target.from_run RUN_DIR is given; --target.stop true.
        parser.add_lightning_class_args(EpochsToTarget, "target")
        parser.add_argument(
            "--run_root",
            default="runs",
            help="runs go to RUN_ROOT/<task>[-<preset>][-<run_name>]/<attention>/<init>/seed<k> (the preset "
            "when it is not full)",
        )
        parser.add_argument(
            "--run_name",
            type=str | None,
            default=None,
            help="a name for a variant of a study (e.g. lr3e-4), added to the task's folder",
        )
        parser.add_argument(
            "--checkpoint_every",
            type=int,
            default=250,
            help="write checkpoints/last.ckpt every N training steps (and at the end); "
            "resume an interrupted run with --ckpt_path last",
        )
        # The valid names in the help of the options the shortcuts set (and of data.task); argparse
        # has no public way to find an action by its dest.
        names = {
            "model.attention": ATTENTIONS.names(),
            "model.init": INITS.names(),
            "data.task": TASKS.names(),
        }
        for action in parser._actions:
            if action.dest in names:
                action.help = f"{action.help or ''} One of: {', '.join(names[action.dest])}.".strip()
        shortcuts = ", ".join(f"{short} (= {full})" for short, full in SHORTCUTS.items())
        parser.description = (
            f"{parser.description or ''} Shortcuts: --task TASK (loads configs/defaults.yaml and "
            f"configs/TASK.yaml first, one of: {', '.join(TASKS.names())}), {shortcuts}."
        ).strip()
        parser.link_arguments("data.task", "model.task")
        # One length setting: the model's position table is as long as the data's truncation
        # (None on both sides = the task's maximum).
        parser.link_arguments("data.max_len", "model.max_len")
        # Last, the command's own arguments (Trainer.fit's ckpt_path, ...), as LightningCLI's parser of
        # that subcommand adds them (the model and the data are LightningCLI's).
        skip = set(self.subcommands()[self.command])
        self._method_args = parser.add_method_arguments(Trainer, self.command, skip=skip)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parses ``args`` (the command's options, shortcuts expanded), then checks them before anything
        is built. Not through LightningCLI's version: it warns whenever ``args`` is given while
        ``sys.argv`` holds arguments, which a ``python -m lra_cond fit ...`` always has (the same
        command, before its shortcuts were expanded)."""
        self.config = parser.parse_args(args)
        self.check_config(self.command, self.config)

    # --- checks on the parsed config, before anything is built -------------------------------------

    @staticmethod
    def run_path(cfg: Any) -> Path:
        return run_dir.run_path(
            cfg.run_root,
            cfg.data.task,
            cfg.model.attention,
            cfg.model.init,
            cfg.seed_everything,
            preset=cfg.data.preset,
            name=cfg.run_name,
        )

    def resolved_config_text(self) -> str:
        """The resolved config as ``config.yaml`` holds it (``compare`` compares run folders with it)."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.parser.dump(self.config, skip_none=False)

    def option_defaults(self) -> dict[str, Any]:
        """Every option's default, in config.yaml's form (for runs saved before an option existed)."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return yaml.safe_load(
                self.parser.dump(self.parser.get_defaults(), skip_none=False, skip_validation=True)
            )

    def check_config(self, subcommand: str, cfg: Any) -> None:
        """Every option's range, then ``--ckpt_path`` against the command (before anything is built).
        Path options get ``~`` expanded first, so config.yaml records the folders really used."""
        for key in ("run_root", "ckpt_path", "data.data_dir", "target.from_run"):
            value = cfg.get(key)
            if isinstance(value, str) and value.startswith("~"):
                cfg[key] = user_path(value)
        check_seed(cfg.seed_everything)
        run_dir.check_run_name(cfg.run_name)
        check_trainer_args(cfg.trainer, fit=subcommand == "fit")
        # LraModel checks the same (for library use); here they also stop compare before any run.
        model = cfg.model
        check_model_args(**{k: model.get(k) for k in inspect.signature(check_model_args).parameters})
        if subcommand == "fit":
            # The schedule's length is known here unless max_epochs sets it (then configure_optimizers
            # checks); refusing now leaves an earlier run's folder untouched.
            steps, epochs = cfg.trainer.max_steps, cfg.trainer.max_epochs
            warmup, schedule = cfg.model.warmup_steps, cfg.model.schedule
            if steps != -1:
                check_schedule(warmup, steps, "trainer.max_steps", schedule)
            elif epochs == -1:
                check_schedule(warmup, float("inf"), "", schedule)
            if cfg.checkpoint_every <= 0:
                raise UserError(
                    "checkpoint_every must be positive (steps between checkpoints), "
                    f"got {cfg.checkpoint_every}"
                )
            if cfg.seed_everything is False:
                raise UserError(
                    "fit needs a seed: its run folder is seed<N> (give --seed_everything N, or true for a "
                    "random one)"
                )
            root = Path(cfg.run_root)
            if root.exists() and not root.is_dir():
                raise UserError(f"run_root {root} is not a directory; pass --run_root DIR")
            if cfg.trainer.logger not in (None, True):
                raise UserError(
                    "fit writes its run folder through its own TensorBoard logger: leave out "
                    "--trainer.logger (choose the folder with --run_root)"
                )
        self._check_checkpoint(subcommand, cfg)

    def _check_checkpoint(self, subcommand: str, cfg: Any) -> None:
        path = cfg.get("ckpt_path")
        if path is None:
            return
        if path in LIGHTNING_CKPT_NAMES or str(path).startswith("registry:"):
            raise UserError(
                f"--ckpt_path {path} is not supported; give a .ckpt file, or 'last' for the last checkpoint "
                "of the run folder these options name"
            )
        if path == "last":
            if isinstance(cfg.seed_everything, bool):
                raise UserError("--ckpt_path last needs the run's seed: give --seed_everything N")
            last = run_dir.last_checkpoint(self.run_path(cfg))
            if not last.is_file():
                if subcommand != "fit":
                    raise UserError(
                        f"--ckpt_path last: there is no {last}; give the options of the run to "
                        f"{subcommand} (task, attention, init, seed, --run_root), or a checkpoint file"
                    )
                self._note = f"no {last} yet: starting this run from scratch"
                cfg.ckpt_path = None
                return
            path = cfg.ckpt_path = str(last)
        ckpt = load_checkpoint(path)
        defaults = {
            k: p.default for k, p in inspect.signature(LraModel.__init__).parameters.items() if k != "self"
        }
        diff = hparams_differences(ckpt["hyper_parameters"], cfg.model.as_dict(), defaults)
        if diff:
            hint = "give the run's own options" + (
                ", or leave out --ckpt_path to start a new run" if subcommand == "fit" else ""
            )
            raise UserError(
                f"--ckpt_path {path} was trained with other model options than this command: "
                f"{'; '.join(diff)}; {hint}"
            )
        if subcommand == "fit":
            self._resume = {"path": path, "step": ckpt.get("global_step"), "best": best_checkpoint_name(ckpt)}

    # --- the trainer --------------------------------------------------------------------------------

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        cfg = self.config
        if self.command == "fit":
            # One folder per run: runs/<task>/<attention>/<init>/seed<k>/ (TensorBoard overlays inits).
            kwargs["logger"] = TensorBoardLogger(
                save_dir=cfg.run_root,
                name=run_dir.run_name(
                    cfg.data.task,
                    cfg.model.attention,
                    cfg.model.init,
                    preset=cfg.data.preset,
                    name=cfg.run_name,
                ),
                version=run_dir.seed_name(cfg.seed_everything),
                default_hp_metric=False,
            )
            extra: list[pl.Callback] = [self._run_start]
            if not cfg.trainer.fast_dev_run:  # a smoke run writes no checkpoint (it has no run folder)
                # After the best-by-validation ModelCheckpoint, so last.ckpt holds its updated state.
                extra.insert(0, ResumeCheckpoint(every_n_train_steps=cfg.checkpoint_every))
            self.trainer_defaults["callbacks"] = [*self.trainer_defaults["callbacks"], *extra]
        elif cfg.trainer.logger is None:
            kwargs["logger"] = False  # validate/test print their results and write no run folder
        self.trainer_defaults["callbacks"] = [
            *self.trainer_defaults["callbacks"],
            *self._progress_bar(cfg),
        ]
        if cfg.trainer.log_every_n_steps is None:
            kwargs["log_every_n_steps"] = log_interval(cfg.trainer.max_steps)
        if not cfg.trainer.get("plugins"):  # checkpoints written beside themselves, then renamed
            kwargs["plugins"] = [AtomicCheckpointIO()]
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError) as e:
            raise UserError(f"trainer options: {one_line(e)}") from None

    def _progress_bar(self, cfg: Any) -> list[pl.Callback]:
        """The step bar (lra_cond.callbacks.progress), unless bars are off or the command brings one."""
        theirs = self.config_init.get("trainer", {}).get("callbacks") or []
        theirs = theirs if isinstance(theirs, list) else [theirs]
        if cfg.trainer.enable_progress_bar is False or any(isinstance(c, ProgressBar) for c in theirs):
            return []
        return [StepProgressBar()]

    # --- fit: the run folder ------------------------------------------------------------------------

    def before_fit(self) -> None:
        """Lock the run folder and decide: a new run, or a resume of this folder's own run."""
        if self.trainer.fast_dev_run or not self.trainer.is_global_zero:
            return  # fast_dev_run writes no run folder; rank zero alone decides and writes
        console = Console(stderr=True, soft_wrap=True)
        gap = validation_gap(self.config.trainer)
        if gap:
            console.print(
                f"[yellow]warning:[/] no validation will run ({gap}): no best checkpoint and no "
                "steps-to-target; the final weights are tested (lower --trainer.val_check_interval)"
            )
        if isinstance(self.trainer.accelerator, CPUAccelerator):
            note = oversubscribed_note(torch.get_num_threads(), busy_cores(), os.cpu_count() or 1)
            if note:
                console.print(f"[yellow]note:[/] {note}")
        # The data first (checked, or generated when missing), as fit itself would: a data error is
        # reported before the run folder is looked at. Lightning's own call then finds it loaded.
        self.datamodule.prepare_data()
        folder = run_dir.RunFolder(self.run_path(self.config))
        folder.lock()
        self._folder = folder
        try:
            self._start(folder)
        except BaseException:
            self._release(failed=True)
            raise

    def _start(self, folder: run_dir.RunFolder) -> None:
        mine = yaml.safe_load(self.resolved_config_text())
        state = folder.state()
        console = Console(stderr=True, soft_wrap=True)
        if self._resume is None:
            theirs = folder.config
            diff = (
                run_dir.config_differences(theirs, mine, run_dir.RESUME_MAY_CHANGE, self.option_defaults())
                if theirs
                else []
            )
            if self._note and not diff and folder.restartable():
                # --ckpt_path last, and the run stopped before its first checkpoint (a kill or a
                # scheduler's signal before training got that far): the same command starts it again.
                console.print(f"[yellow]note:[/] {folder.path} holds {folder.describe()}: starting it again")
                folder.clear()
                self._note, state = None, run_dir.State.EMPTY
            if state is not run_dir.State.EMPTY:
                raise UserError(self._occupied(folder, state, diff))
            if self._note:
                console.print(f"[yellow]note:[/] {self._note}")
            self._run_start.folder, self._run_start.config_text = folder, self.resolved_config_text()
            return
        path = Path(self._resume["path"])
        if path.resolve() != folder.last_checkpoint.resolve():
            raise UserError(
                f"--ckpt_path {path}: fit resumes a run from its own {run_dir.LAST_CHECKPOINT} "
                f"({folder.last_checkpoint}); give the options of the run that wrote {path.name} "
                "(--run_root, --attention, --init, --seed_everything) and --ckpt_path last, or evaluate it "
                "with validate/test"
            )
        if state is run_dir.State.FINISHED:
            raise UserError(
                f"{folder.path} holds {folder.describe()}: there is nothing to resume; to train longer or "
                "differently start a new run elsewhere with --run_root DIR"
            )
        theirs = folder.config
        if not theirs:
            name = run_dir.CONFIG_FILE
            raise UserError(
                f"cannot resume {folder.path}: it has checkpoints but no {name}, so this command's options "
                f"cannot be checked against the run's; restore its {name}, or start a new run elsewhere "
                "with --run_root DIR"
            )
        diff = run_dir.config_differences(theirs, mine, run_dir.RESUME_MAY_CHANGE, self.option_defaults())
        if diff:
            raise UserError(
                f"cannot resume {folder.path}: this command changes {', '.join(diff)}, which a resume may "
                "not change; give the run's own options, or start a new run elsewhere with --run_root DIR"
            )
        started_with, now = folder.metrics.get("data_sha256"), getattr(self.datamodule, "data_sha256", None)
        if started_with and now and started_with != now:
            raise UserError(
                f"cannot resume {folder.path}: the prepared data at {self.datamodule.path} is not the data "
                "this run started with (it was prepared again since, from another seed or source); restore "
                "that data, or start a new run elsewhere with --run_root DIR"
            )
        best = self._resume["best"]
        if best and not (folder.path / run_dir.CHECKPOINT_DIR / best).is_file():
            raise UserError(
                f"cannot resume {folder.path}: its best checkpoint {best} (recorded in {path.name}) is not "
                f"in {folder.path / run_dir.CHECKPOINT_DIR}; move or copy the whole run folder, not single "
                "files"
            )
        console.print(f"resuming from {path}")
        for rel in folder.discard_after(self._resume["step"] or 0):
            console.print(f"removed {rel}: left by the killed run after the checkpoint resumed from")
        self._run_start.folder, self._run_start.resume = folder, True
        self._run_start.config_text = None

    def _occupied(self, folder: run_dir.RunFolder, state: run_dir.State, diff: list[str]) -> str:
        """The refusal of a new run in a folder that holds one (``diff``: the options it differs in)."""
        what = folder.describe() + (f", with other options ({', '.join(diff)})" if diff else "")
        elsewhere = "start this run elsewhere with --run_root DIR (or move the folder away)"
        if state is run_dir.State.UNFINISHED:
            how = f"resume it with --ckpt_path last (and its own options), or {elsewhere}"
        elif state is run_dir.State.FINISHED:
            how = f"to keep it, {elsewhere}"
        else:
            how = f"nothing to resume with --ckpt_path last; {elsewhere}"
        return f"{folder.path} already holds {what}; {how}"

    def _release(self, failed: bool) -> None:
        folder, self._folder = self._folder, None
        if folder is not None:
            folder.unlock(discard_new_files=failed and not folder.training_started())

    def run(self) -> None:
        """The command: ``trainer.fit`` inside the run folder's lock, then ``trainer.test`` of the best
        checkpoint (``after_fit``); or ``trainer.validate``/``trainer.test`` of ``--ckpt_path``."""
        # The Trainer method's options as parsed (ckpt_path, weights_only; verbose for validate/test).
        options = {key: self.config_init[key] for key in self._method_args}
        try:
            if self.command == "fit":
                self.before_fit()
                self.trainer.fit(self.model, datamodule=self.datamodule, **options)
                self.after_fit()
            else:
                getattr(self.trainer, self.command)(self.model, datamodule=self.datamodule, **options)
        except BaseException as e:
            self._release(failed=True)
            # Lightning turns a KeyboardInterrupt into a graceful shutdown and sys.exit(1).
            if isinstance(e, (SystemExit, KeyboardInterrupt)) and self.trainer.interrupted:
                raise self._interrupted() from None
            raise
        self._release(failed=False)

    def _interrupted(self) -> Interrupted:
        """What an interrupted command left: the step it stopped at and what last.ckpt holds."""
        trainer = self.trainer
        resume = next((c for c in trainer.callbacks if isinstance(c, ResumeCheckpoint)), None)
        what = (resume.signal_name if resume is not None else "") or "Ctrl-C"
        status = Interrupted.SIGTERM_STATUS if what == "SIGTERM" else Interrupted.EXIT_STATUS
        if self.command != "fit":
            return Interrupted(f"interrupted ({what})", status=status)
        if resume is None or not resume.dirpath:
            return Interrupted(f"interrupted ({what}) at training step {trainer.global_step}", status=status)
        last = resume.last_path
        if trainer.state.fn == "test":
            where = f"interrupted ({what}) while testing, after all {trainer.global_step} training steps"
        else:
            where = f"interrupted ({what}) at training step {trainer.global_step}"
        if resume.interrupted_at is not None:
            return Interrupted(f"{where}; {last} holds that step", resumable=True, status=status)
        if last.is_file():
            step = load_checkpoint(str(last)).get("global_step")
            return Interrupted(
                f"{where}; {last} holds step {step}, the last one saved", resumable=True, status=status
            )
        return Interrupted(f"{where}, before the first checkpoint: nothing to resume", status=status)

    def after_fit(self) -> None:
        trainer = self.trainer
        if trainer.fast_dev_run or trainer.interrupted:
            return
        if trainer.global_step == 0:
            raise UserError(
                "the run trained 0 steps (no training batch was drawn), so it is not finished and was not "
                "tested; check --data.batch_size, --trainer.limit_train_batches, --trainer.max_epochs and "
                "--trainer.max_time"
            )
        if self._folder is not None and (self._folder.path / run_dir.METRICS_FILE).is_file():
            # Training ended normally: how an earlier attempt ended no longer applies.
            run_dir.update_metrics(self._folder.path, drop=END_OF_RUN_KEYS)
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


class ParseOnly(LraCLI):
    """Parses and checks a command line as ``fit``/``validate``/``test`` would, and builds nothing:
    ``config`` and ``resolved_config_text`` are what the command would resolve. ``instantiate_classes``
    builds nothing; the global RNG and the seed are left alone."""

    def __init__(self, command: str, args: list[str], prog: str | None = None) -> None:
        saved_env = {k: os.environ.get(k) for k in SEED_ENV}
        seed_log = logging.getLogger("lightning.fabric.utilities.seed")  # its "Seed set to N" line
        level = seed_log.level
        seed_log.setLevel(logging.WARNING)
        try:
            with isolate_rng():  # LightningCLI seeds the global RNG after parsing
                super().__init__(command, args=args, prog=prog)
        finally:
            seed_log.setLevel(level)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        self._parsed_seed = self.config["seed_everything"]

    def instantiate_classes(self) -> None:
        # The seed as parsed (``true`` stays true: LightningCLI drew a random one for the run it skips).
        self.config["seed_everything"] = self._parsed_seed


def parse_only(argv: list[str], errors_for: str | None = None) -> ParseOnly:
    """``argv`` (``[command, options...]``, shortcuts allowed) parsed and checked; a parse error is one
    line pointing at the help of ``errors_for`` (default: the command)."""
    from jsonargparse import ArgumentError

    command, *options = expand_shortcuts(argv)
    try:
        return ParseOnly(command, args=options, prog=f"{prog()} {command}")
    except ArgumentError as e:
        raise UserError(parse_error_message(e, errors_for or argv[0])) from None
