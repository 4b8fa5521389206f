"""The committed study records (results/): ``report`` rebuilds the report from them alone, and the
README's results table is that report's table, number for number."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO

from lra_cond.report.build import rebuild_report

README_BLOCK = re.compile(r"<!-- results: (\S+) -->\n(.*?)\n\n", re.S)


def readme_blocks() -> list[tuple[str, str]]:
    return README_BLOCK.findall((REPO / "README.md").read_text())


def studies() -> list[Path]:
    """Every results/<task>/<attention>/ folder holding run records."""
    return sorted({p.parents[2] for p in (REPO / "results").glob("*/*/*/seed*/metrics.json")})


def test_every_committed_study_has_its_table_in_the_readme_and_back():
    shown = {folder for folder, _ in readme_blocks()}
    assert shown == {str(p.relative_to(REPO)) for p in studies()}


@pytest.mark.parametrize("folder, table", readme_blocks())
def test_readme_table_is_the_report_rebuilt_from_the_records(folder, table, tmp_path):
    records = tmp_path / Path(folder).name
    shutil.copytree(REPO / folder, records, ignore=shutil.ignore_patterns("compare"))
    for run in records.glob("*/seed*"):  # a record is what a run folder keeps besides checkpoints
        assert {p.name for p in run.iterdir()} <= {"config.yaml", "metrics.json"} | {
            p.name for p in run.glob("events.out.tfevents.*")
        }, run
        assert not (run / "checkpoints").exists()
    report = rebuild_report(records).read_text()
    results = report.split("## Results\n\n", 1)[1].split("\n\n", 1)[0]
    assert table.strip() == results.strip()
