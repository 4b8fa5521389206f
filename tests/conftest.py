"""Shared test helpers: run the CLI in a subprocess against this checkout, tiny ListOps data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(
    args: list[str], cwd: Path, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python -m lra_cond ARGS`` in ``cwd``, importing this checkout (not an installed copy)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "LRA_DATA": str(cwd / "data"), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "lra_cond", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def tiny_listops(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root holding the prepared tiny ListOps split (generated once per session)."""
    from lra_cond.data.tasks import TASKS

    root = tmp_path_factory.mktemp("data")
    TASKS.get("listops").prepare(root, "tiny", seed=0, workers=1)
    return root


TINY_FIT = [
    "--data.preset",
    "tiny",
    "--trainer.max_steps",
    "8",
    "--trainer.val_check_interval",
    "4",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--model.warmup_steps",
    "2",
]
