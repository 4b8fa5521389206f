"""``compare`` end to end on tiny ListOps (2 inits x 2 seeds, reuse on rerun, --plan, bad init) and a
2-process CPU DDP ``fit`` logging the same metric keys and TensorBoard tags as a single-process run."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from conftest import TINY_FIT, assert_one_line_error, run_cli

from lra_cond.cli import main

INITS, SEEDS = ("default", "conditioned"), (0, 1)
# TINY_FIT with 4 steps, a small model and a cheap dense κ probe (so κ columns and plots have data).
SMALL = [
    *TINY_FIT,
    *("--trainer.max_steps", "4", "--trainer.val_check_interval", "2"),
    *("--model.dim", "16", "--model.mlp_dim", "32"),
    *("--cond.every_n_steps", "2", "--cond.method", "dense", "--cond.probe_tokens", "64"),
]
COMPARE = ["compare", "--task", "listops", "--inits", ",".join(INITS), "--seeds", "0,1", *SMALL]


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory, tiny_listops: Path) -> tuple[Path, str]:
    cwd = tmp_path_factory.mktemp("compare")
    proc = run_cli(COMPARE, cwd, env={"LRA_DATA": str(tiny_listops)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, proc.stdout


def _event_tags(run: Path) -> tuple[set[str], set[str], dict]:
    """Scalar tags, plugin names, and the hparams session (param names, metric tags) of a run."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    scalars, plugins, hp = set(), set(), {"params": set(), "metrics": set(), "values": {}, "first": set()}
    for path in sorted(run.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name
                plugins.add(plugin)
                if plugin == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    hp["params"] |= set(data.session_start_info.hparams)
                    for name, v in data.session_start_info.hparams.items():
                        hp["values"][name] = v.string_value if v.HasField("string_value") else v.number_value
                    hp["metrics"] |= {m.name.tag for m in data.experiment.metric_infos}
                    hp["first"] |= {i.name for i in data.experiment.hparam_infos if i.differs}
                elif plugin == "scalars":
                    scalars.add(value.tag)
    return scalars, plugins, hp


def test_compare_runs_all_then_reuses(compared: tuple[Path, str], tiny_listops: Path) -> None:
    cwd, out = compared
    root = cwd / "runs" / "listops-tiny" / "softmax"
    for init in INITS:
        for seed in SEEDS:
            run = root / init / f"seed{seed}"
            metrics = json.loads((run / "metrics.json").read_text())
            assert metrics["test_acc"] is not None and metrics["total_steps"] == 4
            assert f"init: {init}" in (run / "config.yaml").read_text()
            assert f"seed_everything: {seed}" in (run / "config.yaml").read_text()
            assert f"{init} seed {seed}: fitting" in out
    report = (root / "compare" / "report.md").read_text()
    assert "warning" not in report.lower()  # same config apart from init and seed
    table = report.split("## Results\n\n", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in table.splitlines() if ln.startswith("| ")]
    assert [r[0] for r in rows[1:]] == ["default", "conditioned"]
    assert all(r[8] != "n/a" and r[9] != "n/a" for r in rows[1:])  # κ(J) measured at step 0 and end
    for plot in ("val_acc", "kappa", "weights_kappa"):
        assert (root / "compare" / f"{plot}.png").stat().st_size > 0

    ckpts = {p: p.stat().st_mtime_ns for p in root.glob("*/seed*/checkpoints/*.ckpt")}
    assert len(ckpts) >= 4
    again = run_cli(COMPARE, cwd, env={"LRA_DATA": str(tiny_listops)})
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("reusing finished run") == 4 and "fitting" not in again.stdout
    assert {p: p.stat().st_mtime_ns for p in root.glob("*/seed*/checkpoints/*.ckpt")} == ckpts
    assert (root / "compare" / "report.md").read_text() == report

    # `report` alone rebuilds the same table from the folders.
    main(["report", str(root)])
    assert (root / "compare" / "report.md").read_text() == report


def test_compare_resumes_an_interrupted_run(compared: tuple[Path, str], tiny_listops: Path) -> None:
    """A run with last.ckpt but no test accuracy is resumed from last.ckpt; the others are reused."""
    cwd, _ = compared
    run = cwd / "runs" / "listops-tiny" / "softmax" / "conditioned" / "seed1"
    metrics = json.loads((run / "metrics.json").read_text())
    history = metrics.pop("val_history")
    del metrics["test_acc"]
    (run / "metrics.json").write_text(json.dumps({**metrics, "val_history": history}))
    proc = run_cli(COMPARE, cwd, env={"LRA_DATA": str(tiny_listops)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reusing finished run") == 3 and "conditioned seed 1: resuming" in proc.stdout
    assert f"Restored all states from the checkpoint at {run.relative_to(cwd)}/checkpoints/last.ckpt" in (
        proc.stdout + proc.stderr
    )
    resumed = json.loads((run / "metrics.json").read_text())
    # Already at max_steps: no training beyond it. (Values are not compared: resume fidelity is
    # the checkpoint machinery's business, tested with it.)
    assert resumed["test_acc"] is not None and resumed["total_steps"] == 4
    assert [s for s, _ in resumed["val_history"]] == [s for s, _ in history]


def test_compare_refuses_a_folder_with_another_config(compared: tuple[Path, str], tiny_listops: Path) -> None:
    cwd, _ = compared
    proc = run_cli([*COMPARE, "--model.lr", "0.001"], cwd, env={"LRA_DATA": str(tiny_listops)})
    assert_one_line_error(proc, "different config (model.lr)")


def test_plan_prints_one_fit_per_run(capsys: pytest.CaptureFixture) -> None:
    main(["compare", "--task", "listops", "--inits", "default,conditioned", "--seeds", "0,1,2", "--plan"])
    lines = capsys.readouterr().out.splitlines()
    expected = [
        f"python -m lra_cond fit --task listops --attention softmax --init {i} --seed_everything {s} "
        "--run_root runs"
        for s in (0, 1, 2)
        for i in ("default", "conditioned")
    ]
    assert lines == expected  # seed by seed: each seed's inits run (and finish) together
    assert all(shlex.split(line)[3] == "fit" for line in lines)


def test_unknown_init_fails_before_any_run(tmp_path: Path) -> None:
    proc = run_cli(["compare", "--task", "listops", "--inits", "default,bogus"], tmp_path)
    assert_one_line_error(proc, "unknown init 'bogus'")
    assert not (tmp_path / "runs").exists()


def test_ddp_two_process_fit_logs_the_same_keys(compared: tuple[Path, str], tiny_listops: Path) -> None:
    cwd, _ = compared
    args = ["fit", "--task", "listops", "--init", "default", *SMALL, "--run_root", "ddp"]
    args += ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    proc = run_cli(args, cwd, env={"LRA_DATA": str(tiny_listops)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stderr + proc.stdout
    single = cwd / "runs" / "listops-tiny" / "softmax" / "default" / "seed0"
    ddp = cwd / "ddp" / "listops-tiny" / "softmax" / "default" / "seed0"
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (single, ddp))
    assert set(m2) == set(m1) and m2["test_acc"] is not None
    assert [s for s, _ in m2["val_history"]] == [s for s, _ in m1["val_history"]]
    assert [e["step"] for e in m2["cond_history"]] == [e["step"] for e in m1["cond_history"]]
    t1, t2 = _event_tags(single), _event_tags(ddp)
    assert t2[0] == t1[0] and {"val/acc", "test/acc", "cond/kappa/layer1", "hp/final_kappa"} <= t2[0]
    assert {"hparams", "custom_scalars"} <= t2[1]
    assert t2[2] == t1[2]
    assert t2[2]["params"] == {
        *("task", "preset", "attention", "attention_args", "init", "init_args", "seed", "max_steps"),
        *("batch_size", "lr", "warmup_steps", "schedule", "cond.every_n_steps", "cond.probe_tokens"),
        *("cond.method", "num_params"),
    }
    # The five columns the HPARAMS tab shows first (it sorts "differs" first and checks five).
    assert t2[2]["first"] == {"init", "seed", "preset", "max_steps", "lr"}
    # Integers as text (TensorBoard shows a number 0 as "0.0000"), options as JSON, lr a number.
    values = t1[2]["values"]
    assert {k: values[k] for k in ("seed", "max_steps", "batch_size", "preset", "cond.probe_tokens")} == {
        "seed": "0",
        "max_steps": "4",
        "batch_size": "32",
        "preset": "tiny",
        "cond.probe_tokens": "64",
    }
    assert values["attention_args"] == "{}" and values["lr"] == pytest.approx(1e-4)
    # No target was set: no hp/steps_to_target column (of NaN).
    assert t2[2]["metrics"] == {"hp/best_val_acc", "hp/final_kappa"}
