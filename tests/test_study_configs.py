"""The study configs (configs/study-listops*.yaml) through ``compare --config``: they load, every
fit they plan parses to the protocol they state, the CPU one keeps the reference's proportions,
``--plan`` prints exactly the commands the README shows, and the command line overrides the file."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from conftest import REPO, assert_one_line_error, run_cli_in_process

from lra_cond.cli import main
from lra_cond.training.compare import resolved_config

GPU, CPU = "configs/study-listops.yaml", "configs/study-listops-cpu.yaml"
INITS, SEEDS = ("default", "mimetic", "conditioned"), (0, 1, 2)


def plan(capsys: pytest.CaptureFixture, *args: str) -> list[str]:
    main(["compare", *args, "--plan"])
    return capsys.readouterr().out.splitlines()


def option(line: str, name: str) -> str:
    words = shlex.split(line)
    return words[words.index(name) + 1]


def fit_config(line: str) -> dict:
    """The config that this planned ``python -m lra_cond fit ...`` line would run with."""
    words = shlex.split(line)
    assert words[:4] == ["python", "-m", "lra_cond", "fit"]
    return resolved_config(words[3:])


@pytest.mark.parametrize(
    "study, steps, warmup, every, val_batches, run_root",
    [(GPU, 5000, 1000, 50, None, "runs"), (CPU, 500, 100, 5, 16, "runs-cpu")],
)
def test_study_plans_nine_fits_of_its_protocol(
    capsys, monkeypatch, study, steps, warmup, every, val_batches, run_root
):
    monkeypatch.chdir(REPO)  # the configs' paths are relative to the checkout, as in the README
    lines = plan(capsys, "--config", study)
    assert len(lines) == len(INITS) * len(SEEDS)
    runs = [(c["model"]["init"], c["seed_everything"]) for c in map(fit_config, (lines[0], lines[-1]))]
    assert runs == [("default", 0), ("conditioned", 2)]
    assert [option(ln, "--init") for ln in lines] == [i for _ in SEEDS for i in INITS]  # seed by seed
    assert [option(ln, "--seed_everything") for ln in lines] == [str(s) for s in SEEDS for _ in INITS]

    config = fit_config(lines[4])  # mimetic, seed 1
    assert (config["model"]["init"], config["seed_everything"]) == ("mimetic", 1)
    assert config["data"]["task"] == "listops" and config["data"]["preset"] == "full"
    assert config["model"]["attention"] == "nystrom" and config["data"]["batch_size"] == 32
    assert config["model"]["lr"] == 1e-4 and config["model"]["schedule"] == "onecycle"
    trainer = config["trainer"]
    assert (trainer["max_steps"], config["model"]["warmup_steps"]) == (steps, warmup)
    assert (trainer["val_check_interval"], trainer["limit_val_batches"]) == (every, val_batches)
    assert config["run_root"] == run_root
    # The reference's proportions: warm-up 1000 / 5000 steps, validation every 50 / 5000.
    assert warmup / steps == 1000 / 5000 and every / steps == 50 / 5000


def test_readme_shows_exactly_the_plans(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    readme = (REPO / "README.md").read_text()
    for study in (GPU, CPU):
        block = re.search(rf"<!-- plan: {re.escape(study)} -->\n```bash\n(.*?)```", readme, re.S)
        assert block, f"README has no plan block for {study}"
        assert block.group(1).splitlines() == plan(capsys, "--config", study)
        assert f"python -m lra_cond compare --config {study}\n" in readme


def test_command_line_overrides_the_study(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    lines = plan(
        capsys, "--config", CPU, "--seeds", "7", "--inits", "conditioned", "--trainer.max_steps", "150"
    )
    assert len(lines) == 1
    config = fit_config(lines[0])
    assert (config["model"]["init"], config["seed_everything"]) == ("conditioned", 7)
    assert config["trainer"]["max_steps"] == 150 and config["trainer"]["val_check_interval"] == 5
    study = yaml.safe_load((REPO / CPU).read_text())
    assert study["fit"]["trainer.max_steps"] == 500  # the file is read, not changed


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, "no such study config: missing.yaml"),
        ("task: listops\nstepz: 3\n", "unknown key 'stepz'; valid keys: task, attention, inits, seeds"),
        ("task: listops\nfit: [1, 2]\n", "'fit' must map fit options to values"),
        ("task: [listops\n", "not valid YAML"),
        ("task: listops\nfit:\n  model.init: mimetic\n", "--model.init is set by compare itself"),
    ],
)
def test_bad_study_config_is_one_line_error(tmp_path, monkeypatch, capfd, text, expected):
    if text is not None:
        (tmp_path / "missing.yaml").write_text(text)
    proc = run_cli_in_process(["compare", "--config", "missing.yaml", "--plan"], tmp_path, monkeypatch, capfd)
    assert_one_line_error(proc, expected)


def test_a_fit_config_that_sets_what_compare_owns_is_refused_before_the_plan(tmp_path, monkeypatch, capfd):
    """A study's ``fit: {config: FILE}`` whose file sets the seed would train every "seed" into one
    other seed folder: refused, before a plan is printed or a folder made."""
    (tmp_path / "seed.yaml").write_text("seed_everything: 7\n")
    (tmp_path / "study.yaml").write_text("task: listops\nfit:\n  config: seed.yaml\n")
    proc = run_cli_in_process(["compare", "--config", "study.yaml", "--plan"], tmp_path, monkeypatch, capfd)
    assert_one_line_error(proc, "the fit options set seed_everything to 7, which compare sets itself (0 for")
    assert proc.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["seed.yaml", "study.yaml"]


def test_more_seeds_run_the_study_s_protocol_on_new_seeds(capsys, monkeypatch):
    """configs/study-listops-more-seeds.yaml: the study's fits, task and run folder, its inits,
    none of its seeds (one report then covers both)."""
    monkeypatch.chdir(REPO)
    more_seeds = "configs/study-listops-more-seeds.yaml"
    study, more = (yaml.safe_load((REPO / p).read_text()) for p in (GPU, more_seeds))
    assert more["fit"] == study["fit"] and more["run_root"] == study["run_root"]
    assert (more["task"], more["attention"]) == (study["task"], study["attention"])
    assert set(more["inits"]) <= set(study["inits"]) and not set(more["seeds"]) & set(study["seeds"])
    lines = plan(capsys, "--config", more_seeds)
    assert len(lines) == len(more["inits"]) * len(more["seeds"])
    assert fit_config(lines[0]) == fit_config(
        plan(capsys, "--config", GPU)[0].replace(
            "--seed_everything 0", f"--seed_everything {more['seeds'][0]}"
        )
    )


def test_linear_study_runs_the_study_s_protocol_with_linear_attention(capsys, monkeypatch):
    """configs/study-listops-linear.yaml: the study's fits with linear attention in place of
    Nystrom, default against conditioned, in the study's run folder (its own family's subfolder)."""
    monkeypatch.chdir(REPO)
    linear = "configs/study-listops-linear.yaml"
    study, other = (yaml.safe_load((REPO / p).read_text()) for p in (GPU, linear))
    assert other["fit"] == study["fit"] and other["run_root"] == study["run_root"]
    assert (other["task"], other["attention"]) == ("listops", "linear")
    assert other["inits"] == ["default", "conditioned"]
    lines = plan(capsys, "--config", linear)
    assert len(lines) == 2 * len(other["seeds"])
    want = fit_config(plan(capsys, "--config", GPU)[0].replace("--attention nystrom", "--attention linear"))
    assert fit_config(lines[0]) == want and want["model"]["attention"] == "linear"
