"""Where data lands by default: ``$LRA_DATA``, else the per-user cache (``$XDG_CACHE_HOME`` or
``~/.cache``) + ``lra_cond``, whatever the working directory; and what a prepare prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from lra_cond.cli import main
from lra_cond.data import LraDataModule, cache


def test_lra_data_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("LRA_DATA", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_data_dir() == tmp_path / "mine"
    assert LraDataModule("listops").data_dir == tmp_path / "mine"


@pytest.mark.parametrize("lra_data", [None, ""])
def test_without_lra_data_the_user_cache(monkeypatch, tmp_path, lra_data):
    if lra_data is None:
        monkeypatch.delenv("LRA_DATA", raising=False)
    else:
        monkeypatch.setenv("LRA_DATA", lra_data)  # set but empty counts as unset
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_data_dir() == tmp_path / "xdg" / "lra_cond"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.default_data_dir() == tmp_path / "home" / ".cache" / "lra_cond"
    assert LraDataModule("listops").data_dir == tmp_path / "home" / ".cache" / "lra_cond"


def test_prepare_writes_to_the_cache_not_the_working_directory(monkeypatch, tmp_path, capfd):
    monkeypatch.delenv("LRA_DATA", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    main(["prepare", "--task", "listops", "--preset", "tiny", "--workers", "1"])
    out, err = capfd.readouterr()
    where = tmp_path / "home/.cache/lra_cond/listops/tiny/prepared"
    assert out.strip() == f"prepared listops (tiny) at {where}"
    assert cache.is_prepared(where) and not any(Path(work).iterdir())
    # One style of progress bar: Hugging Face's "Saving the dataset" tqdm bars are off.
    assert "generating ListOps trees" in err and "Saving the dataset" not in err and "it/s]" not in err


def test_tilde_is_expanded_in_lra_data_and_every_path_option(monkeypatch, tmp_path, capfd):
    """``~`` inside quotes, after ``--opt=``, or in $LRA_DATA is not expanded by a shell: the suite
    expands it, so nothing lands in a folder literally named ``~`` under the working directory."""
    import yaml
    from conftest import TINY_FIT, run_cli

    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("LRA_DATA", "~/lra")
    assert cache.default_data_dir() == home / "lra"
    monkeypatch.chdir(work)
    main(["prepare", "--task", "listops", "--preset", "tiny", "--workers", "1", "--data-dir=~/d"])
    assert capfd.readouterr().out.strip() == f"prepared listops (tiny) at {home / 'd/listops/tiny/prepared'}"
    args = ["fit", "--task", "listops", *TINY_FIT, "--data.data_dir", "~/d", "--run_root=~/runs"]
    proc = run_cli(args, work, env={"HOME": str(home), "LRA_DATA": "~/lra"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = home / "runs/listops-tiny/softmax/default/seed0"
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["run_root"] == str(home / "runs") and config["data"]["data_dir"] == str(home / "d")
    assert not any(work.iterdir()) and not (home / "lra").exists()  # no "~" folder, no second cache
