"""Image (grayscale CIFAR-10 as a 1024-token sequence): readers of the hub dataset and the python archive.

Sources:

- Hugging Face ``cifar10`` (columns ``img`` PNG image, ``label`` 0..9), from the hub or a local
  Arrow/Parquet export in that schema (see ``data_prep.hub``);
- the standard CIFAR-10 python archive folder ``cifar-10-batches-py`` (pickled dicts
  ``data_batch_1..5`` and ``test_batch``: ``b'data'`` uint8 [N, 3072] channel-major, ``b'labels'``).
  Pickle can run code: only read archives from the official source.

Grayscale: ITU-R 601-2 luma exactly as Pillow's ``convert("L")`` computes it,
``(19595 R + 38470 G + 7471 B + 2**15) >> 16`` (0.299/0.587/0.114 in 16-bit fixed point, rounded
half up). The LRA reference used TensorFlow's ``rgb_to_grayscale`` (0.2989/0.5870/0.1140, its own
rounding), which differs by at most one grey level on some pixels. Pixels are flattened row-major to
1024 tokens with the pixel value 0..255 as the id: 0 is a real (black) token, not padding, and every
sequence has length 1024, so no pixel is masked. Splits: the last 10% of the training set is
validation (45000/5000), plus the 10000 test images.
"""

from __future__ import annotations

import io
import pickle
import random
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lra_cond.data_prep import hub
from lra_cond.data_prep.progress import progress_bar
from lra_cond.data_prep.text import check_label
from lra_cond.errors import UserError

HUB_ID = "cifar10"
COLUMNS = ("img", "label")
SIDE = 32
NUM_CLASSES = 10
VAL_FRACTION = 0.1
ARCHIVE_DIR = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
HINT = (
    "download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html and pass "
    f"--source {ARCHIVE_DIR} (or a save_to_disk / Parquet export of the hub's 'cifar10')"
)
FIXTURE_SIZES = {"train": 40, "test": 10}


def luma(rgb: np.ndarray) -> np.ndarray:
    """uint8 grey levels of uint8 RGB ``[..., 3]``, bit-identical to Pillow's ``convert("L")``."""
    r, g, b = (rgb[..., i].astype(np.uint32) for i in range(3))
    return ((19595 * r + 38470 * g + 7471 * b + 0x8000) >> 16).astype(np.uint8)


def decode(cell: object, where: str) -> np.ndarray:
    """Flattened grey levels of one hub ``img`` cell ({bytes, path}); UserError if undecodable."""
    from PIL import Image, UnidentifiedImageError

    data = cell.get("bytes") if isinstance(cell, dict) else None
    path = cell.get("path") if isinstance(cell, dict) else None
    try:
        with Image.open(io.BytesIO(data) if data else path) as im:
            rgb = np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{where}: undecodable image ({type(e).__name__}: {e})") from None
    if rgb.shape != (SIDE, SIDE, 3):
        raise UserError(f"{where}: image is {rgb.shape[1]}x{rgb.shape[0]}, expected {SIDE}x{SIDE}")
    return luma(rgb).reshape(-1)


def read_rows(rows: Iterable[hub.Row], description: str) -> dict[str, list]:
    ids, labels = [], []
    with progress_bar() as bar:
        task = bar.add_task(description, total=None)
        for i, row in enumerate(rows):
            labels.append(check_label(row.values["label"], row.where, NUM_CLASSES))
            ids.append(decode(row.values["img"], row.where).astype(np.int16))
            if i % 1000 == 0:
                bar.update(task, completed=i)
    return {"input_ids": ids, "label": labels}


def read_batch(path: Path) -> dict[str, list]:
    """One pickled CIFAR-10 python batch -> columns (row-major luma tokens, labels)."""
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data, labels = batch[b"data"], batch[b"labels"]
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: not a CIFAR-10 python batch ({type(e).__name__}: {e})") from None
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * SIDE * SIDE:
        raise UserError(
            f"{path}: b'data' is {data.dtype} {data.shape}, expected uint8 [N, {3 * SIDE * SIDE}]"
        )
    if len(labels) != len(data):
        raise UserError(f"{path}: {len(labels)} labels for {len(data)} images")
    grey = luma(data.reshape(-1, 3, SIDE * SIDE).transpose(0, 2, 1)).astype(np.int16)
    checked = [check_label(y, f"{path}: row {i}", NUM_CLASSES) for i, y in enumerate(labels)]
    return {"input_ids": list(grey), "label": checked}


