"""CLI smoke tests for text/retrieval/image: prepare the tiny split from its fixture, then a tiny fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_FIT, assert_one_line_error, run_cli

FIT = [*TINY_FIT, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--data.batch_size", "4"]


@pytest.mark.parametrize("task", ["text", "retrieval", "image"])
def test_prepare_tiny_then_fit(tmp_path: Path, task: str) -> None:
    prep = run_cli(["prepare", "--task", task, "--preset", "tiny"], tmp_path)
    assert prep.returncode == 0, prep.stderr
    manifest = json.loads((tmp_path / "data" / task / "tiny" / "prepared" / "manifest.json").read_text())
    assert manifest["source"] == "fixture" and manifest["task"] == task
    fit = run_cli(["fit", "--task", task, "--attention", "softmax", "--init", "conditioned", *FIT], tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    metrics = json.loads(
        (
            tmp_path / "runs" / f"{task}-tiny" / "softmax" / "conditioned" / "seed0" / "metrics.json"
        ).read_text()
    )
    assert metrics["total_steps"] == 4
    assert [step for step, _ in metrics["val_history"]] == [2, 4]
    assert 0.0 <= metrics["test_acc"] <= 1.0


def test_full_preset_without_source_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lra_cond.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "--task", "retrieval", "--data-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "lra_release.gz" in err and "--source" in err
    # Text tries the hub; offline (as in CI) that fails fast and must say how to get the data instead.
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    assert_one_line_error(run_cli(["prepare", "--task", "text"], tmp_path, env=env), "--source")
    assert not (tmp_path / "data" / "text" / "full" / "prepared").exists()
