"""ConditionNumberMonitor through a tiny CLI fit; EpochsToTarget on scripted validation accuracies."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_FIT, TINY_TRAINING, run_cli
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lra_cond.callbacks import EpochsToTarget
from lra_cond.callbacks.condition_monitor import DEFAULT_EVERY_N_STEPS
from lra_cond.errors import UserError
from lra_cond.run_dir import update_metrics


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_monitor_in_tiny_fit(tiny_listops: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_listops, tmp_path / "data")
    args = ["fit", "--task", "listops", *TINY_FIT, "--model.dim", "16", "--model.mlp_dim", "32"]
    args += ["--cond.every_n_steps", "4", "--cond.method", "dense", "--cond.probe_tokens", "64"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A status line before and after every probe (the progress bar stands still meanwhile).
    for step in (0, 4, 8):
        what = f"the condition number of 2 attention layers at step {step}"
        assert f"measuring {what} (probe 64 tokens, dense)..." in proc.stderr
        assert re.search(rf"measured {what} in \d+\.\d s", proc.stderr)
    run = tmp_path / "runs/listops-tiny/softmax/default/seed0"
    tags = scalars(run)
    for i in (0, 1):
        for name in ("kappa", "kappa_q", "kappa_k", "kappa_v", "kappa_x"):
            assert [s for s, _ in tags[f"cond/{name}/layer{i}"]] == [0, 4, 8]
            for (s1, v), (s2, lv) in zip(tags[f"cond/{name}/layer{i}"], tags[f"cond/log10_{name}/layer{i}"]):
                assert s1 == s2 and lv == pytest.approx(math.log10(v), rel=1e-6)
        assert f"cond/weights/q/layer{i}" in tags and f"cond_diag/weights/v_head1/layer{i}" in tags
        assert f"cond_diag/n_null/layer{i}" in tags
        assert [s for s, _ in tags[f"cond_diag/cut_separation/layer{i}"]] == [0, 4, 8]
    assert not any(t.startswith("cond/n_null") or t == "cond/seconds" for t in tags)  # diagnostics apart
    mean = [(s, v) for s, v in tags["cond/kappa/mean"]]
    history = json.loads((run / "metrics.json").read_text())["cond_history"]
    assert [h["step"] for h in history] == [0, 4, 8]
    for (step, value), h in zip(mean, history):
        kappas = [layer["kappa"] for layer in h["layers"]]
        assert step == h["step"] and value == pytest.approx(sum(kappas) / 2, rel=1e-6)
        assert all(k > 1 for k in kappas)
        assert all(layer["kappa_x"] > 1 and layer["n_null_x"] == 1 for layer in h["layers"])  # [X, 1]
        # exact nulls at float64's floor, many decades under the smallest kept value: a clear cut
        assert all(layer["cut_separated"] and layer["cut_separation"] > 3 for layer in h["layers"])
    # Theory, during training (2 heads of d_h = 8, q/k/v biases, LayerNorm-ed inputs): gauge 2*64, the
    # input null direction [1/gamma, -c] in each of Q, K, V (3*2*8) and the key shift along the bias
    # column (2*8), whatever the LayerNorm bias: the same exact count at every probe, all verified.
    for h in history:
        assert [layer["n_null"] for layer in h["layers"]] == [192, 192]
        assert [layer["n_null_expected"] for layer in h["layers"]] == [192, 192]


@pytest.mark.parametrize("family", ["softmax", "nystrom", "normalized", "linear"])
def test_every_probe_of_a_tiny_fit_is_explained(family: str, tiny_listops: Path, tmp_path: Path) -> None:
    """100 steps at lr 1e-3 (LayerNorm biases and weights move): at every probe each layer's null
    count is the verified analytic one, so no probe took the svdvals fallback."""
    shutil.copytree(tiny_listops, tmp_path / "data")
    args = ["fit", "--task", "listops", "--attention", family, *TINY_TRAINING, "--model.dim", "16"]
    args += ["--model.mlp_dim", "32", "--trainer.max_steps", "100", "--trainer.val_check_interval", "50"]
    args += ["--model.lr", "1e-3", "--model.warmup_steps", "10", "--cond.every_n_steps", "50"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = next((tmp_path / "runs").glob("listops*/*/default/*"))
    history = json.loads((run / "metrics.json").read_text())["cond_history"]
    assert [h["step"] for h in history] == [0, 50, 100]
    for h in history:
        for layer in h["layers"]:
            assert layer["n_null"] == layer["n_null_expected"], (h["step"], layer["notes"])
            assert not any("svdvals" in n for n in layer["notes"])


def test_monitor_settings_are_in_the_config(tmp_path: Path) -> None:
    """On by default at the documented cadence, with the exact fast method; flags change it."""
    proc = run_cli(["fit", "--task", "listops", "--print_config"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    default = f"cond:\n  every_n_steps: {DEFAULT_EVERY_N_STEPS}\n  method: gram\n  probe_tokens: 256"
    assert default in proc.stdout
    assert DEFAULT_EVERY_N_STEPS > 0
    proc = run_cli(["fit", "--task", "listops", "--cond.every_n_steps", "0", "--print_config"], tmp_path)
    assert "cond:\n  every_n_steps: 0\n  method: gram" in proc.stdout
    assert "target:\n  acc: null" in proc.stdout


def test_default_fit_measures_at_start_and_end(tiny_listops: Path, tmp_path: Path) -> None:
    """No cond flags at all: the default monitor measures before the first update and at the end."""
    shutil.copytree(tiny_listops, tmp_path / "data")
    args = ["fit", "--task", "listops", *TINY_TRAINING, "--model.dim", "16", "--model.mlp_dim", "32"]
    assert not any(a.startswith("--cond") for a in args)
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs/listops-tiny/softmax/default/seed0"
    metrics = json.loads((run / "metrics.json").read_text())
    assert [h["step"] for h in metrics["cond_history"]] == [0, 8]
    assert metrics["cond_settings"]["method"] == "gram"
    assert "b_Q" in metrics["cond_settings"]["definition"]
    assert all(layer["kappa"] > 1 for h in metrics["cond_history"] for layer in h["layers"])
    assert [s for s, _ in scalars(run)["cond/kappa/mean"]] == [0, 8]


class Scripted(pl.LightningModule):
    """Logs a scripted val/acc at each validation (10 training batches per epoch)."""

    def __init__(self, accs: list[float]) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.accs = accs
        self.calls = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        self.log("val/acc", self.accs[self.calls])
        self.calls += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_scripted(tmp_path: Path, accs: list[float], callback: EpochsToTarget, max_steps: int = 30) -> Path:
    data = DataLoader(TensorDataset(torch.randn(10, 2)), batch_size=1)
    logger = TensorBoardLogger(tmp_path, name="run", version="v", default_hp_metric=False)
    trainer = pl.Trainer(
        max_steps=max_steps,
        val_check_interval=3,  # validations after steps 3, 6, 9, then 13, 16, 19 (10 batches/epoch)
        num_sanity_val_steps=0,
        logger=logger,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Scripted(accs), data, data)
    return Path(trainer.log_dir)


ACCS = [0.1, 0.3, 0.5, 0.4, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9]


def test_epochs_to_target_records_first_crossing(tmp_path: Path) -> None:
    run = fit_scripted(tmp_path, ACCS, EpochsToTarget(acc=0.55))
    m = json.loads((run / "metrics.json").read_text())
    # 0.1 (step 3), 0.3 (6), 0.5 (9), 0.4 (13), 0.6 (16): first >= 0.55 at step 16, epoch 1.6.
    assert (m["steps_to_target"], m["target_acc"]) == (16, 0.55)
    assert m["target_reached_acc"] == pytest.approx(0.6)
    assert m["epochs_to_target"] == pytest.approx(1.6)
    tags = scalars(run)
    assert tags["target/steps_to_target"] == [(16, 16.0)]  # logged at the step it was reached
    assert tags["target/epochs_to_target"][0][1] == pytest.approx(1.6)


def test_epochs_to_target_stop_and_from_run(tmp_path: Path) -> None:
    update_metrics(tmp_path / "baseline", best_val_acc=0.5)
    cb = EpochsToTarget(from_run=str(tmp_path / "baseline"), stop=True)
    run = fit_scripted(tmp_path / "b", ACCS, cb)
    m = json.loads((run / "metrics.json").read_text())
    assert (m["steps_to_target"], m["target_acc"]) == (9, 0.5)
    assert m["epochs_to_target"] == pytest.approx(0.9)
    assert cb.state_dict()["step"] == 9  # stopped at the crossing: no later validation ran
    restored = EpochsToTarget(acc=0.5)
    restored.load_state_dict(cb.state_dict())
    assert (restored.step, restored.epoch, restored.target) == (9, cb.epoch, 0.5)


def test_epochs_to_target_unreached_and_bad_input(tmp_path: Path) -> None:
    run = fit_scripted(tmp_path, ACCS, EpochsToTarget(acc=0.95), max_steps=12)
    m = json.loads((run / "metrics.json").read_text())
    assert m["steps_to_target"] is None and m["target_acc"] == 0.95
    with pytest.raises(UserError, match="fraction"):
        EpochsToTarget(acc=55)
    with pytest.raises(UserError, match="no best_val_acc"):
        fit_scripted(tmp_path / "c", ACCS, EpochsToTarget(from_run=str(tmp_path / "missing")))
