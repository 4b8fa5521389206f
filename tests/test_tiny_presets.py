"""Every task's tiny preset trains with the task's command as written, nothing else added: the
warm-up follows the short ``max_steps`` and the batch fits the tiny split."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_cli

from lra_cond.data.tasks import TASKS
from lra_cond.training.arguments import CONFIG_DIR, scaled_warmup


@pytest.mark.parametrize("task", TASKS.names())
def test_tiny_preset_of_every_task_trains_as_written(task, tmp_path):
    args = ["fit", "--task", task, "--data.preset", "tiny", "--trainer.max_steps", "3"]
    proc = run_cli(args, tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / f"{task}-tiny" / "softmax" / "default" / "seed0"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["total_steps"] == 3 and metrics["test_acc"] is not None
    config = yaml.safe_load((run / "config.yaml").read_text())
    task_config = yaml.safe_load((CONFIG_DIR / f"{task}.yaml").read_text())
    assert config["data"]["batch_size"] == (
        TASKS.get(task).tiny_batch_size or task_config["data"]["batch_size"]
    )
    warmup, note = scaled_warmup(CONFIG_DIR / f"{task}.yaml", args[1:])
    assert config["model"]["warmup_steps"] == warmup and note in proc.stderr
