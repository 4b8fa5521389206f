"""Ctrl-C (SIGINT) or a scheduler's SIGTERM during fit finishes that step, saves ``last.ckpt`` at it
(after its validation when one is due), exits 130 (143 for SIGTERM) with one ``error:`` line saying
how to continue, and ``--ckpt_path last`` continues from there: interrupted twice, once by each
signal, the run ends bit-identical to an uninterrupted one (the resume test's protocol, with
signals instead of SIGKILL)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli, sigint_default
from test_resume import ARGS, HOOKS, RUN, assert_same, load


def sigint_at(step: int) -> list[str]:
    return ["--trainer.callbacks+=crash_hooks.SigintAtStep", "--trainer.callbacks.step", str(step)]


def sigterm_at(step: int) -> list[str]:
    return ["--trainer.callbacks+=crash_hooks.SigtermAtStep", "--trainer.callbacks.step", str(step)]


def assert_interrupted(proc, cwd: Path, root: str, step: int, what: str = "Ctrl-C") -> None:
    run = cwd / root / RUN
    last = Path(root) / RUN / "checkpoints/last.ckpt"
    assert proc.returncode == (143 if what == "SIGTERM" else 130), proc.stderr[-3000:]
    assert f"interrupted ({what}): stopping after this training step, with {last} saved at it" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [proc.stderr.strip().splitlines()[-1]] and "Traceback" not in proc.stderr
    assert errors[0].startswith(
        f"error: interrupted ({what}) at training step {step}; {last} holds that step"
    )
    command = errors[0].split("; continue with: ", 1)[1]
    assert shlex.split(command)[-2:] == ["--ckpt_path", "last"] and "--run_root" in command
    assert load(run / "checkpoints/last.ckpt")["global_step"] == step
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["total_steps"] == step and metrics["stopped"] == f"interrupted ({what}) at step {step}"
    assert "test_acc" not in metrics


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_listops) -> Path:
    cwd = tmp_path_factory.mktemp("interrupt")
    shutil.copytree(tiny_listops, cwd / "data")
    straight = run_cli([*ARGS, "--run_root", "straight"], cwd)
    assert straight.returncode == 0, straight.stderr[-3000:]

    # Ctrl-C during step 9: not a checkpoint (every 4) or validation (every 6) step.
    first = run_cli([*ARGS, "--run_root", "sigint", *sigint_at(8)], cwd, env=HOOKS)
    assert_interrupted(first, cwd, "sigint", 9)
    # A scheduler's SIGTERM during step 12, a validation step: its validation runs first and is in
    # last.ckpt; resubmitting the command with --ckpt_path last continues.
    again = run_cli([*ARGS, "--run_root", "sigint", "--ckpt_path", "last", *sigterm_at(11)], cwd, env=HOOKS)
    assert "resuming from" in again.stderr
    assert_interrupted(again, cwd, "sigint", 12, "SIGTERM")
    assert [s for s, _ in json.loads((cwd / "sigint" / RUN / "metrics.json").read_text())["val_history"]] == [
        6,
        12,
    ]

    resumed = run_cli([*ARGS, "--run_root", "sigint", "--ckpt_path", "last"], cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return cwd


def test_interrupted_run_ends_as_an_uninterrupted_one(runs):
    a = json.loads((runs / "straight" / RUN / "metrics.json").read_text())
    b = json.loads((runs / "sigint" / RUN / "metrics.json").read_text())
    assert "stopped" not in b and set(a) == set(b)  # the interrupt no longer applies
    assert [s for s, _ in b["val_history"]] == [6, 12, 18]
    for (s1, x), (s2, y) in zip(a["val_history"], b["val_history"]):
        assert s1 == s2 and x == pytest.approx(y, abs=1e-6)
    for key in ("best_val_acc", "test_acc", "total_epochs", "total_steps"):
        assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert [h["step"] for h in b["cond_history"]] == [h["step"] for h in a["cond_history"]]

    x = load(runs / "straight" / RUN / "checkpoints/last.ckpt")
    y = load(runs / "sigint" / RUN / "checkpoints/last.ckpt")
    assert x["global_step"] == y["global_step"] == 20
    assert_same(x["state_dict"], y["state_dict"], "", "", "state_dict")
    assert_same(x["optimizer_states"], y["optimizer_states"], "", "", "optimizer")
    assert_same(x["callbacks"], y["callbacks"], "straight", "sigint", "callbacks")
    assert_same(x["loops"], y["loops"], "", "", "loops")


def test_ctrl_c_of_compare_stops_its_fit_gracefully(tiny_listops, tmp_path):
    """SIGINT to compare (a Ctrl-C in its terminal) reaches its running fit once: the fit saves
    last.ckpt at its step and compare exits 130 saying how to continue."""
    args = ["compare", "--task", "listops", "--inits", "default", "--seeds", "0", "--data.preset", "tiny"]
    args += [
        "--trainer.max_steps",
        "5000",
        "--trainer.val_check_interval",
        "100",
        "--model.warmup_steps",
        "2",
    ]
    args += ["--model.dim", "16", "--model.mlp_dim", "32", "--cond.every_n_steps", "0"]
    args += ["--trainer.enable_progress_bar", "false"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "LRA_DATA": str(tiny_listops), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lra_cond", *args],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    )
    run = tmp_path / "runs/listops-tiny/softmax/default/seed0"
    deadline = time.monotonic() + 300
    while not (run / "config.yaml").is_file():  # written when training starts
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "error: interrupted (Ctrl-C) during the fit of default seed 0 "
        "(runs/listops-tiny/softmax/default/seed0); rerun compare to continue: finished runs are reused and "
        "this one resumes from its last.ckpt"
    )
    step = json.loads((run / "metrics.json").read_text())["total_steps"]
    assert 0 < step < 5000 and load(run / "checkpoints/last.ckpt")["global_step"] == step
    assert (
        err.count("interrupted (Ctrl-C): stopping after this training step") == 1
    )  # one SIGINT reached the fit
