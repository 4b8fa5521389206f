"""Shared test helpers: run the CLI in a subprocess against this checkout, tiny ListOps data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# Tests that take a device run on CPU everywhere and on CUDA where torch sees a GPU (CI has none:
# on a GPU machine, ``pytest -k cuda`` runs just those).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def small_lra_model(family: str, dim: int, mlp_dim: int, max_len: int) -> torch.nn.Module:
    """A small ListOps ``LraModel`` of ``family`` (Nystrom with 8 landmarks, to fit short batches)."""
    from lra_cond.training.module import LraModel

    options = {"num_landmarks": 8} if family == "nystrom" else {}
    return LraModel(
        task="listops", attention=family, attention_args=options, dim=dim, mlp_dim=mlp_dim, max_len=max_len
    )


def seeded_loss_and_grads(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], seed: int = 1
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's cross-entropy on ``batch`` and every parameter's gradient, dropout drawn from
    ``seed``: two calls in train mode see the same function."""
    model.zero_grad()
    torch.manual_seed(seed)
    loss = torch.nn.functional.cross_entropy(model(batch), batch["label"])
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def sigint_default() -> None:
    """A child's SIGINT as a terminal's Ctrl-C would find it: pytest started as a background job
    (``cmd &`` in a script, nohup) has SIGINT ignored, which its children inherit, and Python then
    installs no KeyboardInterrupt handler (the Ctrl-C tests would see the signal do nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(
    args: list[str], cwd: Path, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python -m lra_cond ARGS`` in ``cwd``, importing this checkout (not an installed copy)."""
    # One thread per CLI process: tiny models are dominated by threading overhead otherwise.
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO), "LRA_DATA": str(cwd / "data")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "lra_cond", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=sigint_default,
    )


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread. On a loaded machine, OpenMP spin-waiting of a second thread
    made tests ~50x slower in CPU time (CLI subprocesses get OMP_NUM_THREADS=1 in run_cli)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def run_cli_in_process(
    args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> subprocess.CompletedProcess:
    """``main(ARGS)`` in this process (no interpreter start-up); same result shape as ``run_cli``.

    For commands that stop before training (bad input): their exit status and stderr are the
    same as a subprocess's, at a fraction of the cost.
    """
    from lra_cond.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("LRA_DATA", str(cwd / "data"))
    capfd.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def assert_one_line_error(proc: subprocess.CompletedProcess, expected: str) -> None:
    """Exit 2, exactly one ``error:`` line (the last line) containing ``expected``, no traceback."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="session")
def tiny_listops(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root holding the prepared tiny ListOps split (generated once per session)."""
    from lra_cond.data.tasks import TASKS

    root = tmp_path_factory.mktemp("data")
    TASKS.get("listops").prepare(root, "tiny", seed=0, workers=1)
    return root


# Few steps, validation twice, logging every other step: a CLI smoke run of a few seconds.
TINY_TRAINING = [
    *("--data.preset", "tiny"),
    *("--trainer.max_steps", "8"),
    *("--trainer.val_check_interval", "4"),
    *("--trainer.log_every_n_steps", "2"),
    *("--trainer.enable_progress_bar", "false"),
    *("--trainer.enable_model_summary", "false"),
    *("--model.warmup_steps", "2"),
]
# The condition monitor is on by default (two probes even in a short run, ~1 min at dim 64); smoke
# tests of other features skip it. test_callbacks_cond covers the default (TINY_TRAINING alone).
TINY_FIT = [*TINY_TRAINING, "--cond.every_n_steps", "0"]
