"""What --help shows: the commands, the shortcuts --task/--attention/--init with their valid names,
every command's defaults, plain text (no reStructuredText), and the program name as invoked."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import run_cli_in_process

from lra_cond.data.tasks import TASKS
from lra_cond.init import INITS
from lra_cond.models.attention import ATTENTIONS

# reStructuredText roles, literals and links, as docstrings write them.
RST = re.compile(r":(class|func|meth|mod|attr):`|``|`_\b|`[^`]+`_")


def help_of(args, tmp_path, monkeypatch, capfd) -> str:
    proc = run_cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not RST.search(proc.stdout), RST.search(proc.stdout)
    return proc.stdout


def words_after(text: str, label: str) -> set[str]:
    """The comma-separated names after ``label`` up to the next bracket or parenthesis, across lines."""
    flat = " ".join(text.split())
    start = flat.index(label) + len(label)
    return {w.strip() for w in re.split(r"[\[(]", flat[start:], maxsplit=1)[0].split(",")}


def test_top_level_help_lists_commands_shortcuts_and_valid_names(tmp_path, monkeypatch, capfd):
    out = help_of(["--help"], tmp_path, monkeypatch, capfd)
    lines = out.splitlines()
    assert lines[0] == "usage: python -m lra_cond COMMAND [options]"
    assert len(lines) <= 40
    section = lines[lines.index("commands:") + 1 :]
    commands = {line.split()[0] for line in section[: section.index("")]}
    assert commands == {"fit", "validate", "test", "prepare", "compare", "report", "bench"}
    assert words_after(out, "--task TASK one of:") == set(TASKS.names())
    assert words_after(out, "--attention NAME one of:") == set(ATTENTIONS.names())
    assert words_after(out, "--init NAME one of:") == set(INITS.names())
    flat = " ".join(out.split())
    assert "~/.cache/lra_cond" in flat and f"(here: {tmp_path / 'data'})" in flat  # $LRA_DATA of the helper


def test_the_program_name_is_the_one_invoked(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/lra-cond", "--help"])
    assert help_of(["--help"], tmp_path, monkeypatch, capfd).startswith("usage: lra-cond COMMAND")
    compare = help_of(["compare", "--help"], tmp_path, monkeypatch, capfd)
    assert compare.startswith("usage: lra-cond compare")
    monkeypatch.setattr(sys, "argv", ["/x/lra_cond/__main__.py"])
    assert help_of(["bench", "--help"], tmp_path, monkeypatch, capfd).startswith(
        "usage: python -m lra_cond bench"
    )


def test_fit_help_is_short_with_the_shortcuts_and_this_command_lines_values(tmp_path, monkeypatch, capfd):
    args = ["fit", "--task", "listops", "--attention", "nystrom", "--data.preset", "tiny", "--help"]
    out = help_of(args, tmp_path, monkeypatch, capfd)
    lines = out.splitlines()
    assert lines[0] == "usage: python -m lra_cond fit --task TASK [--attention NAME] [--init NAME] [options]"
    assert len(lines) <= 60
    assert words_after(out, "--init NAME one of:") == set(INITS.names())
    assert words_after(out, "--attention NAME one of:") == set(ATTENTIONS.names())
    flat = " ".join(out.split())
    # Values from configs/listops.yaml and the flags, not the bare defaults of the classes.
    assert "optimizer steps to train [5000]" in flat and "examples per batch [32]" in flat
    assert "[nystrom]" in flat and "(tiny: a smoke test) [tiny]" in flat
    assert "0 switches the monitor off (faster) [1500]" in flat
    assert "--trainer.accelerator gpu --trainer.devices 1" in flat
    assert "run folder of this command: runs/listops-tiny/nystrom/default/seed0" in out
    assert (
        lines[-1]
        == "all options (Lightning's trainer, model, data, callbacks): python -m lra_cond fit --help-all"
    )


def test_fit_help_all_is_lightnings_list_in_plain_text_with_the_valid_names(tmp_path, monkeypatch, capfd):
    out = help_of(["fit", "--help-all"], tmp_path, monkeypatch, capfd)
    assert out.startswith("usage: python -m lra_cond fit [-c CONFIG]")
    assert "Shortcuts: --task TASK" in out
    flat = " ".join(out.split())
    init_help = flat[flat.index("--model.init INIT init scheme name") :]
    names = init_help[init_help.index("One of:") + 7 : init_help.index(".", init_help.index("One of:") + 7)]
    assert {n.strip() for n in names.replace("- ", "-").split(",")} == set(INITS.names())
    assert "--run_name RUN_NAME" in out and "--trainer.max_steps" in out


@pytest.mark.parametrize(
    "command, defaults",
    [
        (
            ["compare"],
            ["(default: default,conditioned)", "(default: 0,1,2)", "(default: softmax)", "(default: runs)"],
        ),
        (["prepare"], ["(default: full)", "(default: $LRA_DATA, else ~/.cache/lra_cond)", "(default: 0)"]),
        (
            ["bench"],
            ["(default: listops)", "(default: 10)", "(default: 2)", "(default: cpu)", "(default: full)"],
        ),
    ],
)
def test_other_commands_show_their_defaults_in_plain_text(command, defaults, tmp_path, monkeypatch, capfd):
    out = " ".join(help_of([*command, "--help"], tmp_path, monkeypatch, capfd).split())
    for text in defaults:
        assert text in out, text
    assert "(default: None)" not in out and "(default: False)" not in out
