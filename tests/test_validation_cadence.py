"""ListOps validates every 50 steps (the reference's eval_frequency), and steps-to-target, read post
hoc from a run's validation history, has that resolution: a scripted run through a real Trainer at
the config's cadence, its metrics.json written by RunSummary, and the report's computation."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lra_cond.callbacks import RunSummary
from lra_cond.report.collect import Run
from lra_cond.report.table import build_rows
from lra_cond.run_dir import read_metrics
from lra_cond.training.arguments import CONFIG_DIR
from lra_cond.training.compare import resolved_config

# One accuracy per validation; the target 0.38 is first reached at the third one.
ACCS = [0.10, 0.20, 0.40, 0.35, 0.50, 0.60]
TARGET = 0.38


class Scripted(pl.LightningModule):
    """Trains a trivial layer and logs the next scripted ``val/acc`` at each validation."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.calls = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        self.log("val/acc", ACCS[self.calls])
        self.calls += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_listops_config_validates_every_50_steps() -> None:
    assert yaml.safe_load((CONFIG_DIR / "listops.yaml").read_text())["trainer"]["val_check_interval"] == 50
    config = resolved_config(["fit", "--task", "listops"])  # what a fit would save as config.yaml
    assert config["trainer"]["val_check_interval"] == 50
    assert config["trainer"]["check_val_every_n_epoch"] is None  # counted in steps, across epochs
    assert config["trainer"]["max_steps"] == 5000 and config["model"]["warmup_steps"] == 1000


def test_steps_to_target_has_the_config_cadence(tmp_path: Path) -> None:
    trainer_cfg = resolved_config(["fit", "--task", "listops"])["trainer"]
    every = trainer_cfg["val_check_interval"]
    steps = every * len(ACCS)
    trainer = pl.Trainer(
        max_steps=steps,
        val_check_interval=every,
        check_val_every_n_epoch=trainer_cfg["check_val_every_n_epoch"],
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(tmp_path, name="run", version="seed0", default_hp_metric=False),
        callbacks=[RunSummary()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(70, 2)), batch_size=1)  # 70 batches: epochs cross
    trainer.fit(Scripted(), data, data)
    metrics = read_metrics(trainer.log_dir)
    assert [s for s, _ in metrics["val_history"]] == [50, 100, 150, 200, 250, 300]

    rows = build_rows([Run("default", 0, Path(trainer.log_dir), metrics)], TARGET)
    assert rows[0].steps_per_seed == {0: 150}  # a 250-step cadence could only have said 250
    assert rows[0].epochs.mean == 150 / 70


def test_fit_that_will_not_validate_warns_up_front(tiny_listops, tmp_path):
    """val_check_interval beyond max_steps: a warning before training, not only the end's."""
    from conftest import TINY_FIT, run_cli

    args = ["fit", "--task", "listops", *TINY_FIT, "--model.dim", "16", "--model.mlp_dim", "32"]
    proc = run_cli(
        [*args, "--trainer.val_check_interval", "100"], tmp_path, env={"LRA_DATA": str(tiny_listops)}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    up_front = (
        "warning: no validation will run (trainer.val_check_interval 100 is more than trainer.max_steps 8): "
        "no best checkpoint and no steps-to-target; the final weights are tested (lower "
        "--trainer.val_check_interval)"
    )
    assert up_front in proc.stderr
    assert proc.stderr.index(up_front) < proc.stderr.index(
        "no validation ran, so there is no best checkpoint"
    )
    with_validation = run_cli([*args, "--run_root", "other"], tmp_path, env={"LRA_DATA": str(tiny_listops)})
    assert with_validation.returncode == 0 and "no validation will run" not in with_validation.stderr
