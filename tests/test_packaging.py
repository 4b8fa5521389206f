"""What a non-editable install ships: every package, the configs and data_prep inside ``lra_cond``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_pyproject_lists_every_package():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "lra_cond").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    packages |= {"lra_cond.configs"}  # data files only (configs/*.yaml)
    assert set(config["packages"]) == packages
    assert config["package-dir"] == {"lra_cond.configs": "configs", "lra_cond.data_prep": "data_prep"}


def test_wheel_installs_configs_and_data_prep_inside_the_package(tmp_path):
    """Build a wheel (offline, no build isolation), install it into a plain folder, and run ``--task``
    commands from another directory with only that folder on the path."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("lra_cond", "data_prep", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheels = tmp_path / "wheels"
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                   check=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    (wheel,) = wheels.glob("lra_cond-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lra_cond/configs/listops.yaml" in names and "lra_cond/data_prep/listops.py" in names
    assert not any(n.startswith(("data_prep/", "configs/")) for n in names)  # no generic top-level names
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**env, "PYTHONPATH": str(target), "LRA_DATA": str(tmp_path / "data")}

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "lra_cond", *args]
        return subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)

    proc = run("fit", "--task", "listops", "--print_config")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # configs/listops.yaml (steps), configs/defaults.yaml (devices) and --data.task
    assert "max_steps: 5000" in proc.stdout and "devices: 1" in proc.stdout and "task: listops" in proc.stdout
    proc = run("prepare", "--task", "listops", "--preset", "tiny", "--workers", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "prepared listops (tiny)" in proc.stdout
    check = "import lra_cond.data_prep.listops as m; print(m.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", check], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert Path(proc.stdout.strip()).is_relative_to(target), proc.stderr
