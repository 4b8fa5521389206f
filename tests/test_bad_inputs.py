"""The catalogue of bad inputs (README "Bad input"): each is one ``error:`` line on stderr, exit
status 2, no traceback, and the working folder (data, earlier runs) is the same before and after:
every file has the same sha256 and nothing was added or removed. Entries that need a feature from
another part of the suite (an attention family, an init scheme, the condition-number monitor) are
skipped, with the reason, until it exists.

Classes (issue 16): options checked at the edge (ranges, checkpoints, trainer, seed; ``compare``,
``report`` and ``bench`` errors in the same format); a prepared cache replaced only by a good one;
a run that would train nothing; and, against a real finished run, a run folder that keeps
describing its run and a checkpoint that must match the command. Races: two ``fit``s into one
folder, three ``prepare``s into one cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, TINY_FIT, assert_one_line_error, run_cli, run_cli_in_process

from lra_cond import run_dir
from lra_cond.data import cache
from lra_cond.data.tasks import TASKS
from lra_cond.init import INITS
from lra_cond.models.attention import ATTENTIONS

FIT = ["fit", "--task", "listops", *TINY_FIT]
PREPARE = ["prepare", "--task", "listops", "--preset", "tiny", "--data-dir", "out"]
OVER_GOOD = ["prepare", "--task", "listops", "--preset", "tiny", "--data-dir", "data"]
HEADER = "Source\tTarget\n"
GOOD_ROW = "( ( ( [MAX 2 ) 9 ) ] )\t9\n"
LONG_ROW = "[SM " + "1 " * 2100 + "]\t3\n"  # 2102 tokens


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
        "a one-step onecycle warm-up",
        [*FIT, "--model.warmup_steps", "1"],
        "model.warmup_steps=1 leaves the onecycle schedule no rise",
    ),
    entry(
        "no step or epoch limit",
        [*FIT, "--trainer.max_steps", "-1", "--trainer.max_epochs", "-1"],
        "the lr schedule needs a finite number of training steps",
    ),
    entry("unknown schedule", [*FIT, "--model.schedule", "cosine"], "unknown schedule 'cosine'; valid"),
    entry("run name with a slash", [*FIT, "--run_name", "a/b"], "run_name 'a/b' must be one folder name"),
    entry(
        "compare with a hidden run name",
        ["compare", "--task", "listops", "--run_name", ".x", "--plan"],
        "run_name '.x' must be one folder name",
    ),
    entry("zero checkpoint cadence", [*FIT, "--checkpoint_every", "0"], "checkpoint_every must be positive"),
    entry("heads do not divide dim", [*FIT, "--model.num_heads", "3"], "num_heads=3 does not divide dim=64"),
    entry(
        "landmarks > maximum length",
        [*FIT, "--attention", "nystrom", "--model.attention_args", '{"num_landmarks": 4000}'],
        "num_landmarks=4000 exceeds the model's maximum sequence length 2000",
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
    # --- options checked at the edge, with the valid range (were tracebacks or silent damage) ---
    entry(
        "dropout above 1", [*FIT, "--model.dropout", "1.5"], "model.dropout must be in [0, 1) (a probability)"
    ),
    entry("negative dropout", [*FIT, "--model.dropout", "-0.1"], "model.dropout must be in [0, 1)"),
    entry("zero AdamW eps", [*FIT, "--model.eps", "0"], "model.eps must be positive"),
    entry(
        "beta outside [0, 1)", [*FIT, "--model.betas", "[1.5, 0.999]"], "model.betas must be two numbers in"
    ),
    entry("negative weight decay", [*FIT, "--model.weight_decay", "-1"], "model.weight_decay must be >= 0"),
    entry("zero head_dim", [*FIT, "--model.head_dim", "0"], "model.head_dim must be positive, got 0"),
    entry(
        "zero validation interval",
        [*FIT, "--trainer.val_check_interval", "0"],
        "val_check_interval must be >= 1",
    ),
    entry(
        "validation fraction above 1",
        [*FIT, "--trainer.val_check_interval", "1.5"],
        "a fraction of an epoch in (0, 1], got 1.5",
    ),
    entry(
        "time-based validation interval",
        [*FIT, "--trainer.val_check_interval", "00:01:00"],
        "got 00:01:00 (a time-based cadence is not supported)",
    ),
    entry(
        "zero gradient accumulation", [*FIT, "--trainer.accumulate_grad_batches", "0"], "must be >= 1, got 0"
    ),
    entry(
        "negative seed", [*FIT, "--seed_everything", "-1"], "seed_everything must be in 0..4294967295, got -1"
    ),
    entry(
        "seed above 2**32 - 1", [*FIT, "--seed_everything", "4294967296"], "seed_everything must be in 0.."
    ),
    entry(
        "fit without a seed",
        [*FIT, "--seed_everything", "false"],
        "fit needs a seed: its run folder is seed<N>",
    ),
    entry(
        "unknown strategy", [*FIT, "--trainer.strategy", "bogus"], "trainer options: You selected an invalid"
    ),
    entry(
        "zero CPU devices",
        [*FIT, "--trainer.accelerator", "cpu", "--trainer.devices", "0"],
        "trainer options: `Trainer(devices=",
    ),
    entry(
        "fit without its logger", [*FIT, "--trainer.logger", "false"], "fit writes its run folder through its"
    ),
    entry(
        "run root that is a file",
        [*FIT, "--run_root", "small_source/basic_train.tsv"],
        "run_root small_source/basic_train.tsv is not a directory",
    ),
    entry(
        "missing checkpoint (fit)", [*FIT, "--ckpt_path", "nosuch.ckpt"], "--ckpt_path nosuch.ckpt: no such"
    ),
    entry(
        "missing checkpoint (validate)",
        ["validate", "--task", "listops", *TINY_FIT, "--ckpt_path", "nosuch.ckpt"],
        "--ckpt_path nosuch.ckpt: no such checkpoint file",
    ),
    entry(
        "truncated checkpoint",
        [*FIT, "--ckpt_path", "truncated.ckpt"],
        "--ckpt_path truncated.ckpt is not a readable checkpoint (PytorchStreamReader failed",
    ),
    entry(
        "a torch file that is not a checkpoint",
        ["test", "--task", "listops", *TINY_FIT, "--ckpt_path", "plain.ckpt"],
        "is not a checkpoint written by this suite's fit (it has no state_dict or hyper_parameters)",
    ),
    entry("checkpoint path is a folder", [*FIT, "--ckpt_path", "data"], "--ckpt_path data is a directory"),
    entry("Lightning's 'best'", [*FIT, "--ckpt_path", "best"], "--ckpt_path best is not supported"),
    entry(
        "re-run command with a space in the path",
        ["fit", "--task", "text", "--data.data_dir", "my data"],
        "run: python -m lra_cond prepare --task text --preset full --data-dir 'my data'",
        needs("text" in TASKS, "the text task"),
    ),
    entry(
        "damaged metrics.json as target",
        [*FIT, "--target.from_run", "damaged_json/listops-tiny/softmax/default/seed0", "--run_root", "fresh"],
        "damaged_json/listops-tiny/softmax/default/seed0/metrics.json is not valid JSON",
    ),
    entry("compare without --task", ["compare"], "the following arguments are required: --task (see: python"),
    entry(
        "compare with a misspelt fit option",
        ["compare", "--task", "listops", "--trainer.max_stepz", "3"],
        "unrecognized arguments: --trainer.max_stepz 3 (see: python -m lra_cond compare --help)",
    ),
    entry(
        "compare with a bad fit option",
        ["compare", "--task", "listops", "--model.lr", "0"],
        "model.lr must be",
    ),
    entry(
        "compare where no fit would validate",
        ["compare", "--task", "listops", *TINY_FIT, "--trainer.val_check_interval", "100"],
        "no fit of this compare would validate (trainer.val_check_interval 100 is more than "
        "trainer.max_steps 8), so the report",
    ),
    entry(
        "compare with a bad seed",
        ["compare", "--task", "listops", "--seeds", "-1"],
        "seed_everything must be",
    ),
    entry(
        "data dir inside a prepared cache",
        [*FIT, "--data.data_dir", "data/listops/tiny/prepared"],
        "data dir data/listops/tiny/prepared is a prepared cache or part of one",
    ),
    entry(
        "prepare into a task folder of a cache",
        ["prepare", "--task", "listops", "--preset", "tiny", "--data-dir", "data/listops"],
        "data dir data/listops is a prepared cache or part of one",
    ),
    entry(
        "a probe too large for the machine",
        [*FIT, "--cond.probe_tokens", "100000"],
        "cond.probe_tokens must be in 1..2048, got 100000",
    ),
    entry(
        "a null-space tolerance out of range", [*FIT, "--cond.rtol", "0.5"], "cond.rtol must be in (0, 1e-3)"
    ),
    entry("more prepare workers than cores", [*PREPARE, "--workers", "4096"], "got 4096"),
    entry(
        "a bench shape larger than memory",
        ["bench", "--attention", "softmax", "--seq-len", "1000000", "--batch-size", "64"],
        "bench: 64 x 1000000 tokens need about 953.7 GB to train",
    ),
    entry(
        "several nodes without a cluster",
        [*FIT, "--trainer.num_nodes", "2"],
        "trainer.num_nodes 2 needs a cluster launcher",
    ),
    entry(
        "misspelt target metric",
        [*FIT, "--target.acc", "0.3", "--target.metric", "val/accuracy"],
        "unknown target.metric 'val/accuracy'; valid metrics: val/acc",
    ),
    entry(
        "compare --plan with a fit option fit refuses",
        ["compare", "--task", "listops", "--model.lr", "0", "--plan"],
        "model.lr must be positive, got 0.0",
    ),
    entry(
        "compare with a fit option that sets the attention",
        ["compare", "--task", "listops", "--model.attention", "linear", "--plan"],
        "--model.attention is set by compare itself",
    ),
    entry(
        "compare over a run that stopped before its first checkpoint",
        [
            "compare",
            "--task",
            "listops",
            "--inits",
            "default",
            "--seeds",
            "0",
            *TINY_FIT,
            "--run_root",
            "stopped",
        ],
        "holds a run that stopped before its first checkpoint (non-finite loss (nan) at step 2): there is",
    ),
    entry(
        "report without a folder", ["report"], "the following arguments are required: runs_dir (see: python"
    ),
    entry(
        "report of a damaged metrics.json",
        ["report", "damaged_json/listops-tiny/softmax"],
        "damaged_json/listops-tiny/softmax/default/seed0/metrics.json is not valid JSON",
    ),
    entry(
        "report of a metrics.json of the wrong type",
        ["report", "damaged_type/listops-tiny/softmax"],
        "metrics.json: test_acc = 'high' is not a float | None; the run folder is damaged",
    ),
    entry(
        "report of a damaged config.yaml",
        ["report", "damaged_yaml/listops-tiny/softmax"],
        "damaged_yaml/listops-tiny/softmax/default/seed0/config.yaml is not valid YAML",
    ),
    entry(
        "bench with a non-integer",
        ["bench", "--seq-len", "x"],
        "argument --seq-len: invalid int value: 'x' (see:",
    ),
    entry(
        "zero prepare workers",
        [*PREPARE, "--workers", "0"],
        "--workers must be in 1..",
    ),
    # --- a run that would train nothing (was a "finished" run with a test accuracy) ---
    entry(
        "batch larger than the train split",
        [*FIT, "--data.batch_size", "1024", "--run_root", "fresh"],
        "data.batch_size 1024 is larger than the train split of listops (tiny): 512 examples, so training "
        "would run 0 steps; choose --data.batch_size <= 512",
    ),
    entry("zero epochs", [*FIT, "--trainer.max_epochs", "0"], "trainer.max_epochs must be positive"),
    entry(
        "warm-up as long as the epochs",
        [*FIT, "--trainer.max_steps", "-1", "--trainer.max_epochs", "1", "--model.warmup_steps", "16"]
        + ["--run_root", "fresh"],
        "model.warmup_steps=16 must be less than the 16 training steps (max_epochs x batches per epoch)",
    ),
    entry(
        "no training batches",
        [*FIT, "--trainer.limit_train_batches", "0"],
        "trainer.limit_train_batches must be a whole number of batches >= 1",
    ),
    # --- a good cache is replaced only by a good one (these prepare over the good cache in data/) ---
    entry(
        "empty train file", [*OVER_GOOD, "--source", "empty_file"], "the train split is empty (0 examples)"
    ),
    entry("header-only train file", [*OVER_GOOD, "--source", "header_only"], "the train split is empty"),
    entry("header-only val file", [*OVER_GOOD, "--source", "no_val"], "the val split is empty (0 examples)"),
    entry(
        "row longer than the model's positions",
        [*OVER_GOOD, "--source", "too_long"],
        "too_long/basic_train.tsv:3: 2102 tokens, more than ListOps' maximum length 2000",
    ),
    entry(
        "row without tokens",
        [*OVER_GOOD, "--source", "no_tokens"],
        "no_tokens/basic_train.tsv:3: the expression",
    ),
    entry(
        "label out of range",
        [*OVER_GOOD, "--source", "big_label"],
        "big_label/basic_train.tsv:2: label 12 is out",
    ),
    entry(
        "cache copied to the wrong preset",
        [*FIT, "--data.data_dir", "wrong_preset", "--data.preset", "full"],
        "was built for preset 'tiny' (its manifest.json), not 'full': it was copied or moved",
    ),
    entry(
        "old cache with an empty split",
        [*FIT, "--data.data_dir", "empty_cache"],
        "/prepared has an empty train split (0 examples); re-run: python -m lra_cond prepare",
    ),
    entry(
        "old cache with an over-long row",
        [*FIT, "--data.data_dir", "long_cache"],
        "has 2100 tokens, more than the task's maximum length 2000 (the model's position table); re-run:",
    ),
]


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file below ``root``, and every folder (so an added empty folder shows too)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
        for p in sorted(root.rglob("*"))
    }


def write_source(
    folder: Path, train: str, val: str = HEADER + GOOD_ROW, test: str = HEADER + GOOD_ROW
) -> None:
    folder.mkdir(parents=True)
    for split, body in (("train", train), ("val", val), ("test", test)):
        (folder / f"basic_{split}.tsv").write_text(body)


def damaged_run(root: Path, metrics: str, config: str = "model:\n  lr: 0.001\n") -> None:
    run = root / "listops-tiny/softmax/default/seed0"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(metrics)
    (run / "config.yaml").write_text(config)


def old_cache(root: Path, train_ids: list, train_labels: list) -> None:
    """A cache as written before splits were checked (no limits)."""
    good = {"input_ids": [torch.tensor([1, 2]).numpy().astype("int16")], "label": [1]}
    splits = {"train": {"input_ids": train_ids, "label": train_labels}, "val": good, "test": good}
    manifest = {"task": "listops", "preset": "tiny", "source": "hand-written"}
    cache.save_prepared(cache.prepared_dir(root, "listops", "tiny"), splits, manifest)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_listops) -> Path:
    """Data, an earlier run's folder, broken sources, a corrupt cache and a small teacher."""
    cwd = tmp_path_factory.mktemp("bad_inputs")
    shutil.copytree(tiny_listops, cwd / "data")
    earlier = cwd / "runs/listops-tiny/softmax/default/seed0"
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
        from lra_cond.training.module import LraModel

        small = LraModel(dim=32, num_heads=2, mlp_dim=64)
        teacher = {"state_dict": small.state_dict(), "hyper_parameters": dict(small.hparams)}
        torch.save(teacher, cwd / "small_teacher.ckpt")
    # Checkpoint-shaped files that are not checkpoints.
    torch.save({"weights": torch.zeros(4)}, cwd / "plain.ckpt")
    (cwd / "truncated.ckpt").write_bytes((cwd / "plain.ckpt").read_bytes()[:200])
    # Sources that must not replace the good cache in data/.
    write_source(cwd / "small_source", HEADER + GOOD_ROW * 40, HEADER + GOOD_ROW * 4, HEADER + GOOD_ROW * 4)
    write_source(cwd / "empty_file", "")
    write_source(cwd / "header_only", HEADER)
    write_source(cwd / "no_val", HEADER + GOOD_ROW, val=HEADER)
    write_source(cwd / "too_long", HEADER + GOOD_ROW + LONG_ROW)
    write_source(cwd / "no_tokens", HEADER + GOOD_ROW + "( )\t3\n")
    write_source(cwd / "big_label", HEADER + "( [MAX 2 ] )\t12\n")
    # Caches that must be refused on load.
    shutil.copytree(tiny_listops / "listops/tiny", cwd / "wrong_preset/listops/full")
    old_cache(cwd / "empty_cache", [], [])
    old_cache(cwd / "long_cache", [torch.ones(2100, dtype=torch.int16).numpy()], [1])
    # A compare run folder that stopped before its first checkpoint (same config as compare's fit).
    from lra_cond.training.compare import fit_args, resolved_config

    stopped = cwd / "stopped/listops-tiny/softmax/default/seed0"
    config = resolved_config(
        fit_args("listops", "softmax", "default", 0, [*TINY_FIT, "--run_root", "stopped"])
    )
    damaged_run(
        cwd / "stopped", json.dumps({"stopped": "non-finite loss (nan) at step 2"}), yaml.safe_dump(config)
    )
    assert (stopped / "config.yaml").is_file()
    # Run folders whose files were damaged by hand.
    damaged_run(cwd / "damaged_json", "{not json")
    damaged_run(cwd / "damaged_type", json.dumps({"test_acc": "high", "total_steps": 4}))
    damaged_run(cwd / "damaged_yaml", json.dumps({"test_acc": 0.5, "total_steps": 4}), "model: [unclosed\n")
    return cwd


