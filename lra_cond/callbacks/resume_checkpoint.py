"""``checkpoints/last.ckpt`` on a step cadence, for ``--ckpt_path last`` after a crash.

Kept apart from the best-by-validation ModelCheckpoint: in Lightning 2.6 a monitoring
ModelCheckpoint rewrites ``last.ckpt`` only when the monitored metric improved, and one that also
saved every N steps would rank step-time saves by a stale ``val/acc``.

When a checkpoint step is also a validation step, ``last.ckpt`` is written only after the
validation. A file saved before it would make a resume skip that validation (Lightning counts it as
done) if the process died during it, losing its entry in the validation history and its chance to
be the best; without it, a resume repeats the steps since the previous checkpoint and the
validation, and ends as the uninterrupted run did.
Files are written atomically (``checkpoints.AtomicCheckpointIO``), so a kill during a save leaves the
previous one intact.

A run folder that was moved (another ``--run_root``) is resumed in its new place: before any
callback state is loaded, the checkpoint's paths are pointed at this folder, so the best checkpoint
and its score survive the move.

Ctrl-C (SIGINT), or a scheduler's SIGTERM (preemption), during training stops at the end of the
current training step with ``last.ckpt`` saved at that step (after that step's validation, when one
is due, as above), then raises ``KeyboardInterrupt`` (its text: the signal) for Lightning's graceful
shutdown; ``--ckpt_path last`` continues from there, exactly as from a checkpoint of the regular
cadence. A second signal stops at once (``last.ckpt`` then stays at the previous save).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from rich.console import Console

from lra_cond.checkpoints import relocate_callback_paths

SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}  # what stops a run gracefully


class ResumeCheckpoint(ModelCheckpoint):
    def __init__(self, every_n_train_steps: int) -> None:
        # Lightning's saving is off (no top-k, no last): this callback writes last.ckpt itself, at the
        # cadence, after a due validation, on a signal and at the end (the ModelCheckpoint base gives
        # the folder, resolved as Lightning resolves it).
        super().__init__(every_n_train_steps=every_n_train_steps, save_top_k=0, save_last=False)
        self.every = every_n_train_steps
        self._saved_at: int | None = None  # the step last.ckpt was last written at by this process
        self.interrupt_requested = False
        self.signal_name = ""  # "Ctrl-C" or "SIGTERM": what asked to stop
        self.interrupted_at: int | None = None  # the step last.ckpt was saved at after a signal
        self._previous_handlers: dict[int, Any] = {}

    @property
    def last_path(self) -> Path:
        return Path(self.dirpath or ".") / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"

    # --- Ctrl-C and SIGTERM: stop at the end of the step, with last.ckpt at that step ----------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.interrupt_requested = True
        self.signal_name = SIGNALS[signum]
        self._restore_handlers()  # a second signal stops at once
        Console(stderr=True, soft_wrap=True, highlight=False).print(
            f"interrupted ({self.signal_name}): stopping after this training step, with {self.last_path} "
            "saved at it (again to stop at once, without saving)"
        )

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def _interrupt(self) -> KeyboardInterrupt:
        return KeyboardInterrupt(self.signal_name)

    def _save(self, trainer: pl.Trainer) -> None:
        self.last_model_path = str(self.last_path)  # ModelCheckpoint's record (the NaN guard reads it)
        trainer.save_checkpoint(self.last_path)
        self._saved_at = trainer.global_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # From the main thread (signal handlers live there). SIGINT only over Python's own handler;
        # SIGTERM over Lightning's too, which would end the run without a checkpoint at its step.
        if not self.dirpath or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        self._previous_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()
        if self.dirpath and not trainer.fast_dev_run and self._saved_at != trainer.global_step:
            self._save(trainer)  # the end of training

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore_handlers()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The cadence's save, unless a validation follows: then on_validation_end saves (module doc).
        step = trainer.global_step
        validation = _validation_follows(trainer)
        if self.dirpath and step > 0 and step % self.every == 0 and not validation:
            self._save(trainer)
        if self.interrupted_at is not None:
            return
        if trainer.world_size > 1:  # every process stops at the same step (one saw the signal first)
            self.interrupt_requested = trainer.strategy.reduce_boolean_decision(
                self.interrupt_requested, all=False
            )
        if not self.interrupt_requested:
            return
        self.interrupted_at = step
        if not validation:
            if self._saved_at != step:
                self._save(trainer)
            raise self._interrupt()
        # A validation is due at this step: it runs first, and on_validation_end saves and raises.

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or trainer.fast_dev_run or not self.dirpath:
            return
        requested = self.interrupt_requested
        if trainer.world_size > 1 and self.interrupted_at is None:
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if requested and self.interrupted_at is None:  # Ctrl-C during this validation
            self.interrupt_requested, self.interrupted_at = True, trainer.global_step
        interrupted = self.interrupted_at is not None and self.interrupted_at == trainer.global_step
        if trainer.global_step > 0 and (trainer.global_step % self.every == 0 or interrupted):
            self._save(trainer)
        if interrupted:
            raise self._interrupt()

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Every callback's on_load_checkpoint runs before any callback's load_state_dict.
        if self.dirpath:
            relocate_callback_paths(checkpoint, self.dirpath)


def _validation_follows(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates right after this training batch (asked from on_train_batch_end).

    A checkpoint saved before a due validation would make a resume skip it (see the module doc).
    Lightning decides in its training loop (``_should_check_val_fx``, private, and no hook says it
    beforehand); this is the same rule from the trainer's public state. Not covered: a time-based
    ``val_check_interval`` (it depends on a private clock; fit refuses one) and a ``training_step``
    that takes the ``dataloader_iter`` (LraModel's does not). tests/test_resume_checkpoint.py checks
    it against the validations Lightning runs, on every cadence fit accepts.
    """
    if not trainer.enable_validation:
        return False
    every = trainer.check_val_every_n_epoch
    if every is not None and (trainer.current_epoch + 1) % every != 0:
        return False
    loop = trainer.fit_loop.epoch_loop
    last_batch = loop.batch_progress.is_last_batch
    per = trainer.val_check_batch  # batches between validations; inf when the epoch's length is unknown
    unsized = per == float("inf")
    if last_batch and unsized:
        return True
    if trainer.should_stop and _can_stop(trainer):
        return True  # a stop request (a target reached, early stopping) validates first
    if per is None:  # a time-based val_check_interval: not known from outside the loop
        return False
    if isinstance(trainer.limit_train_batches, int) and unsized:
        return (loop.batch_idx + 1) % trainer.limit_train_batches == 0
    if not unsized:
        index = loop.total_batch_idx if every is None else loop.batch_idx
        return (index + 1) % per == 0
    return last_batch


def _can_stop(trainer: pl.Trainer) -> bool:
    """Whether ``trainer.should_stop`` ends training now: ``min_epochs`` and ``min_steps`` are met."""
    fit_loop = trainer.fit_loop
    epochs, steps = fit_loop.min_epochs, fit_loop.min_steps
    met_epochs = fit_loop.epoch_progress.current.processed >= epochs if epochs else True
    met_steps = trainer.global_step >= steps if steps else True
    return met_epochs and met_steps
