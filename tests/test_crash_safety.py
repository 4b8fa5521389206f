"""Checkpoint writes survive any kill and a full disk, on a run root on another filesystem than
$TMPDIR where this machine allows a tmpfs mount (root): a kill while last.ckpt is being written
leaves the previous one intact and the resumed run ends bit-identical; a full disk is one error
line naming the folder and the space needed, with no partial file left."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import run_cli
from test_resume import ARGS, HOOKS, RUN, assert_same, load


@pytest.fixture()
def tmpfs(tmp_path: Path):
    """A mount factory: ``tmpfs("name", megabytes)`` is a fresh tmpfs (another filesystem than
    $TMPDIR), or a plain folder where mounting is not allowed."""
    mounted: list[Path] = []

    def make(name: str, megabytes: int) -> tuple[Path, bool]:
        where = tmp_path / name
        where.mkdir()
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(where)],
                            capture_output=True).returncode == 0  # fmt: skip
        if ok:
            mounted.append(where)
        return where, ok

    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_a_kill_while_last_ckpt_is_written_leaves_the_previous_one(tiny_listops, tmp_path, tmpfs):
    import shutil

    shutil.copytree(tiny_listops, tmp_path / "data")
    straight = run_cli([*ARGS, "--run_root", "straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    root, _ = tmpfs("scratch", 256)
    kill = ["--trainer.callbacks+=crash_hooks.KillDuringSave", "--trainer.callbacks.step", "8"]
    killed = run_cli([*ARGS, "--run_root", str(root), *kill], tmp_path, env=HOOKS)
    assert killed.returncode == -9, killed.stderr[-3000:]
    folder = root / RUN / "checkpoints"
    assert load(folder / "last.ckpt")["global_step"] == 4  # the previous checkpoint, whole
    assert list(folder.glob(".last.ckpt.*.part"))  # the half-written one never replaced it
    resumed = run_cli([*ARGS, "--run_root", str(root), "--ckpt_path", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = load(tmp_path / "straight" / RUN / "checkpoints/last.ckpt"), load(folder / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 20
    assert_same(a["state_dict"], b["state_dict"], "", "", "state_dict")
    assert_same(a["optimizer_states"], b["optimizer_states"], "", "", "optimizer")


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tiny_listops, tmp_path, tmpfs):
    root, mounted = tmpfs("small", 4)
    if not mounted:
        pytest.skip("mounting a tmpfs needs root here")
    # The default model's checkpoints are ~2.5 MB: the first one fits in 4 MB, the second does not.
    args = ["fit", "--task", "listops", "--data.preset", "tiny", "--trainer.max_steps", "12"]
    args += ["--trainer.val_check_interval", "4", "--checkpoint_every", "4", "--model.warmup_steps", "2"]
    args += ["--cond.every_n_steps", "0", "--trainer.enable_progress_bar", "false", "--run_root", str(root)]
    proc = run_cli(args, tmp_path, env={"LRA_DATA": str(tiny_listops)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: no space left to write ") and f" in {root}" in errors[0]
    assert "MB are free" in errors[0] and "needs 2." in errors[0]
    assert not list(root.rglob("*.part")) and not list(root.rglob("*.tmp"))
    for ckpt in root.rglob("*.ckpt"):  # whatever was written is whole
        assert load(ckpt)["global_step"] > 0
