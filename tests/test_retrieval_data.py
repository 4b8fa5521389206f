"""AAN reader: pairs of raw-field byte ids, float-or-int labels, eval -> val, bad rows, atomic cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from lra_cond.data import cache
from lra_cond.data.tasks import TASKS
from lra_cond.data_prep import retrieval
from lra_cond.errors import UserError


def parse_independently(path: Path) -> list[tuple[int, list[int], list[int]]]:
    rows = []
    for line in path.read_bytes().splitlines():
        label, _, _, t1, t2 = line.split(b"\t")
        rows.append((int(float(label)), [b + 1 for b in t1[:4000]], [b + 1 for b in t2[:4000]]))
    return rows


def test_fixture_reader_reproduces_pairs(tmp_path: Path) -> None:
    root = retrieval.write_fixture(tmp_path, seed=0)
    splits, _ = retrieval.prepare(tmp_path, "full", root, seed=0, workers=1)
    for split, infix in (("train", "train"), ("val", "eval"), ("test", "test")):
        expected = parse_independently(root / f"new_aan_pairs.{infix}.tsv")
        assert len(expected) == retrieval.FIXTURE_SIZES[infix]
        got = zip(splits[split]["label"], splits[split]["input_ids"], splits[split]["input_ids2"])
        assert [(y, a.tolist(), b.tolist()) for y, a, b in got] == expected
    first = (root / "new_aan_pairs.train.tsv").read_text().splitlines()[0].split("\t")
    assert first[3].startswith("b'")  # text fields are bytes literals, kept verbatim like the reference
    assert splits["train"]["input_ids"][0][:2].tolist() == [ord("b") + 1, ord("'") + 1]
    assert sorted(set(splits["train"]["label"])) == [0, 1]


def write_tsv(folder: Path, lines: dict[str, list[str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for infix in ("train", "eval", "test"):
        rows = lines.get(infix, ["0\ta\tb\tb'x'\tb'y'"])
        (folder / f"new_aan_pairs.{infix}.tsv").write_text("\n".join(rows) + "\n")


def test_float_labels_and_truncation(tmp_path: Path) -> None:
    long = "b'" + "z" * 5000 + "'"
    rows = ["1.0\tp1\tp2\tb'ab'\t" + long, "0.0\tp3\tp4\tb''\tb'c'", "1\tp\tq\tb'x'\tb'y'"]
    write_tsv(tmp_path, {"train": rows})
    train = retrieval.read_tsv(tmp_path / "new_aan_pairs.train.tsv")
    assert train["label"] == [1, 0, 1]
    assert train["input_ids"][0].tolist() == [b + 1 for b in b"b'ab'"]
    assert len(train["input_ids2"][0]) == 4000
    assert train["input_ids2"][0].tolist() == [b + 1 for b in long.encode()[:4000]]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("1\tp1\tp2\tb'a'", "expected 5 tab-separated columns .* got 4"),
        ("yes\tp1\tp2\tb'a'\tb'b'", "label b'yes' is not a number"),
        ("0.5\tp1\tp2\tb'a'\tb'b'", "label 0.5 is not 0 or 1"),
        ("2\tp1\tp2\tb'a'\tb'b'", "label 2 is not 0 or 1"),
    ],
)
def test_malformed_row_reports_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    write_tsv(tmp_path, {"test": ["0\ta\tb\tb'x'\tb'y'", line]})
    with pytest.raises(UserError, match=message) as err:
        retrieval.read_release(tmp_path)
    assert "new_aan_pairs.test.tsv:2:" in str(err.value)


def test_failed_prepare_keeps_previous_cache(tmp_path: Path) -> None:
    source = retrieval.write_fixture(tmp_path, seed=0)
    data = tmp_path / "data"
    TASKS.get("retrieval").prepare(data, "full", source=source)
    prepared = cache.prepared_dir(data, "retrieval", "full")
    before = cache.load_prepared(prepared, "hint")["train"]["label"]
    with open(source / "new_aan_pairs.test.tsv", "a") as f:
        f.write("1\tonly-three\tcolumns\n")
    with pytest.raises(UserError, match=r"new_aan_pairs.test.tsv:17:"):
        TASKS.get("retrieval").prepare(data, "full", source=source)
    assert cache.load_prepared(prepared, "hint")["train"]["label"] == before
    assert sorted(p.name for p in prepared.parent.iterdir()) == ["prepared"]  # no tmp leftovers


def test_missing_files_and_no_source_say_what_to_download(tmp_path: Path) -> None:
    write_tsv(tmp_path, {})
    (tmp_path / "new_aan_pairs.eval.tsv").unlink()
    with pytest.raises(UserError, match="missing new_aan_pairs.eval.tsv .*lra_release.gz.*--source"):
        retrieval.read_release(tmp_path)
    with pytest.raises(UserError, match="lra_release.gz.*--source"):
        retrieval.prepare(tmp_path, "full", None, seed=0, workers=1)
