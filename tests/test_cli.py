"""The CLI end to end on tiny ListOps: run folder contents, best-checkpoint testing, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_FIT, assert_one_line_error, run_cli

RUN = Path("runs/listops-tiny/softmax/conditioned/seed0")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tiny_listops) -> Path:
    """One tiny fit through the CLI; returns its working directory."""
    cwd = tmp_path_factory.mktemp("fit")
    shutil.copytree(tiny_listops, cwd / "data")
    args = ["fit", "--task", "listops", "--init", "conditioned", *TINY_FIT, "--model.lr", "1e-3"]
    proc = run_cli(args, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cwd / "fit.out").write_text(proc.stdout + proc.stderr)
    return cwd


def test_console_shows_the_run_without_third_party_noise(fitted):
    """Lightning's cloud-logger advertisement and its pytree deprecation warning are dropped; its
    other messages (which device it uses) and the run's own output stay."""
    out = (fitted / "fit.out").read_text()
    assert "litlogger" not in out and "Tip:" not in out
    assert "GPU available" in out and "test/acc" in out
    args = ["validate", "--task", "listops", *TINY_FIT, "--init", "conditioned", "--model.lr", "1e-3"]
    proc = run_cli([*args, "--ckpt_path", "last"], fitted)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val/acc" in proc.stdout
    assert "LeafSpec" not in proc.stdout + proc.stderr and "deprecated" not in proc.stderr


def test_fit_writes_run_folder(fitted):
    run = fitted / RUN
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["total_steps"] == 8
    assert [step for step, _ in metrics["val_history"]] == [4, 8]
    best_step, best_acc = max(metrics["val_history"], key=lambda h: h[1])
    assert metrics["best_val_acc"] == pytest.approx(best_acc) and 0 <= best_acc <= 1
    assert metrics["best_val_step"] == best_step
    assert metrics["total_epochs"] == pytest.approx(8 / (512 // 32))
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["init"] == "conditioned" and config["data"]["preset"] == "tiny"
    ckpts = {p.name for p in (run / "checkpoints").iterdir()}
    assert "last.ckpt" in ckpts and f"best-step{best_step}.ckpt" in ckpts


def test_tensorboard_has_training_curves(fitted):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in (fitted / RUN).glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"train/loss", "val/acc", "test/acc", "lr-AdamW"} <= tags


def test_test_accuracy_is_that_of_the_best_checkpoint(fitted, tiny_listops):
    """Recompute test accuracy of the best checkpoint here and compare with metrics.json."""
    from lra_cond.data import LraDataModule
    from lra_cond.training.module import LraModel

    metrics = json.loads((fitted / RUN / "metrics.json").read_text())
    best = fitted / RUN / "checkpoints" / f"best-step{metrics['best_val_step']}.ckpt"
    assert Path(metrics["test_ckpt"]).name == best.name
    model = LraModel.load_from_checkpoint(best).eval()
    dm = LraDataModule("listops", data_dir=str(tiny_listops), preset="tiny", batch_size=32)
    dm.setup()
    correct = total = 0
    with torch.no_grad():
        for batch in dm.test_dataloader():
            correct += (model(batch).argmax(-1) == batch["label"]).sum().item()
            total += len(batch["label"])
    assert metrics["test_acc"] == pytest.approx(correct / total, abs=1e-6)
    # What the results need besides: the splits' label counts, the fit's seconds, its machine.
    for split in ("val", "test"):
        labels = torch.tensor(dm.splits[split]["label"])
        assert metrics["label_counts"][split] == torch.bincount(labels, minlength=10).tolist()
    assert 0 < metrics["seconds"] < 3600
    assert len(metrics["machines"]) == 1 and f"torch {torch.__version__}" in metrics["machines"][0]


def test_data_dir_that_cannot_hold_data_is_one_line_error(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("keep me")
    proc = run_cli(["fit", "--task", "listops", *TINY_FIT, "--data.data_dir", str(blocker)], tmp_path)
    assert_one_line_error(proc, f"data dir {blocker} is not a directory")
    assert blocker.read_text() == "keep me"


def test_print_config_shows_resolved_settings(tmp_path):
    proc = run_cli(["fit", "--task", "listops", "--init", "conditioned", "--print_config"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    assert config["model"]["init"] == "conditioned"
    assert config["trainer"]["max_steps"] == 5000 and config["data"]["batch_size"] == 32
    assert config["model"]["warmup_steps"] == 1000 and config["model"]["eps"] == 1e-6
    assert not (tmp_path / "runs").exists()


def test_prepare_command_builds_cache(tmp_path):
    proc = run_cli(["prepare", "--task", "listops", "--preset", "tiny", "--data-dir", "d"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "d/listops/tiny/prepared/manifest.json").read_text())
    assert manifest["sizes"] == {"train": 512, "val": 128, "test": 128}
    assert manifest["seed"] == 0 and manifest["source"] == "generated"


def test_console_main_freezes_the_collector_after_main_even_on_error(monkeypatch):
    """``python -m lra_cond`` freezes the garbage collector once the command is done (a quick
    interpreter shutdown), also when it exits with an error; ``main`` itself (in-process callers)
    leaves the collector alone."""
    import gc

    from lra_cond import cli

    calls = []

    def failing_main() -> None:
        calls.append(gc.get_freeze_count())
        raise SystemExit(2)

    gc.unfreeze()
    monkeypatch.setattr(cli, "main", failing_main)
    try:
        with pytest.raises(SystemExit):
            cli.console_main()
        assert calls == [0]  # not frozen while the command runs
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