def _concat(parts: list[dict[str, list]]) -> dict[str, list]:
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}


def read_archive(folder: Path) -> tuple[dict[str, list], dict[str, list]]:
    missing = [n for n in (*TRAIN_BATCHES, TEST_BATCH) if not (folder / n).is_file()]
    if missing:
        raise UserError(f"missing {', '.join(missing)} in {folder}; {HINT}")
    return _concat([read_batch(folder / n) for n in TRAIN_BATCHES]), read_batch(folder / TEST_BATCH)


def split_train(train: dict[str, list]) -> tuple[dict[str, list], dict[str, list]]:
    """The last ``VAL_FRACTION`` of the training set (in source order) is validation."""
    cut = len(train["label"]) - int(round(len(train["label"]) * VAL_FRACTION))
    return {k: v[:cut] for k, v in train.items()}, {k: v[cut:] for k, v in train.items()}


def read_source(source: Path | None) -> dict[str, dict[str, list]]:
    """train/val/test from the python archive, a local hub export, or the hub (``None``)."""
    if source is not None and (source / ARCHIVE_DIR).is_dir():
        source = source / ARCHIVE_DIR
    if source is not None and (source / TRAIN_BATCHES[0]).is_file():
        full_train, test = read_archive(source)
    else:
        parts = {}
        for name in ("train", "test"):
            if source is None:
                rows = hub.read_hub(HUB_ID, name, COLUMNS, HINT)
            else:
                rows = hub.read_local(source, name, COLUMNS, HINT)
            parts[name] = read_rows(rows, f"decoding CIFAR-10 {name}")
        full_train, test = parts["train"], parts["test"]
    train, val = split_train(full_train)
    return {"train": train, "val": val, "test": test}


def _fixture_image(rng: np.random.Generator, label: int, black: bool) -> np.ndarray:
    """Noise whose brightness grows with the label, plus a black square (real zero-valued pixels)."""
    if black:
        return np.zeros((SIDE, SIDE, 3), np.uint8)
    scale = (label + 1) / NUM_CLASSES
    img = (rng.integers(0, 256, (SIDE, SIDE, 3)) * scale).astype(np.uint8)
    y, x, s = rng.integers(0, SIDE - 8, 2).tolist() + [int(rng.integers(2, 8))]
    img[y : y + s, x : x + s] = 0
    return img


def write_fixture(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny CIFAR-10 export (PNG images) in the hub's Parquet layout and schema; returns its root.

    Deterministic in ``seed``. Image 0 of each split is all black; every image has a black square.
    """
    from datasets import ClassLabel, Features, Image
    from PIL import Image as PILImage

    names = "airplane automobile bird cat deer dog frog horse ship truck".split()
    features = Features({"img": Image(), "label": ClassLabel(names=names)})
    root = Path(out_dir) / "cifar10"
    (root / "plain_text").mkdir(parents=True, exist_ok=True)
    for split, size in FIXTURE_SIZES.items():
        rng = np.random.default_rng(random.Random(f"cifar-fixture-{seed}-{split}").getrandbits(64))
        labels = [i % NUM_CLASSES for i in range(size)]
        cells = []
        for i, y in enumerate(labels):
            buf = io.BytesIO()
            PILImage.fromarray(_fixture_image(rng, y, black=i == 0)).save(buf, format="PNG")
            cells.append({"bytes": buf.getvalue(), "path": None})
        table = pa.table({"img": cells, "label": labels}, schema=features.arrow_schema)
        pq.write_table(table, root / "plain_text" / f"{split}-00000-of-00001.parquet")
    return root


def prepare(out_dir: Path, preset: str, source: Path | None, seed: int, workers: int) -> tuple[dict, dict]:
    """Splits and manifest; the tiny preset without ``source`` writes and reads the fixture."""
    if source is None and preset == "tiny":
        source, origin = write_fixture(Path(out_dir) / "source", seed), "fixture"
    elif source is None:
        origin = f"hub:{HUB_ID}"
    else:
        origin = str(Path(source).resolve())
    manifest = {
        "source": origin,
        "grayscale": "ITU-R 601-2 luma as PIL convert('L'): (19595R+38470G+7471B+32768)>>16",
        "val": f"last {VAL_FRACTION:.0%} of the training set",
    }
    return read_source(Path(source) if source is not None else None), manifest
