"""NaN/Inf guard: a non-finite loss or gradient stops training before the weights change; the
checkpoints already written stay as they were; the CLI prints one line naming the step and the last
good checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import REPO, TINY_FIT, assert_one_line_error, run_cli
from crash_hooks import PoisonAtStep
from lightning.pytorch.loggers import TensorBoardLogger

from lra_cond.callbacks.finite_guard import FiniteGuard, NonFiniteError
from lra_cond.callbacks.resume_checkpoint import ResumeCheckpoint
from lra_cond.data import LraDataModule
from lra_cond.training.module import LraModel


def tiny_fit(root: Path, data: Path, callbacks: list[pl.Callback], steps: int = 6) -> pl.Trainer:
    pl.seed_everything(0)
    model = LraModel(dim=32, num_heads=2, mlp_dim=32, depth=1, lr=1e-3, warmup_steps=2, max_len=200)
    dm = LraDataModule("listops", data_dir=str(data), preset="tiny", batch_size=16)
    trainer = pl.Trainer(
        max_steps=steps,
        logger=TensorBoardLogger(root, name="run", version="seed0"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm)
    return trainer


@pytest.mark.parametrize("target, what", [("loss", "non-finite loss (nan)"), ("grad", "non-finite gradient")])
def test_guard_stops_before_the_update_and_keeps_checkpoints(tmp_path, tiny_listops, target, what):
    guard, every_step = FiniteGuard(), ResumeCheckpoint(every_n_train_steps=1)
    with pytest.raises(NonFiniteError) as e:
        tiny_fit(tmp_path, tiny_listops, [PoisonAtStep(4, target), guard, every_step])
    last = tmp_path / "run/seed0/checkpoints/last.ckpt"
    message = str(e.value)
    assert message.startswith(f"{what}") and " at training step 5;" in message
    assert f"last good checkpoint: {last} (step 4), untouched" in message
    # Without the guard, step 5 would have updated the weights with NaN and saved them here.
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(t).all() for t in ckpt["state_dict"].values())
    metrics = json.loads((tmp_path / "run/seed0/metrics.json").read_text())
    assert metrics["stopped"].startswith(what) and metrics["stopped"].endswith("at step 5")


def test_guard_passes_a_clean_run(tmp_path, tiny_listops):
    trainer = tiny_fit(tmp_path, tiny_listops, [FiniteGuard()], steps=3)
    assert trainer.global_step == 3


def test_cli_reports_non_finite_loss_as_one_line(tmp_path, tiny_listops):
    shutil.copytree(tiny_listops, tmp_path / "data")
    hook = ["--trainer.callbacks+=crash_hooks.PoisonAtStep", "--trainer.callbacks.step", "5"]
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    args = ["fit", "--task", "listops", *TINY_FIT, "--checkpoint_every", "2", *hook]
    proc = run_cli(args, tmp_path, env=env)
    last = Path("runs/listops-tiny/softmax/default/seed0/checkpoints/last.ckpt")
    assert_one_line_error(proc, "non-finite loss (nan) at training step 6;")
    assert f"last good checkpoint: {last} (step 4), untouched" in proc.stderr
    assert torch.load(tmp_path / last, map_location="cpu", weights_only=False)["global_step"] == 4
