"""CIFAR-10 reader: luma, 1024 tokens with black pixels unmasked, 45/5/10 split rule, both source formats."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from lra_cond.data_prep import image
from lra_cond.errors import UserError
from lra_cond.models.encoder import padding_mask


def float_luma(rgb: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma in float64, rounded half up: an independent reference for the reader."""
    rgb = rgb.astype(np.float64)
    return np.floor(0.299 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2] + 0.5)


def test_luma_is_pil_convert_l_and_601_within_one_level() -> None:
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    ours = image.luma(rgb)
    assert np.array_equal(ours, np.asarray(Image.fromarray(rgb).convert("L")))
    diff = np.abs(ours.astype(np.float64) - float_luma(rgb))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    assert image.luma(np.zeros((1, 3), np.uint8)).tolist() == [0]
    assert image.luma(np.full((1, 3), 255, np.uint8)).tolist() == [255]


def decode_rows(path: Path) -> tuple[list[np.ndarray], list[int]]:
    rows = pq.read_table(path).to_pylist()
    grey = [np.asarray(Image.open(io.BytesIO(r["img"]["bytes"])).convert("L")).reshape(-1) for r in rows]
    return grey, [r["label"] for r in rows]


def test_fixture_reader_tokens_labels_splits_and_black_pixels(tmp_path: Path) -> None:
    root = image.write_fixture(tmp_path, seed=0)
    splits, _ = image.prepare(tmp_path, "full", root, seed=0, workers=1)
    train_px, train_y = decode_rows(root / "plain_text" / "train-00000-of-00001.parquet")
    test_px, test_y = decode_rows(root / "plain_text" / "test-00000-of-00001.parquet")
    n_val = len(train_y) // 10  # the last 10% of train is validation
    expected = {
        "train": (train_px[:-n_val], train_y[:-n_val]),
        "val": (train_px[-n_val:], train_y[-n_val:]),
        "test": (test_px, test_y),
    }
    for split, (pixels, labels) in expected.items():
        assert splits[split]["label"] == labels
        assert [ids.tolist() for ids in splits[split]["input_ids"]] == [p.tolist() for p in pixels]
    ids = np.stack(splits["train"]["input_ids"])
    assert ids.shape[1] == 1024 and ids.max() <= 255
    assert (ids[0] == 0).all()  # the all-black image: every token is the real token 0
    assert ((ids[1:] == 0).sum(1) > 0).all()  # every other image has a black square too
    # Black pixels are not padding: lengths are 1024, so the mask the model builds is all False.
    lengths = np.array([len(s) for s in splits["train"]["input_ids"]])
    assert (lengths == 1024).all()
    assert not padding_mask(torch.as_tensor(lengths), 1024).any()


def test_prepared_cache_keeps_lengths_1024(tmp_path: Path) -> None:
    from lra_cond.data import cache
    from lra_cond.data.tasks import TASKS

    out = TASKS.get("image").prepare(tmp_path, "tiny", seed=0)
    dd = cache.load_prepared(out, "hint")
    assert dd["train"].num_rows == 36 and dd["val"].num_rows == 4 and dd["test"].num_rows == 10
    for split in dd.values():
        assert set(split["length"]) == {1024}


def write_archive(folder: Path, rng: np.random.Generator, n: int = 5) -> dict[str, tuple]:
    folder.mkdir(parents=True)
    batches = {}
    for name in (*image.TRAIN_BATCHES, image.TEST_BATCH):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        data[:, :100] = 0  # black rows at the top in all channels
        labels = rng.integers(0, 10, n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": b"x"}, f)
        batches[name] = (data, labels)
    return batches


def test_python_archive_reader(tmp_path: Path) -> None:
    batches = write_archive(tmp_path / "cifar-10-batches-py", np.random.default_rng(1))
    splits = image.read_source(tmp_path)  # the folder above cifar-10-batches-py also works

    def grey(data: np.ndarray) -> list[list[int]]:
        rgb = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # channel-major -> HWC
        return [np.asarray(Image.fromarray(im).convert("L")).reshape(-1).tolist() for im in rgb]

    train_px = [p for n in image.TRAIN_BATCHES for p in grey(batches[n][0])]
    train_y = [y for n in image.TRAIN_BATCHES for y in batches[n][1]]
    assert [s.tolist() for s in splits["train"]["input_ids"]] == train_px[:-2]  # 25 images: 2 to val
    assert [s.tolist() for s in splits["val"]["input_ids"]] == train_px[-2:]
    assert splits["train"]["label"] + splits["val"]["label"] == train_y
    assert [s.tolist() for s in splits["test"]["input_ids"]] == grey(batches["test_batch"][0])
    assert splits["test"]["label"] == batches["test_batch"][1]


def test_archive_errors(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    write_archive(folder, np.random.default_rng(2))
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="data_batch_3: not a CIFAR-10 python batch"):
        image.read_source(folder)
    (folder / "data_batch_3").unlink()
    with pytest.raises(UserError, match="missing data_batch_3 .*cifar-10-python.tar.gz"):
        image.read_source(folder)


def write_parquet(root: Path, split: str, cells: list, labels: list) -> Path:
    path = root / "plain_text" / f"{split}-00000-of-00001.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    img_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(pa.table({"img": pa.array(cells, img_type), "label": labels}), path)
    return path


def png(side: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((side, side, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("cell", "label", "message"),
    [
        ({"bytes": b"\x89PNG garbage", "path": None}, 0, "row 2: undecodable image"),
        ({"bytes": png(16), "path": None}, 0, "row 2: image is 16x16, expected 32x32"),
        ({"bytes": png(), "path": None}, 10, r"row 2: label 10 is not an integer in 0\.\.9"),
    ],
)
def test_malformed_hub_rows(tmp_path: Path, cell: dict, label: int, message: str) -> None:
    good = {"bytes": png(), "path": None}
    path = write_parquet(tmp_path, "train", [good, good, cell], [1, 2, label])
    write_parquet(tmp_path, "test", [good], [0])
    with pytest.raises(UserError, match=message) as err:
        image.read_source(tmp_path)
    assert str(path) in str(err.value)