@pytest.mark.parametrize("args, expected", CATALOGUE)
def test_bad_input_is_one_line_error(workdir, args, expected, monkeypatch, capfd):
    before = snapshot(workdir)
    proc = run_cli_in_process(args, workdir, monkeypatch, capfd)
    assert_one_line_error(proc, expected)
    after = snapshot(workdir)
    assert {k: v for k, v in after.items() if k in before} == before, "existing files changed"
    assert after == before, f"files or folders added: {sorted(set(after) - set(before))}"
    assert not (workdir / "out/listops/tiny/prepared").exists()


@needs(has_condition_monitor(), "the condition-number monitor")
def test_probe_too_small_for_full_rank_is_a_warning_in_the_history(workdir, tmp_path):
    """Not an error: the run finishes and the κ history says why no value was measured."""
    args = [*FIT, "--run_root", str(tmp_path), "--cond.every_n_steps", "4", "--cond.probe_tokens", "4"]
    args += ["--cond.method", "dense"]
    proc = run_cli(args, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "condition number not measured" in proc.stderr  # rich may wrap the rest of the line
    metrics = json.loads((tmp_path / "listops-tiny/softmax/default/seed0/metrics.json").read_text())
    reasons = [layer["reason"] for entry in metrics["cond_history"] for layer in entry["layers"]]
    assert reasons and all("probe too small to be full rank" in r for r in reasons)


def test_a_real_process_prints_the_same_one_line_error(workdir):
    """The catalogue runs in-process for speed; one entry through a real interpreter shows the
    exit status and stderr are the same there."""
    proc = run_cli([*FIT, "--init", "conditoned"], workdir)
    assert_one_line_error(proc, "unknown init 'conditoned'; valid inits: ")


# --- against a real finished run: the run folder keeps describing its run, checkpoints must match ---

SMALL = [*TINY_FIT, "--model.dim", "16", "--model.mlp_dim", "32", "--model.lr", "1e-3"]
RUN_FIT = ["fit", "--task", "listops", *SMALL]
RUN = Path("runs/listops-tiny/softmax/default/seed0")


def runs_at(root: str) -> Path:
    return Path(root) / "listops-tiny/softmax/default/seed0"


def without_test_acc(folder: Path) -> None:
    """An interrupted run: its metrics.json has no test accuracy yet."""
    metrics = json.loads((folder / "metrics.json").read_text())
    for key in ("test_acc", "test_ckpt"):
        metrics.pop(key)
    (folder / "metrics.json").write_text(json.dumps(metrics))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tiny_listops) -> Path:
    """A finished tiny run (a real fit) and folders derived from it: interrupted (no test accuracy),
    moved without its best checkpoint, stopped before its first checkpoint; a 'full' cache made from
    a small source, and tiny data from another seed."""
    cwd = tmp_path_factory.mktemp("fitted")
    shutil.copytree(tiny_listops, cwd / "data")
    proc = run_cli(RUN_FIT, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(cwd / RUN, cwd / runs_at("unfinished"))
    without_test_acc(cwd / runs_at("unfinished"))
    shutil.copytree(cwd / RUN, cwd / runs_at("partial"))
    without_test_acc(cwd / runs_at("partial"))
    for best in (cwd / runs_at("partial") / "checkpoints").glob("best-*.ckpt"):
        best.unlink()
    shutil.copytree(cwd / RUN, cwd / runs_at("noconfig"))
    without_test_acc(cwd / runs_at("noconfig"))
    (cwd / runs_at("noconfig") / "config.yaml").unlink()
    started = cwd / runs_at("started")
    started.mkdir(parents=True)
    shutil.copy(cwd / RUN / "config.yaml", started / "config.yaml")
    (started / "metrics.json").write_text(json.dumps({"stopped": "non-finite loss (nan) at step 2"}))
    write_source(cwd / "full_source", HEADER + GOOD_ROW * 40, HEADER + GOOD_ROW * 4, HEADER + GOOD_ROW * 4)
    TASKS.get("listops").prepare(cwd / "data", "full", source=cwd / "full_source")
    TASKS.get("listops").prepare(cwd / "other", "tiny", seed=1, workers=1)
    return cwd


def best_name(cwd: Path) -> str:
    return f"best-step{json.loads((cwd / RUN / 'metrics.json').read_text())['best_val_step']}.ckpt"


VALIDATE = ["validate", "--task", "listops", *SMALL]
TEST = ["test", "--task", "listops", *SMALL]
LAST = ["--ckpt_path", "last"]
# name, command line (BEST = the run's best checkpoint), expected text of the one error line
RUN_CASES = [
    entry(
        "validate a missing checkpoint", [*VALIDATE, "--ckpt_path", "nosuch.ckpt"], "no such checkpoint file"
    ),
    entry(
        "rerun with another lr",
        [*RUN_FIT, "--model.lr", "3e-3"],
        "already holds a finished run (test accuracy",
    ),
    entry("rerun the same command", RUN_FIT, f"{RUN} already holds a finished run"),
    entry(
        # listops + run name "tiny" names the folder of the tiny preset's run
        "full preset into the tiny run's folder",
        [*RUN_FIT, "--data.preset", "full", "--run_name", "tiny"],
        "with other options (data.preset); to keep it, start this run elsewhere with --run_root DIR",
    ),
    entry(
        "full preset resumes the tiny run's checkpoint",
        [*RUN_FIT, "--data.preset", "full", "--run_name", "tiny", "--run_root", "unfinished", *LAST],
        "this command changes data.preset, which a resume may not change",
    ),
    entry("resume a finished run", [*RUN_FIT, *LAST], "finished run (test accuracy"),
    entry(
        "fit from the best checkpoint",
        [*RUN_FIT, "--ckpt_path", "BEST"],
        "fit resumes a run from its own last",
    ),
    entry(
        "nystrom from a softmax checkpoint",
        [*RUN_FIT, "--attention", "nystrom", "--ckpt_path", str(RUN / "checkpoints/last.ckpt")],
        'other model options than this command: model.attention (checkpoint "softmax", command "nystrom")',
    ),
    entry(
        "another init from this run's checkpoint",
        [*RUN_FIT, "--init", "conditioned", "--ckpt_path", str(RUN / "checkpoints/last.ckpt")],
        'model.init (checkpoint "default", command "conditioned")',
    ),
    entry(
        "validate with another width",
        [*VALIDATE, "--model.dim", "32", "--ckpt_path", "BEST"],
        "model.dim (checkpoint 16, command 32)",
    ),
    entry(
        "test on another task",
        ["test", "--task", "text", *SMALL, "--ckpt_path", "BEST"],
        'model.task (checkpoint "listops", command "text")',
        needs("text" in TASKS, "the text task"),
    ),
    entry(
        "resume with a new lr",
        [*RUN_FIT, "--model.lr", "3e-3", "--run_root", "unfinished", *LAST],
        "model.lr (checkpoint 0.001, command 0.003)",
    ),
    entry(
        "resume with more steps",
        [*RUN_FIT, "--trainer.max_steps", "12", "--run_root", "unfinished", *LAST],
        "this command changes trainer.max_steps, which a resume may not change",
    ),
    entry(
        "resume with another batch",
        [*RUN_FIT, "--data.batch_size", "16", "--run_root", "unfinished", *LAST],
        "this command changes data.batch_size, which a resume may not change",
    ),
    entry(
        "resume on other data",
        [*RUN_FIT, "--data.data_dir", "other", "--run_root", "unfinished", *LAST],
        "is not the data this run started with (it was prepared again since",
    ),
    entry(
        "new run into an interrupted one",
        [*RUN_FIT, "--run_root", "unfinished"],
        "already holds an unfinished run with a last checkpoint; resume it with --ckpt_path last",
    ),
    entry(
        "resume a run that stopped before its first checkpoint",
        [*RUN_FIT, "--run_root", "started", *LAST],
        "stopped before its first checkpoint (non-finite loss (nan) at step 2); nothing to resume",
    ),
    entry(
        "resume a run whose config.yaml was deleted",
        [*RUN_FIT, "--trainer.max_steps", "40", "--run_root", "noconfig", *LAST],
        "it has checkpoints but no config.yaml, so this command's options cannot be checked",
    ),
    entry(
        "moved without its best checkpoint",
        [*RUN_FIT, "--run_root", "partial", *LAST],
        "(recorded in last.ckpt) is not in partial/listops-tiny/softmax/default/seed0/checkpoints",
    ),
    entry(
        "test the last checkpoint of a run that does not exist",
        [*TEST, "--seed_everything", "5", *LAST],
        "--ckpt_path last: there is no runs/listops-tiny/softmax/default/seed5/checkpoints/last.ckpt",
    ),
]


@pytest.mark.parametrize("args, expected", RUN_CASES)
def test_a_run_folder_keeps_describing_its_run(fitted, args, expected, monkeypatch, capfd):
    args = [str(RUN / "checkpoints" / best_name(fitted)) if a == "BEST" else a for a in args]
    before = snapshot(fitted)
    proc = run_cli_in_process(args, fitted, monkeypatch, capfd)
    assert_one_line_error(proc, expected)
    assert snapshot(fitted) == before


def test_validate_and_test_after_fit_write_nothing(fitted, monkeypatch, capfd):
    """They used to rewrite the run's config.yaml (task defaults) and its test accuracy."""
    before = snapshot(fitted)
    metrics = json.loads((fitted / RUN / "metrics.json").read_text())
    best = str(RUN / "checkpoints" / best_name(fitted))
    for args, metric in (([*VALIDATE, "--ckpt_path", best], "val/acc"), ([*TEST, *LAST], "test/acc")):
        proc = run_cli_in_process(args, fitted, monkeypatch, capfd)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert metric in proc.stdout
    assert snapshot(fitted) == before
    assert json.loads((fitted / RUN / "metrics.json").read_text())["test_acc"] == metrics["test_acc"]


def test_a_second_writer_is_refused_by_the_lock(fitted, monkeypatch, capfd):
    folder = run_dir.RunFolder(fitted / runs_at("unfinished"))
    folder.lock()  # as a fit running in another process would, once training started
    folder.mark_training()
    try:
        before = snapshot(fitted)
        proc = run_cli_in_process([*RUN_FIT, "--run_root", "unfinished", *LAST], fitted, monkeypatch, capfd)
        assert_one_line_error(proc, f"process {os.getpid()} is writing {runs_at('unfinished')} (it holds")
        assert snapshot(fitted) == before
    finally:
        folder.unlock()
    assert not (fitted / runs_at("unfinished") / run_dir.LOCK_FILE).exists()


def test_a_moved_run_resumes_with_its_best_checkpoint(fitted, monkeypatch, capfd):
    """Lightning kept the old folder's best-checkpoint path and tested that file; now the paths
    follow the folder, and the original run is untouched."""
    shutil.copytree(fitted / RUN, fitted / runs_at("moved"))
    without_test_acc(fitted / runs_at("moved"))
    run_dir.update_metrics(fitted / runs_at("moved"), stopped="non-finite loss (nan) at step 7")
    original = snapshot(fitted / "runs")
    proc = run_cli_in_process([*RUN_FIT, "--run_root", "moved", *LAST], fitted, monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {runs_at('moved') / 'checkpoints/last.ckpt'}" in proc.stderr
    resumed = json.loads((fitted / runs_at("moved") / "metrics.json").read_text())
    first = json.loads((fitted / RUN / "metrics.json").read_text())
    assert resumed["test_ckpt"] == str(runs_at("moved") / "checkpoints" / best_name(fitted))
    assert resumed["test_acc"] == pytest.approx(first["test_acc"], abs=1e-6)  # the same best checkpoint
    assert "stopped" not in resumed  # a resumed run has not ended (yet)
    assert run_dir.RunFolder(fitted / runs_at("moved")).state() is run_dir.State.FINISHED
    assert snapshot(fitted / "runs") == original
    assert not (fitted / runs_at("moved") / run_dir.LOCK_FILE).exists()


def test_a_lock_held_by_a_killed_process_is_free(tmp_path):
    """SIGKILL drops the holder's flock: its lock file stays, but the next process takes the lock."""
    from lra_cond.locks import FileLock, LockHeld

    path = tmp_path / run_dir.LOCK_FILE
    holder = "import sys, time; from lra_cond.locks import FileLock; FileLock(sys.argv[1]).acquire(); "
    holder += "print('held', flush=True); time.sleep(600)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", holder, str(path)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld) as held:
            FileLock(path).acquire()
        assert held.value.pid == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert path.exists()  # left behind by the killed holder
    lock = FileLock(path).acquire()
    assert path.read_text().split()[0] == str(os.getpid())
    lock.release()
    assert not path.exists()


def test_fast_dev_run_writes_nothing(workdir, monkeypatch, capfd):
    """A smoke run has no run folder: it used to leave checkpoints/last.ckpt in the working folder."""
    before = snapshot(workdir)
    # One step: the warm-up must be shorter than it (the schedule's own check).
    args = [*FIT, "--trainer.fast_dev_run", "true", "--model.warmup_steps", "0"]
    proc = run_cli_in_process(args, workdir, monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert snapshot(workdir) == before


def test_a_stale_lock_file_is_not_a_run(fitted, monkeypatch, capfd):
    """A SIGKILLed fit leaves its .lock (not held): the folder is still empty for a new run."""
    stale = fitted / runs_at("stale")
    stale.mkdir(parents=True)
    (stale / run_dir.LOCK_FILE).write_text("999999\ntraining\n")
    assert run_dir.RunFolder(stale).state() is run_dir.State.EMPTY
    proc = run_cli_in_process([*RUN_FIT, "--run_root", "stale"], fitted, monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_dir.RunFolder(stale).state() is run_dir.State.FINISHED
    assert not (stale / run_dir.LOCK_FILE).exists()


def test_two_fits_into_one_folder_one_wins(fitted):
    """Two fits started at once (different lr) into one folder: one runs, the other is refused with
    one line; the folder holds the winner's files only (they used to both exit 0, mixing files)."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO), "LRA_DATA": str(fitted / "data")}
    procs = {
        lr: subprocess.Popen(
            [sys.executable, "-m", "lra_cond", *RUN_FIT, "--model.lr", lr, "--run_root", "race"],
            cwd=fitted,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for lr in ("0.001", "0.002")
    }
    results = {lr: (p.wait(timeout=600), p.stderr.read()) for lr, p in procs.items()}
    winners = [lr for lr, (rc, _) in results.items() if rc == 0]
    assert len(winners) == 1, {lr: (rc, err[-1500:]) for lr, (rc, err) in results.items()}
    (loser,) = set(results) - set(winners)
    rc, err = results[loser]
    proc = subprocess.CompletedProcess([], rc, "", err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    # Refused by the lock while the winner trains, or (if it came late) by the finished run.
    assert errors and ("is writing" in errors[0] or "already holds a finished run" in errors[0]), err[-1500:]
    assert_one_line_error(proc, str(runs_at("race")))
    folder = fitted / runs_at("race")
    config = yaml_load(folder / "config.yaml")
    assert config["model"]["lr"] == float(winners[0])
    ckpts = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert ckpts == sorted([best_name_of(folder), "last.ckpt"])  # no -v1 copies of a second writer
    assert run_dir.RunFolder(folder).state() is run_dir.State.FINISHED
    assert not (folder / run_dir.LOCK_FILE).exists()


def yaml_load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def best_name_of(folder: Path) -> str:
    return f"best-step{json.loads((folder / 'metrics.json').read_text())['best_val_step']}.ckpt"


def test_a_run_that_trained_nothing_is_not_finished(tmp_path):
    assert not run_dir.is_finished({"test_acc": 0.4, "total_steps": 0})
    assert not run_dir.is_finished({"test_acc": 0.4, "total_steps": 8, "stopped": "non-finite loss"})
    assert run_dir.is_finished({"test_acc": 0.4, "total_steps": 8})
    run_dir.update_metrics(tmp_path, test_acc=0.4, total_steps=0)
    assert run_dir.RunFolder(tmp_path).state() is run_dir.State.STARTED  # compare does not reuse it
    with pytest.raises(KeyError, match="add it to lra_cond.run_dir.Metrics"):
        run_dir.update_metrics(tmp_path, test_accuracy=0.4)


# --- prepared data: concurrent prepares take turns, and a cache is replaced only by a good one ---


def cache_bytes(root: Path) -> dict[str, str]:
    folder = cache.prepared_dir(root, "listops", "tiny")
    return {k: v for k, v in snapshot(folder).items() if k.endswith(".arrow")}


def test_three_concurrent_prepares_leave_a_good_cache(tmp_path, tiny_listops):
    """As in a SLURM array: seed 0, seed 1 and a broken source into one data dir with a good cache.
    They used to leave a corrupt cache (two of three exiting 0); now they take turns on the lock."""
    shutil.copytree(tiny_listops, tmp_path / "data")
    TASKS.get("listops").prepare(tmp_path / "seed1", "tiny", seed=1, workers=1)
    write_source(tmp_path / "broken", HEADER)
    good = {0: cache_bytes(tmp_path / "data"), 1: cache_bytes(tmp_path / "seed1")}
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO)}
    prepare = [sys.executable, "-m", "lra_cond", *OVER_GOOD, "--workers", "1"]
    commands = {"seed0": ["--seed", "0"], "seed1": ["--seed", "1"], "broken": ["--source", "broken"]}
    procs = {
        name: subprocess.Popen(
            [*prepare, *extra],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name, extra in commands.items()
    }
    results = {name: (p.wait(timeout=300), p.stderr.read()) for name, p in procs.items()}
    assert results["seed0"][0] == 0 and results["seed1"][0] == 0, results
    broken = subprocess.CompletedProcess([], *results["broken"][:1], "", results["broken"][1])
    assert_one_line_error(broken, "the train split is empty (0 examples)")
    out = cache.prepared_dir(tmp_path / "data", "listops", "tiny")
    cache.load_prepared(out, "hint", "listops", "tiny", TASKS.get("listops").limits)  # checksums too
    assert cache_bytes(tmp_path / "data") in (good[0], good[1])
    leftovers = {p.name for p in out.parent.iterdir()} - {"prepared", "source"}
    assert leftovers == set(), leftovers  # no lock file, no prepared.tmp / prepared.old


def test_a_prepare_waits_for_the_cache_lock(tmp_path, tiny_listops):
    shutil.copytree(tiny_listops, tmp_path / "data")
    before = snapshot(tmp_path / "data")
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO)}
    log = tmp_path / "stderr.txt"
    with cache.locked(tmp_path / "data", "listops", "tiny"):
        with open(log, "w") as err:
            command = [sys.executable, "-m", "lra_cond", *OVER_GOOD, "--seed", "1", "--workers", "1"]
            proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 120
        while "waiting for another prepare" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.2)
        assert f"waiting for another prepare of data/listops/tiny (pid {os.getpid()})" in log.read_text()
        time.sleep(1)
        assert proc.poll() is None  # still waiting: nothing replaced while the lock is held
        assert {k: v for k, v in snapshot(tmp_path / "data").items() if k != "listops/tiny/.lock"} == before
    assert proc.wait(timeout=300) == 0, log.read_text()[-2000:]
    assert cache_bytes(tmp_path / "data") != {k: v for k, v in before.items() if k.endswith(".arrow")}


def test_a_prepare_killed_between_its_renames_keeps_the_old_cache(tmp_path, tiny_listops, monkeypatch, capfd):
    """The previous cache sat in prepared.old; the next prepare (here a refused one) puts it back."""
    shutil.copytree(tiny_listops, tmp_path / "data")
    out = cache.prepared_dir(tmp_path / "data", "listops", "tiny")
    before = snapshot(out)
    out.rename(out.with_name("prepared.old"))
    write_source(tmp_path / "broken", HEADER)
    proc = run_cli_in_process([*OVER_GOOD, "--source", "broken"], tmp_path, monkeypatch, capfd)
    assert_one_line_error(proc, "the train split is empty")
    assert snapshot(out) == before
    assert not out.with_name("prepared.old").exists()


def test_fit_generating_missing_data_keeps_a_cache_another_process_finished(tmp_path, tiny_listops):
    """prepare(if_missing=True) (what fit calls for missing data) returns a finished cache untouched."""
    shutil.copytree(tiny_listops, tmp_path / "data")
    before = snapshot(tmp_path / "data")
    out = TASKS.get("listops").prepare(tmp_path / "data", "tiny", seed=7, workers=1, if_missing=True)
    assert out == cache.prepared_dir(tmp_path / "data", "listops", "tiny")
    assert snapshot(tmp_path / "data") == before


def test_re_run_commands_are_shell_quoted(tmp_path):
    spec = TASKS.get("listops")
    command = spec.prepare_command(tmp_path / "my data", "tiny")
    assert shlex.split(command)[-2:] == ["--data-dir", str(tmp_path / "my data")]
    manifest = {"source": str(tmp_path / "src dir"), "seed": 0}
    exact = cache.exact_prepare_command(manifest, command)
    assert shlex.split(exact)[-4:] == ["--source", str(tmp_path / "src dir"), "--seed", "0"]
