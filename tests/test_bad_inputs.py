"""The catalogue of bad inputs (README "Bad input"): each is one ``error:`` line on stderr, exit
status 2, no traceback, and every file that existed before (data, an earlier run's folder) is
byte-for-byte unchanged. Entries that need a feature from another part of the suite (an attention
family, an init scheme, the condition-number monitor) are skipped, with the reason, until it exists.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_FIT, assert_one_line_error, run_cli, run_cli_in_process

from lra_cond.data import cache
from lra_cond.data.tasks import TASKS
from lra_cond.init import INITS
from lra_cond.models.attention import ATTENTIONS

FIT = ["fit", "--task", "listops", *TINY_FIT]
PREPARE = ["prepare", "--task", "listops", "--preset", "tiny", "--data-dir", "out"]
HEADER = "Source\tTarget\n"
GOOD_ROW = "( ( ( [MAX 2 ) 9 ) ] )\t9\n"


def needs(present: bool, what: str):
    return pytest.mark.skipif(not present, reason=f"{what} is not in this checkout yet")


def entry(name: str, args: list[str], expected: str, marks=()):  # noqa: ANN001, ANN201
    return pytest.param(args, expected, id=name, marks=marks)


def has_condition_monitor() -> bool:
    """The κ monitor (issue 5): the library function and the callback with its CLI options."""
    try:
        from lra_cond.callbacks import ConditionNumberMonitor  # noqa: F401
        from lra_cond.conditioning import jacobian_condition  # noqa: F401
    except ImportError:
        return False
    return True


# name, command line, expected text of the one error line
CATALOGUE = [
    entry("unknown task", ["fit", "--task", "lisops"], "unknown task 'lisops'; valid tasks: listops"),
    entry("unknown attention", [*FIT, "--attention", "sofmax"], "unknown attention 'sofmax'; valid"),
    entry("unknown init", [*FIT, "--init", "conditoned"], "unknown init 'conditoned'; valid inits: "),
    entry("unknown preset", [*FIT, "--data.preset", "huge"], "unknown preset 'huge' for task listops"),
    entry("zero lr", [*FIT, "--model.lr", "0"], "model.lr must be positive, got 0.0"),
    entry("negative lr", [*FIT, "--model.lr", "-0.001"], "model.lr must be positive, got -0.001"),
    entry("zero batch", [*FIT, "--data.batch_size", "0"], "batch_size must be positive, got 0"),
    entry("negative batch", [*FIT, "--data.batch_size", "-4"], "batch_size must be positive, got -4"),
    entry("zero steps", [*FIT, "--trainer.max_steps", "0"], "max_steps must be positive (or -1 for no step"),
    entry("negative steps", [*FIT, "--trainer.max_steps", "-5"], "trainer.max_steps must be positive"),
    entry(
        "non-integer steps",
        [*FIT, "--trainer.max_steps", "abc"],
        "Parser key \"trainer.max_steps\": Expected a <class 'int'>. Got value: abc (see: python -m lra_cond",
    ),
    entry("misspelt option", [*FIT, "--trainer.max_stepz", "3"], "unrecognized arguments: --trainer.max_st"),
    entry(
        "warm-up as long as the run",
        [*FIT, "--model.warmup_steps", "8"],
        "model.warmup_steps=8 must be less than the 8 training steps (trainer.max_steps); lower",
    ),
    entry(
        "no step or epoch limit",
        [*FIT, "--trainer.max_steps", "-1", "--trainer.max_epochs", "-1"],
        "the lr schedule needs a finite number of training steps",
    ),
    entry("unknown schedule", [*FIT, "--model.schedule", "cosine"], "unknown schedule 'cosine'; valid"),
    entry("zero checkpoint cadence", [*FIT, "--checkpoint_every", "0"], "checkpoint_every must be positive"),
    entry("heads do not divide dim", [*FIT, "--model.num_heads", "3"], "num_heads=3 does not divide dim=64"),
    entry(
        "landmarks > sequence length",
        [*FIT, "--attention", "nystrom", "--model.attention_args", '{"num_landmarks": 512}'],
        "num_landmarks=512 exceeds the sequence length",
        needs("nystrom" in ATTENTIONS, "the nystrom attention"),
    ),
    entry(
        "missing study config",
        ["compare", "--config", "no_such_study.yaml", "--plan"],
        "no such study config: no_such_study.yaml",
    ),
    entry("missing source dir", [*PREPARE, "--source", "no/such"], "missing no/such/basic_train.tsv; point"),
    entry(
        "missing data dir (downloaded task)",
        ["fit", "--task", "text", "--data.data_dir", "no/such/dir"],
        "no prepared data at no/such/dir/text/full/prepared; run: python -m lra_cond prepare --task text",
        needs("text" in TASKS, "the text task"),
    ),
    entry(
        "TSV row with 3 columns",
        [*PREPARE, "--source", "bad_columns"],
        "bad_columns/basic_train.tsv:3: expected 2 tab-separated columns, got 3",
    ),
    entry(
        "non-integer label",
        [*PREPARE, "--source", "bad_label"],
        "bad_label/basic_train.tsv:2: label 'seven' is not an integer",
    ),
    entry("non-integer prepare seed", [*PREPARE, "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    entry(
        "truncated cache file",
        [*FIT, "--data.data_dir", "corrupt"],
        "is corrupt (train/data-00000-of-00001.arrow: ",
    ),
    entry(
        "missing teacher checkpoint",
        [*FIT, "--init", "weight-selection", "--model.init_args", '{"checkpoint": "no_such.ckpt"}'],
        "teacher checkpoint not found: no_such.ckpt",
        needs("weight-selection" in INITS, "the weight-selection init"),
    ),
    entry(
        "teacher smaller than student",
        [*FIT, "--init", "weight-selection", "--model.init_args", '{"checkpoint": "small_teacher.ckpt"}'],
        "the teacher must be at least as large in every dimension",
        needs("weight-selection" in INITS, "the weight-selection init"),
    ),
]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_listops) -> Path:
    """Data, an earlier run's folder, broken sources, a corrupt cache and a small teacher."""
    cwd = tmp_path_factory.mktemp("bad_inputs")
    shutil.copytree(tiny_listops, cwd / "data")
    earlier = cwd / "runs/listops/softmax/default/seed0"
    (earlier / "checkpoints").mkdir(parents=True)
    (earlier / "config.yaml").write_text("earlier run\n")
    (earlier / "metrics.json").write_text(json.dumps({"best_val_acc": 0.5}) + "\n")
    (earlier / "checkpoints/last.ckpt").write_bytes(b"earlier checkpoint")
    for name, row in (("bad_columns", "( [MAX 2 ] )\t2\textra\n"), ("bad_label", "( [MAX 2 ] )\tseven\n")):
        (cwd / name).mkdir()
        rows = {"train": GOOD_ROW + row if name == "bad_columns" else row, "val": GOOD_ROW, "test": GOOD_ROW}
        for split, body in rows.items():
            (cwd / name / f"basic_{split}.tsv").write_text(HEADER + body)
    shutil.copytree(tiny_listops, cwd / "corrupt")
    arrow = cache.prepared_dir(cwd / "corrupt", "listops", "tiny") / "train/data-00000-of-00001.arrow"
    with open(arrow, "r+b") as f:
        f.truncate(arrow.stat().st_size - 100)
    if "weight-selection" in INITS:
        from lra_cond.models.module import LraModel

        small = LraModel(dim=32, num_heads=2, mlp_dim=64)
        teacher = {"state_dict": small.state_dict(), "hyper_parameters": dict(small.hparams)}
        torch.save(teacher, cwd / "small_teacher.ckpt")
    return cwd


