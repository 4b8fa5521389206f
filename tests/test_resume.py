"""Resume after SIGKILL: a run killed twice and resumed with ``--ckpt_path last`` ends bit-identical
to an uninterrupted run (deterministic mode, fixed seed): metrics.json, weights, optimizer and
every callback's checkpointed state (validation history, RNG, best checkpoint bookkeeping, and any
callback added later, e.g. the condition-number history)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli

RUN = Path("listops-tiny/softmax/conditioned/seed0")
# 16 batches per epoch (512 / 32): the kills land mid-epoch 0, the resumed run crosses into epoch 1.
# Step 8 is a checkpoint step only; step 12 is a checkpoint step and a validation step.
ARGS = [
    "fit",
    *("--task", "listops", "--init", "conditioned", "--data.preset", "tiny"),
    *("--trainer.max_steps", "20", "--trainer.val_check_interval", "6", "--checkpoint_every", "4"),
    *("--trainer.deterministic", "true", "--trainer.log_every_n_steps", "2"),
    *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
    *("--model.warmup_steps", "3", "--model.lr", "1e-3", "--model.dim", "16", "--model.mlp_dim", "32"),
]
try:  # the condition-number monitor (when present): cheap dense κ every 6 steps, history must survive
    from lra_cond.callbacks import ConditionNumberMonitor  # noqa: F401

    # 64 tokens: J must have at least as many rows as parameters (3 (dim + 1) = 51 tokens) for a κ.
    ARGS += ["--cond.every_n_steps", "6", "--cond.method", "dense", "--cond.probe_tokens", "64"]
except ImportError:
    pass
HOOKS = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}


def kill_at(step: int) -> list[str]:
    return ["--trainer.callbacks+=crash_hooks.KillAtStep", "--trainer.callbacks.step", str(step)]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


# ModelCheckpoint does not restore its informational ``current_score``; wall-clock timings differ.
NOT_COMPARED = {"current_score", "seconds"}


def assert_same(a, b, root_a: str, root_b: str, where: str = "") -> None:
    """Recursive exact equality; run-root prefixes in path strings are normalised."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        a = {k.replace(root_a, "ROOT") if isinstance(k, str) else k: v for k, v in a.items()}
        b = {k.replace(root_b, "ROOT") if isinstance(k, str) else k: v for k, v in b.items()}
        assert set(a) == set(b), where
        for k in set(a) - NOT_COMPARED:
            assert_same(a[k], b[k], root_a, root_b, f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, root_a, root_b, f"{where}[{i}]")
    elif isinstance(a, str):
        assert a.replace(root_a, "ROOT") == b.replace(root_b, "ROOT"), where
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_listops) -> Path:
    cwd = tmp_path_factory.mktemp("resume")
    shutil.copytree(tiny_listops, cwd / "data")
    straight = run_cli([*ARGS, "--run_root", "straight"], cwd)
    assert straight.returncode == 0, straight.stderr[-3000:]

    crashed = run_cli([*ARGS, "--run_root", "crash", *kill_at(8)], cwd, env=HOOKS)
    assert crashed.returncode == -9, crashed.stderr[-3000:]  # SIGKILL during step 9
    assert load(cwd / "crash" / RUN / "checkpoints/last.ckpt")["global_step"] == 8

    # Killed during the validation of step 12, a checkpoint step: last.ckpt is still step 8's (one saved
    # before that validation would make the resume skip it), so the resume repeats steps 9-12.
    during = ["--trainer.callbacks+=crash_hooks.KillDuringValidation", "--trainer.callbacks.step", "12"]
    midval = run_cli([*ARGS, "--run_root", "crash", "--ckpt_path", "last", *during], cwd, env=HOOKS)
    assert midval.returncode == -9, midval.stderr[-3000:]
    assert load(cwd / "crash" / RUN / "checkpoints/last.ckpt")["global_step"] == 8

    again = run_cli([*ARGS, "--run_root", "crash", "--ckpt_path", "last", *kill_at(12)], cwd, env=HOOKS)
    assert again.returncode == -9, again.stderr[-3000:]
    assert "resuming from" in again.stderr
    assert load(cwd / "crash" / RUN / "checkpoints/last.ckpt")["global_step"] == 12  # after its validation

    resumed = run_cli([*ARGS, "--run_root", "crash", "--ckpt_path", "last"], cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {Path('crash') / RUN / 'checkpoints/last.ckpt'}" in resumed.stderr
    return cwd


def test_metrics_equal_uninterrupted_run(runs):
    a = json.loads((runs / "straight" / RUN / "metrics.json").read_text())
    b = json.loads((runs / "crash" / RUN / "metrics.json").read_text())
    assert [s for s, _ in a["val_history"]] == [6, 12, 18]  # the step-12 validation was not lost
    assert [s for s, _ in b["val_history"]] == [6, 12, 18]
    for (_, x), (_, y) in zip(a["val_history"], b["val_history"]):
        assert x == pytest.approx(y, abs=1e-6)
    for key in ("best_val_acc", "test_acc", "total_epochs"):
        assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert a["best_val_step"] == b["best_val_step"] and a["total_steps"] == b["total_steps"] == 20
    assert Path(a["test_ckpt"]).name == Path(b["test_ckpt"]).name
    assert set(a) == set(b)
    if "cond_history" in a:  # κ measured at 0, 6, 12, 18 and at the end, once each despite the kills
        assert [h["step"] for h in b["cond_history"]] == [h["step"] for h in a["cond_history"]]
        assert [h["step"] for h in a["cond_history"]] == [0, 6, 12, 18, 20]
        for x, y in zip(a["cond_history"], b["cond_history"]):
            assert x["kappa_mean"] is not None  # really measured
            assert x["kappa_mean"] == pytest.approx(y["kappa_mean"], rel=1e-9)


def test_final_checkpoint_is_bit_identical(runs):
    a = load(runs / "straight" / RUN / "checkpoints/last.ckpt")
    b = load(runs / "crash" / RUN / "checkpoints/last.ckpt")
    assert a["global_step"] == b["global_step"] == 20
    assert_same(a["state_dict"], b["state_dict"], "", "", "state_dict")
    assert_same(a["optimizer_states"], b["optimizer_states"], "", "", "optimizer")
    assert_same(a["lr_schedulers"], b["lr_schedulers"], "", "", "lr_schedulers")
    # Every callback's state: RunSummary history, RNG streams, best-checkpoint bookkeeping, ...
    assert_same(a["callbacks"], b["callbacks"], "straight", "crash", "callbacks")
    assert_same(a["loops"], b["loops"], "", "", "loops")


def test_sampler_resume_continues_the_same_order():
    """The shuffling order depends only on (seed, epoch); a resume skips exactly what was trained."""
    from torch.utils.data import BatchSampler

    from lra_cond.data.sampler import EpochShuffleSampler

    def batches(sampler: EpochShuffleSampler) -> list[list[int]]:
        return list(BatchSampler(sampler, batch_size=8, drop_last=True))

    straight = EpochShuffleSampler(100, seed=5)
    assert sorted(straight) == list(range(100)) and list(straight) != list(range(100))
    epoch0 = batches(straight)
    straight.set_epoch(1)
    epoch1 = batches(straight)
    assert sorted(straight) == list(range(100)) and epoch0 != epoch1
    assert epoch0 != batches(EpochShuffleSampler(100, seed=6))

    resumed = EpochShuffleSampler(100, seed=5)
    resumed.resume(0, skip=5 * 8)
    assert len(resumed) == 100  # the trainer's batches-per-epoch count is unchanged
    assert batches(resumed) == epoch0[5:]
    assert batches(resumed) == epoch0[5:]  # re-iterating the resumed epoch skips again
    resumed.set_epoch(1)
    assert batches(resumed) == epoch1


def test_a_run_killed_before_its_first_checkpoint_starts_again(runs):
    """Killed during step 3 (its first checkpoint is at step 4): the folder holds files but nothing
    to resume. The same compare (whose fit asks --ckpt_path last) starts that run again from scratch,
    and it ends as the uninterrupted run did."""
    cwd = runs
    early = run_cli([*ARGS, "--run_root", "early", *kill_at(2)], cwd, env=HOOKS)
    assert early.returncode == -9, early.stderr[-3000:]
    folder = cwd / "early" / RUN
    assert (folder / "config.yaml").is_file() and not (folder / "checkpoints" / "last.ckpt").exists()
    fit_options = ARGS[ARGS.index("--data.preset") :]
    compare = ["compare", "--task", "listops", "--inits", "conditioned", "--seeds", "0", *fit_options]
    again = run_cli([*compare, "--run_root", "early"], cwd)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "files of a run that stopped before its first checkpoint: starting it again" in again.stderr
    a = load(cwd / "straight" / RUN / "checkpoints/last.ckpt")
    b = load(folder / "checkpoints/last.ckpt")
    assert a["global_step"] == b["global_step"] == 20
    assert_same(a["state_dict"], b["state_dict"], "", "", "state_dict")
    assert_same(a["callbacks"], b["callbacks"], "straight", "early", "callbacks")
