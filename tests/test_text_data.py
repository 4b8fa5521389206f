"""IMDB reader: byte + 1 ids from the hub-schema export, test split as validation, bad rows, max_len."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lra_cond.data import LraDataModule
from lra_cond.data.batches import PackedSplit
from lra_cond.data.cache import ragged
from lra_cond.data.tasks import TASKS
from lra_cond.data_prep import text
from lra_cond.errors import UserError


def expected_ids(s: str) -> list[int]:
    return [b + 1 for b in s.encode("utf-8")]


def write_split(root: Path, split: str, texts: list, labels: list) -> Path:
    path = root / "plain_text" / f"{split}-00000-of-00001.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts, "label": labels}), path)
    return path


def test_fixture_reader_reproduces_bytes_and_labels(tmp_path: Path) -> None:
    root = text.write_fixture(tmp_path, seed=0)
    splits, manifest = text.prepare(tmp_path, "full", root, seed=0, workers=1)
    for split, source in (("train", "train"), ("val", "test"), ("test", "test")):
        raw = pq.read_table(root / "plain_text" / f"{source}-00000-of-00001.parquet").to_pylist()
        assert len(raw) == len(splits[split]["label"]) == text.FIXTURE_SIZES[source]
        for row, ids, label in zip(raw, splits[split]["input_ids"], splits[split]["label"]):
            assert ids.tolist() == expected_ids(row["text"])
            assert label == row["label"]
    all_ids = np.concatenate(splits["train"]["input_ids"])
    assert all_ids.max() > 128  # multi-byte UTF-8 really went through as bytes
    assert all_ids.min() >= 1  # 0 stays the pad id
    assert sorted(set(splits["train"]["label"])) == [0, 1]
    assert manifest["max_len"] == 4000


def test_fixture_is_deterministic(tmp_path: Path) -> None:
    a = text.write_fixture(tmp_path / "a", seed=3) / "plain_text" / "train-00000-of-00001.parquet"
    b = text.write_fixture(tmp_path / "b", seed=3) / "plain_text" / "train-00000-of-00001.parquet"
    c = text.write_fixture(tmp_path / "c", seed=4) / "plain_text" / "train-00000-of-00001.parquet"
    assert pq.read_table(a).to_pylist() == pq.read_table(b).to_pylist()
    assert pq.read_table(a).to_pylist() != pq.read_table(c).to_pylist()


def test_truncates_to_4000_bytes_and_reads_save_to_disk(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    long = "é" * 2500 + "tail"  # 5004 bytes; the cut falls between the two bytes of one 'é'
    DatasetDict(
        {
            "train": Dataset.from_dict({"text": [long, "ok"], "label": [1, 0]}),
            "test": Dataset.from_dict({"text": ["x"], "label": [0]}),
            "unsupervised": Dataset.from_dict({"text": ["ignored"], "label": [-1]}),
        }
    ).save_to_disk(str(tmp_path / "imdb"))
    splits, _ = text.prepare(tmp_path, "full", tmp_path / "imdb", seed=0, workers=1)
    assert splits["train"]["input_ids"][0].tolist() == expected_ids(long)[:4000]
    assert splits["train"]["label"] == [1, 0]
    assert [ids.tolist() for ids in splits["val"]["input_ids"]] == [expected_ids("x")]


@pytest.mark.parametrize(
    ("texts", "labels", "message"),
    [
        (["a", "b", "c"], [0, 1, 2], "row 2: label 2 is not an integer in 0..1"),
        (["a", None], [0, 1], "row 1: text is NoneType"),
        (["a", "b"], [0, None], "row 1: label None"),
    ],
)
def test_malformed_rows_name_file_and_row(tmp_path: Path, texts: list, labels: list, message: str) -> None:
    path = write_split(tmp_path, "train", texts, labels)
    write_split(tmp_path, "test", ["t"], [0])
    with pytest.raises(UserError, match=message) as err:
        TASKS.get("text").prepare(tmp_path / "data", "full", source=tmp_path)
    assert str(path) in str(err.value)
    assert not (tmp_path / "data" / "text" / "full" / "prepared").exists()  # no partial cache


def test_missing_split_or_column_says_what_to_do(tmp_path: Path) -> None:
    write_split(tmp_path, "train", ["a"], [0])
    with pytest.raises(UserError, match="no test split .*--source"):
        text.read_source(tmp_path)
    pq.write_table(pa.table({"review": ["a"], "label": [0]}), tmp_path / "plain_text" / "test.parquet")
    with pytest.raises(UserError, match="missing column.*text"):
        text.read_source(tmp_path)


def test_batches_max_len_truncates_ids_and_lengths() -> None:
    from datasets import Dataset

    columns = {"input_ids": ragged([np.arange(1, 8), np.arange(1, 4)]), "length": [7, 3], "label": [1, 0]}
    rows = Dataset(pa.table(columns))
    batch = PackedSplit(rows, max_len=5).__getitems__([0, 1])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 0, 0]]
    assert batch["length"].tolist() == [5, 3]
    assert torch.equal(PackedSplit(rows).__getitems__([0, 1])["length"], torch.tensor([7, 3]))


def test_datamodule_max_len_bounds(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data.max_len must be in 1..4000"):
        LraDataModule("text", str(tmp_path), "tiny", max_len=4001)
    dm = LraDataModule("text", str(tmp_path), "tiny", batch_size=64, max_len=50)
    dm.prepare_data()  # tiny builds from the fixture: no download needed
    dm.setup()
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"].shape[1] == 50
    assert int(batch["length"].max()) == 50


def test_acl_imdb_folder(tmp_path: Path) -> None:
    reviews = {("train", "neg"): ["bad", "awful"], ("train", "pos"): ["naïve joy"], ("test", "neg"): ["meh"]}
    reviews[("test", "pos")] = ["fine"]
    for (split, folder), texts in reviews.items():
        (tmp_path / "aclImdb" / split / folder).mkdir(parents=True)
        for i, t in enumerate(texts):
            (tmp_path / "aclImdb" / split / folder / f"{i}_7.txt").write_text(t, encoding="utf-8")
    splits = text.read_source(tmp_path)
    assert [ids.tolist() for ids in splits["train"]["input_ids"]] == [
        expected_ids(t) for t in ["bad", "awful", "naïve joy"]
    ]
    assert splits["train"]["label"] == [0, 0, 1]
    assert splits["val"]["label"] == splits["test"]["label"] == [0, 1]
    (tmp_path / "aclImdb" / "test" / "pos" / "1_3.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(UserError, match=r"1_3.txt: not UTF-8"):
        text.read_source(tmp_path)


def test_hub_path_reads_the_loaded_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The no-source path: ``load_dataset('imdb')`` is redirected to the fixture (no network in tests)."""
    import datasets

    root = text.write_fixture(tmp_path, seed=1)
    real = datasets.load_dataset
    calls = []

    def fake(hub_id: str, split: str) -> datasets.Dataset:
        calls.append((hub_id, split))
        return real(str(root), split=split, cache_dir=str(tmp_path / "hf"))

    monkeypatch.setattr(datasets, "load_dataset", fake)
    splits, manifest = text.prepare(tmp_path, "full", None, seed=0, workers=1)
    assert calls == [("imdb", "train"), ("imdb", "test")]
    assert manifest["source"] == "hub:imdb"
    raw = pq.read_table(root / "plain_text" / "train-00000-of-00001.parquet").to_pylist()
    assert [ids.tolist() for ids in splits["train"]["input_ids"]] == [expected_ids(r["text"]) for r in raw]
    assert splits["train"]["label"] == [r["label"] for r in raw]
