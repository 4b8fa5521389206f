"""``compare --jobs 2``: two fits side by side, one thread each, each logging to its own file, one
progress line per running fit. Ctrl-C stops both at a checkpoint, rerunning compare continues them,
and the metrics equal those of the same fits run one after another (deterministic mode)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, run_cli, sigint_default

ROOT = Path("runs/listops-tiny/softmax")
SEEDS = (0, 1)
COMPARE = [
    *("compare", "--task", "listops", "--inits", "default", "--seeds", "0,1", "--threads", "1"),
    *("--data.preset", "tiny", "--trainer.max_steps", "300", "--trainer.val_check_interval", "50"),
    *("--trainer.deterministic", "true", "--model.warmup_steps", "5", "--model.lr", "1e-3"),
    *("--model.dim", "16", "--model.mlp_dim", "32", "--cond.every_n_steps", "0"),
]
COMPARED = ("val_history", "best_val_acc", "best_val_step", "test_acc", "total_steps", "total_epochs")


def metrics(cwd: Path, seed: int) -> dict:
    return json.loads((cwd / ROOT / "default" / f"seed{seed}" / "metrics.json").read_text())


def test_side_by_side_interrupted_and_continued_equals_one_after_another(tiny_listops, tmp_path):
    env = {"LRA_DATA": str(tiny_listops)}
    serial = tmp_path / "serial"
    serial.mkdir()
    one = run_cli([*COMPARE, "--jobs", "1"], serial, env=env)
    assert one.returncode == 0, one.stderr[-3000:]

    side = tmp_path / "side"
    side.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lra_cond", *COMPARE, "--jobs", "2"],
        cwd=side,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    )
    deadline = time.monotonic() + 300
    folders = [side / ROOT / "default" / f"seed{s}" for s in SEEDS]
    while not all((f / "checkpoints" / "last.ckpt").is_file() for f in folders):  # both trained a while
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "rerun compare to continue" in err.strip().splitlines()[-1]
    stopped = [metrics(side, s) for s in SEEDS]
    assert all(0 < m["total_steps"] < 300 and m["stopped"].startswith("interrupted") for m in stopped), (
        stopped
    )
    assert "2 fit(s), 2 at a time with 1 thread(s) each" in out
    for s in SEEDS:  # each fit logs to its own file, which holds its command
        log = side / ROOT / "compare" / "logs" / f"default-seed{s}.log"
        assert f"--seed_everything {s}" in log.read_text().splitlines()[0]
        assert f"default seed {s}: started, log" in out

    again = run_cli([*COMPARE, "--jobs", "2"], side, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert any(line.startswith("default seed 0: step ") for line in again.stdout.splitlines())  # progress
    for s in SEEDS:
        a, b = metrics(serial, s), metrics(side, s)
        assert "stopped" not in b
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}, s
    report = side / ROOT / "compare" / "report.md"
    assert report.is_file() and "default" in report.read_text()
