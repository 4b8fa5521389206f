"""Every attention family x {default, conditioned} init trains through the CLI on tiny ListOps."""

from __future__ import annotations

import json

import pytest

from lra_cond.models.attention import ATTENTIONS
from tests.conftest import TINY_FIT, assert_one_line_error, run_cli

# Tiny ListOps sequences are 20..200 tokens, so Nyström gets fewer than its default 64 landmarks.
ATTENTION_ARGS = {"nystrom": '{"num_landmarks": 16}'}
# One torch thread: on a shared 2-core machine the default two threads make each run ~2.5x slower.
# Most of a run's ~7 s of CPU is imports; one val/test batch and no sanity check trim the rest.
FAST = "--trainer.limit_val_batches 1 --trainer.limit_test_batches 1 --trainer.num_sanity_val_steps 0".split()


@pytest.mark.parametrize("init", ["default", "conditioned"])
@pytest.mark.parametrize("attention", ATTENTIONS.names())
def test_tiny_fit(attention, init, tiny_listops, tmp_path):
    args = ["fit", "--task", "listops", "--attention", attention, "--init", init, *TINY_FIT, *FAST]
    if attention in ATTENTION_ARGS:
        args += ["--model.attention_args", ATTENTION_ARGS[attention]]
    result = run_cli(args, tmp_path, env={"LRA_DATA": str(tiny_listops)})
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "listops-tiny" / attention / init / "seed0"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["total_steps"] == 8
    assert [step for step, _ in metrics["val_history"]] == [4, 8]
    assert 0.0 <= metrics["best_val_acc"] <= 1.0
    assert 0.0 <= metrics["test_acc"] <= 1.0
    config = (run_dir / "config.yaml").read_text()
    assert f"attention: {attention}" in config and f"init: {init}" in config


def test_too_many_landmarks_is_a_one_line_error(tiny_listops, tmp_path):
    args = ["fit", "--task", "listops", "--attention", "nystrom", *TINY_FIT, *FAST]
    args += ["--model.attention_args", '{"num_landmarks": 4000}']
    result = run_cli(args, tmp_path, env={"LRA_DATA": str(tiny_listops)})
    assert_one_line_error(
        result, "nystrom attention: num_landmarks=4000 exceeds the model's maximum sequence length 2000"
    )
