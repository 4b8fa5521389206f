"""Test-only callbacks that simulate failures inside a real ``fit`` subprocess.

Passed on the command line as ``--trainer.callbacks+=crash_hooks.KillAtStep`` with ``tests/`` on
PYTHONPATH; the library never imports this module.
"""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import torch


class KillAtStep(pl.Callback):
    """SIGKILL the process during training step ``step + 1``: after the checkpoint of step ``step``
    is on disk and after that step's forward/backward ran, before its optimizer update."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class PoisonAtStep(pl.Callback):
    """At training step ``step + 1``, make the loss NaN (``target="loss"``: a NaN parameter) or
    only one gradient Inf (``target="grad"``: the loss stays finite)."""

    def __init__(self, step: int, target: str = "loss") -> None:
        self.step, self.target = step, target

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.global_step == self.step and self.target == "loss":
            with torch.no_grad():
                pl_module.net.head[0].weight[0, 0] = float("nan")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step and self.target == "grad":
            pl_module.net.head[-1].bias.grad[0] = float("inf")


class SigintAtStep(pl.Callback):
    """Send SIGINT (Ctrl-C) to this process during training step ``step + 1``, after its backward and
    before its optimizer update, as a user pressing Ctrl-C mid-step would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


class SigtermAtStep(pl.Callback):
    """Send SIGTERM (a scheduler's preemption) to this process during training step ``step + 1``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class KillDuringValidation(pl.Callback):
    """SIGKILL the process during the validation after training step ``step``, after its first batch."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGKILL)


class KillDuringSave(pl.Callback):
    """SIGKILL while the first file named ``name`` (a prefix: ``last.ckpt``, ``best-``,
    ``metrics.json``) written after training step ``step`` is half written: its temporary file holds
    half the bytes, the rename has not happened."""

    def __init__(self, step: int, name: str = "last.ckpt") -> None:
        self.step, self.name = step, name

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step != self.step:
            return
        from pathlib import Path

        import lra_cond.run_dir as run_dir

        def half_then_kill(path: object, data: bytes) -> None:
            target = Path(str(path))
            if target.name.startswith(self.name):
                target.with_name(f".{target.name}.{os.getpid()}.part").write_bytes(data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            real(path, data)

        real = run_dir.write_atomic
        run_dir.write_atomic = half_then_kill


class KillDuringTest(pl.Callback):
    """SIGKILL the process during the test pass that follows training, after its first batch."""

    def on_test_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)