@pytest.mark.parametrize("args, expected", CATALOGUE)
def test_bad_input_is_one_line_error(workdir, args, expected, monkeypatch, capfd):
    before = snapshot(workdir)
    proc = run_cli_in_process(args, workdir, monkeypatch, capfd)
    assert_one_line_error(proc, expected)
    after = snapshot(workdir)
    assert {k: v for k, v in after.items() if k in before} == before, "existing files changed"
    assert not (workdir / "out/listops/tiny/prepared").exists()


@needs(has_condition_monitor(), "the condition-number monitor")
def test_probe_too_small_for_full_rank_is_a_warning_in_the_history(workdir, tmp_path):
    """Not an error: the run finishes and the κ history says why no value was measured."""
    args = [*FIT, "--run_root", str(tmp_path), "--cond.every_n_steps", "4", "--cond.probe_tokens", "4"]
    args += ["--cond.method", "dense"]
    proc = run_cli(args, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "condition number not measured" in proc.stderr  # rich may wrap the rest of the line
    metrics = json.loads((tmp_path / "listops/softmax/default/seed0/metrics.json").read_text())
    reasons = [layer["reason"] for entry in metrics["cond_history"] for layer in entry["layers"]]
    assert reasons and all("probe too small to be full rank" in r for r in reasons)


def test_a_real_process_prints_the_same_one_line_error(workdir):
    """The catalogue runs in-process for speed; one entry through a real interpreter shows the
    exit status and stderr are the same there."""
    proc = run_cli([*FIT, "--init", "conditoned"], workdir)
    assert_one_line_error(proc, "unknown init 'conditoned'; valid inits: ")
