"""Stops training at the first non-finite loss or gradient, before the weights are updated.

The check runs before ``backward`` (loss) and before the optimizer step (gradients), so the NaN
never reaches the weights and no checkpoint of poisoned weights is written; the checkpoints
already on disk stay as they were. The error names the step and the last good checkpoint, and
``metrics.json`` records where the run stopped.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch

from lra_cond.errors import UserError
from lra_cond.run_dir import run_dir_of, update_metrics


class NonFiniteError(UserError):
    """Training produced NaN/Inf; raised so the CLI prints one line and exits non-zero."""


def last_good_checkpoint(trainer: pl.Trainer) -> tuple[Path, int] | None:
    """The newest checkpoint any ModelCheckpoint of ``trainer`` wrote, with its global step."""
    paths = set()
    for cb in trainer.checkpoint_callbacks:
        paths |= {getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")}
    existing = [Path(p) for p in paths if p and Path(p).is_file()]
    if not existing:
        return None
    newest = max(existing, key=lambda p: p.stat().st_mtime_ns)
    step = torch.load(newest, map_location="cpu", weights_only=False).get("global_step", -1)
    return newest, int(step)


class FiniteGuard(pl.Callback):
    """One device sync per optimizer step: all gradients (a NaN loss makes them NaN too) at once."""

    def __init__(self) -> None:
        self._loss: torch.Tensor | None = None

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._loss = loss.detach()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        loss, self._loss = self._loss, None
        grads = {n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None}
        checks = [g.isfinite().all() for g in grads.values()]
        if loss is not None:
            checks.append(loss.isfinite().all())
        if not checks or bool(torch.stack(checks).all()):
            return
        if loss is not None and not loss.isfinite().all():
            self._stop(trainer, f"non-finite loss ({loss.float().item():g})")
        fp16 = "16" in str(trainer.precision) and "bf16" not in str(trainer.precision)
        if fp16:
            return  # fp16 loss scaling skips steps with Inf gradients by design
        bad = [n for n, g in grads.items() if not g.isfinite().all()]
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        self._stop(trainer, f"non-finite gradient of {bad[0]}{more}")

    def _stop(self, trainer: pl.Trainer, what: str) -> None:
        step = trainer.global_step + 1  # the step being computed; global_step counts finished ones
        good = last_good_checkpoint(trainer)
        if good is None:
            where = "no checkpoint was written before it"
        else:
            where = f"last good checkpoint: {good[0]} (step {good[1]}), untouched"
        if trainer.is_global_zero and run_dir_of(trainer):
            update_metrics(run_dir_of(trainer), stopped=f"{what} at step {step}")
        raise NonFiniteError(
            f"{what} at training step {step}; stopped before updating the weights; {where}. "
            "Lower --model.lr (or raise --model.warmup_steps) and start a new run (another --run_root, "
            "or move this run's folder away)"
        )
