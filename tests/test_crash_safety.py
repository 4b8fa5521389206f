"""Checkpoint writes survive any kill and a full disk, on a run root on another filesystem than
$TMPDIR where this machine allows a tmpfs mount (root): a kill while last.ckpt is being written
leaves the previous one intact and the resumed run ends bit-identical; a full disk is one error
line naming the folder and the space needed, with no partial file left. A kill while a best
checkpoint or metrics.json is written, during the final save or during the test pass resumes to the
uninterrupted run's record too (the kills during training steps and validations: test_resume)."""

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


def assert_same_weights(straight: Path, run: Path) -> None:
    """The two runs' final last.ckpt: step 20, bit-identical weights and optimizer state."""
    x, y = load(straight / "checkpoints/last.ckpt"), load(run / "checkpoints/last.ckpt")
    assert x["global_step"] == y["global_step"] == 20
    assert_same(x["state_dict"], y["state_dict"], "", "", "state_dict")
    assert_same(x["optimizer_states"], y["optimizer_states"], "", "", "optimizer")


def test_a_kill_while_last_ckpt_is_written_leaves_the_previous_one(straight, tiny_listops, tmp_path, tmpfs):
    import shutil

    shutil.copytree(tiny_listops, tmp_path / "data")
    root, _ = tmpfs("scratch", 256)
    kill = ["--trainer.callbacks+=crash_hooks.KillDuringSave", "--trainer.callbacks.step", "8"]
    killed = run_cli([*ARGS, "--run_root", str(root), *kill], tmp_path, env=HOOKS)
    assert killed.returncode == -9, killed.stderr[-3000:]
    folder = root / RUN / "checkpoints"
    assert load(folder / "last.ckpt")["global_step"] == 4  # the previous checkpoint, whole
    assert list(folder.glob(".last.ckpt.*.part"))  # the half-written one never replaced it
    resumed = run_cli([*ARGS, "--run_root", str(root), "--ckpt_path", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(straight, root / RUN)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_listops) -> Path:
    """The uninterrupted run every killed-and-resumed one must equal."""
    import shutil

    cwd = tmp_path_factory.mktemp("straight")
    shutil.copytree(tiny_listops, cwd / "data")
    proc = run_cli([*ARGS, "--run_root", "straight"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd / "straight" / RUN


# Validations at steps 6, 12 and 18; checkpoints every 4 steps (12 after its validation), and 20.
KILLS = {
    "writing best-step6.ckpt": [
        "KillDuringSave", "--trainer.callbacks.step", "6", "--trainer.callbacks.name", "best-"
    ],
    "writing metrics.json after step 12": [
        "KillDuringSave", "--trainer.callbacks.step", "12", "--trainer.callbacks.name", "metrics.json"
    ],
    "writing the final last.ckpt": ["KillDuringSave", "--trainer.callbacks.step", "20"],
    "during the test pass": ["KillDuringTest"],
}  # fmt: skip


@pytest.mark.parametrize("where", list(KILLS))
def test_a_kill_anywhere_resumes_to_the_uninterrupted_result(where, straight, tiny_listops, tmp_path, tmpfs):
    import json
    import shutil

    shutil.copytree(tiny_listops, tmp_path / "data")
    root, _ = tmpfs("scratch", 256)
    hook, *hook_args = KILLS[where]
    killed = run_cli([*ARGS, "--run_root", str(root), f"--trainer.callbacks+=crash_hooks.{hook}", *hook_args],
                     tmp_path, env=HOOKS)  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_cli([*ARGS, "--run_root", str(root), "--ckpt_path", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = root / RUN
    assert not list(run.rglob("*.part"))
    a, b = (json.loads((r / "metrics.json").read_text()) for r in (straight, run))
    assert set(a) == set(b)
    assert a["val_history"] == b["val_history"]
    for key in ("best_val_acc", "best_val_step", "test_acc", "total_steps", "total_epochs"):
        assert a[key] == b[key], key
    assert Path(a["test_ckpt"]).name == Path(b["test_ckpt"]).name
    assert [h["kappa_mean"] for h in a.get("cond_history", [])] == [
        h["kappa_mean"] for h in b.get("cond_history", [])
    ]
    assert_same_weights(straight, run)


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
