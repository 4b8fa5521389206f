"""YAML files a user gives: a key given twice, or a file that is not text, is one error line naming
the file, and nothing is written (PyYAML and jsonargparse would let the second value win)."""

from __future__ import annotations

from conftest import assert_one_line_error, run_cli_in_process

from lra_cond.yaml_files import duplicate_key


def test_duplicate_keys_are_found_at_any_depth():
    assert duplicate_key("a: 1\nb:\n  c: 2\n  d: [1, {e: 1, f: 2}]\n") is None
    assert duplicate_key("a: 1\na: 2\n") == "'a' on line 2"
    assert duplicate_key("model:\n  lr: 1\n  dim: 4\n  lr: 2\n") == "'lr' on line 4"
    assert duplicate_key("xs:\n  - {k: 1, k: 2}\n") == "'k' on line 2"
    assert duplicate_key("a: [1\n") is None  # malformed: the loader says so itself


def test_fit_config_with_a_key_twice_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capfd):
    (tmp_path / "mine.yaml").write_text("model:\n  lr: 0.001\n  lr: 0.01\n")
    proc = run_cli_in_process(
        ["fit", "--task", "listops", "--config", "mine.yaml"], tmp_path, monkeypatch, capfd
    )
    assert_one_line_error(proc, "--config mine.yaml: a YAML key is given twice: 'lr' on line 3; keep one")
    assert [p.name for p in tmp_path.iterdir()] == ["mine.yaml"]


def test_fit_config_that_is_not_text_is_one_line(tmp_path, monkeypatch, capfd):
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    proc = run_cli_in_process(
        ["fit", "--task", "listops", "--config=binary.yaml"], tmp_path, monkeypatch, capfd
    )
    assert_one_line_error(proc, "--config binary.yaml is not a YAML text file (not UTF-8 at byte 128)")


def test_a_yaml_option_value_with_a_key_twice_is_refused(tmp_path, monkeypatch, capfd):
    """Refused rather than read as its second value (jsonargparse words the error)."""
    args = ["fit", "--task", "listops", "--attention", "nystrom"]
    args += ["--model.attention_args", '{"num_landmarks": 8, "num_landmarks": 16}']
    proc = run_cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert_one_line_error(proc, 'Parser key "model.attention_args"')
    assert not (tmp_path / "runs").exists()


def test_study_config_with_a_key_twice_is_one_line(tmp_path, monkeypatch, capfd):
    (tmp_path / "study.yaml").write_text("task: listops\nseeds: [0]\ntask: text\n")
    proc = run_cli_in_process(["compare", "--config", "study.yaml", "--plan"], tmp_path, monkeypatch, capfd)
    assert_one_line_error(proc, "a YAML key is given twice: 'task' on line 3")
    assert proc.stdout == ""
