"""The learning-rate schedule of a real ``fit``: per step, the lr and AdamW beta1 the optimizer uses
(recorded by a test callback and read back from the TensorBoard ``lr-AdamW`` / ``lr-AdamW-momentum``
logs) equal an independent reference: torch's ``OneCycleLR`` stepped on its own, or the
``warmup_linear`` formula written out here. Also: its length when ``max_epochs`` sets it, and the
one-line error when the warm-up does not fit the run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_FIT, assert_one_line_error, run_cli, run_cli_in_process

LR, BETAS, WARMUP = 1e-3, (0.9, 0.999), 5
BATCHES_PER_EPOCH = 512 // 32  # tiny ListOps train split, batch 32
HOOKS = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
RUN = Path("runs/listops-tiny/softmax/default/seed0")
# name -> (extra fit arguments, steps the schedule must span)
CASES = {
    "onecycle": ([], 20),
    "warmup_linear": (["--model.schedule", "warmup_linear"], 20),
    "onecycle-from-max-epochs": (
        ["--trainer.max_steps", "-1", "--trainer.max_epochs", "1"],
        BATCHES_PER_EPOCH,
    ),
}


def torch_onecycle(total: int) -> list[tuple[float, float]]:
    """(lr, beta1) at each of ``total`` steps: torch's OneCycleLR with the reference's arguments on a
    standalone AdamW, stepped once per optimizer step."""
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=1e-6, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=LR, total_steps=total, pct_start=WARMUP / total, anneal_strategy="linear"
    )
    out = []
    for _ in range(total):
        out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]))
        opt.step()
        sched.step()
    return out


def warmup_linear_reference(total: int) -> list[tuple[float, float]]:
    """Linear warm-up from LR / WARMUP to LR, then linear to 0 at ``total``; beta1 fixed."""
    return [
        (LR * (s + 1) / WARMUP if s < WARMUP else LR * (total - s) / (total - WARMUP), BETAS[0])
        for s in range(total)
    ]


def tensorboard_scalars(run: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events in run.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


@pytest.fixture(scope="module", params=list(CASES))
def fitted(request, tmp_path_factory, tiny_listops) -> tuple[str, Path]:
    extra, _ = CASES[request.param]
    cwd = tmp_path_factory.mktemp(request.param)
    shutil.copytree(tiny_listops, cwd / "data")
    args = ["fit", "--task", "listops", *TINY_FIT, *("--trainer.max_steps", "20")]
    args += ["--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "10"]
    args += ["--model.lr", str(LR), "--model.warmup_steps", str(WARMUP), "--model.dim", "16"]
    args += ["--model.mlp_dim", "32", "--trainer.callbacks+=schedule_hooks.RecordSchedule"]
    args += ["--trainer.callbacks.path", str(cwd / "schedule.json"), *extra]
    proc = run_cli(args, cwd, env=HOOKS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return request.param, cwd


def test_lr_and_beta1_per_step_equal_the_reference(fitted):
    case, cwd = fitted
    total = CASES[case][1]
    expected = warmup_linear_reference(total) if case == "warmup_linear" else torch_onecycle(total)
    if case != "warmup_linear":  # the shape, independently of torch: lr/25 -> lr at step WARMUP - 1 -> ~0
        assert expected[0] == (pytest.approx(LR / 25), pytest.approx(0.95))
        assert expected[WARMUP - 1] == (pytest.approx(LR), pytest.approx(0.85))
        assert expected[-1][0] < LR / 25 / 100 and expected[-1][1] > 0.94
    rows = json.loads((cwd / "schedule.json").read_text())
    assert [step for step, _, _ in rows] == list(range(total))
    got = [(lr, beta1) for _, lr, beta1 in rows]
    if case == "warmup_linear":  # the formula here rounds differently from LambdaLR's lr * factor
        assert [x for row in got for x in row] == pytest.approx(
            [x for row in expected for x in row], rel=1e-12
        )
    else:
        assert got == expected  # exact: torch's scheduler, the same float arithmetic

    # What a user sees: TensorBoard logs the same per-step values (stored as float32).
    lrs, betas = (tensorboard_scalars(cwd / RUN, tag) for tag in ("lr-AdamW", "lr-AdamW-momentum"))
    assert sorted(lrs) == sorted(betas) == list(range(total))
    for step, (lr, beta1) in enumerate(expected):
        assert lrs[step] == pytest.approx(lr, rel=1e-6) and betas[step] == pytest.approx(beta1, rel=1e-6)


def test_warmup_that_fills_the_epochs_is_one_line_error(tmp_path, tiny_listops, monkeypatch, capfd):
    """With max_steps -1 the length comes from max_epochs x batches; checked when training starts."""
    shutil.copytree(tiny_listops, tmp_path / "data")
    args = ["fit", "--task", "listops", *TINY_FIT, "--trainer.max_steps", "-1", "--trainer.max_epochs", "1"]
    proc = run_cli_in_process([*args, "--model.warmup_steps", "16"], tmp_path, monkeypatch, capfd)
    assert_one_line_error(
        proc, "model.warmup_steps=16 must be less than the 16 training steps (max_epochs x batches per epoch)"
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--trainer.max_steps", "30"], 6),  # ListOps' 1000 of 5000: the same fifth
        (["--trainer.max_steps=2000"], 400),
        (["--trainer.max_steps", "3"], 2),  # 0.6 rounds to 1, which one-cycle cannot use: 2
        (["--trainer.max_steps", "2"], 0),
        (["--trainer.max_steps", "5000"], None),  # the config's own length
        (["--trainer.max_steps", "30", "--model.warmup_steps", "5"], None),  # the user's own warm-up
        (["--trainer.max_steps", "30", "--config", "mine.yaml"], None),  # a config of the user's
        (["--trainer.max_steps", "-1"], None),
        (["--model.lr", "1e-3"], None),
    ],
)
def test_warmup_follows_a_max_steps_override(args, expected):
    from lra_cond.training.arguments import CONFIG_DIR, scaled_warmup

    got = scaled_warmup(CONFIG_DIR / "listops.yaml", args)
    assert (None if got is None else got[0]) == expected
    if got is not None:
        assert (
            got[1].startswith("note: warm-up scaled with --trainer.max_steps ") and "1000 of 5000" in got[1]
        )


def test_a_short_fit_with_only_max_steps_runs_with_a_note(tiny_listops, tmp_path):
    from conftest import run_cli

    args = ["fit", "--task", "listops", "--data.preset", "tiny", "--trainer.max_steps", "30"]
    args += ["--cond.every_n_steps", "0", "--trainer.enable_progress_bar", "false"]
    proc = run_cli(args, tmp_path, env={"LRA_DATA": str(tiny_listops)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    note = "note: warm-up scaled with --trainer.max_steps 30: 6 steps (the task config's 1000 of 5000)"
    assert note in proc.stderr
    import yaml

    config = yaml.safe_load((tmp_path / "runs/listops-tiny/softmax/default/seed0/config.yaml").read_text())
    assert config["model"]["warmup_steps"] == 6 and config["trainer"]["max_steps"] == 30
