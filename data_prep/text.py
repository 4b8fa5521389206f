"""Text (IMDB byte-level sentiment): reader of the hub dataset and a tiny fixture in its schema.

Source: Hugging Face ``imdb`` (splits train/test/unsupervised; columns ``text`` str, ``label`` 0 = neg,
1 = pos), read from the hub or from a local Arrow/Parquet export (see ``data_prep.hub``), or the
original Stanford ``aclImdb`` folder (``aclImdb_v1.tar.gz``; ``{train,test}/{neg,pos}/*.txt``).
Tokens are UTF-8 bytes with id = byte + 1 (0 = pad, vocabulary 257), truncated to ``MAX_LEN`` = 4000
bytes, the LRA setting. Some published setups use 1000: the cache keeps 4000 and
``--data.max_len 1000`` truncates at load time (and sizes the model's position table to match).
IMDB has no validation split; as in LRA the test split doubles as validation, so the cache's ``val``
and ``test`` hold the same 25000 reviews and "best checkpoint by val/acc" selects on the test set.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lra_cond.data_prep import hub
from lra_cond.errors import UserError

HUB_ID = "imdb"
MAX_LEN = 4000
COLUMNS = ("text", "label")
SOURCE_SPLITS = {"train": "train", "val": "test", "test": "test"}  # cache split -> IMDB split
HINT = (
    'download IMDB where there is network (python -c "import datasets; '
    "datasets.load_dataset('imdb').save_to_disk('imdb')\") and pass --source imdb "
    "(a save_to_disk folder, the hub's Parquet files, or the aclImdb folder of aclImdb_v1.tar.gz)"
)
FIXTURE_SIZES = {"train": 64, "test": 32}


def byte_ids(data: bytes, max_len: int) -> np.ndarray:
    """Byte-level token ids: byte + 1 (so 0 stays free for padding), first ``max_len`` bytes."""
    return np.frombuffer(data[:max_len], dtype=np.uint8).astype(np.int16) + 1


def check_label(value: object, where: str, num_classes: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_classes:
        raise UserError(f"{where}: label {value!r} is not an integer in 0..{num_classes - 1}")
    return value


def read_rows(rows: Iterable[hub.Row], max_len: int = MAX_LEN) -> dict[str, list]:
    """Columns for the prepared cache from rows with ``text`` and ``label``."""
    ids, labels = [], []
    for row in rows:
        text = row.values["text"]
        if not isinstance(text, str):
            raise UserError(f"{row.where}: text is {type(text).__name__}, expected a string")
        labels.append(check_label(row.values["label"], row.where, 2))
        ids.append(byte_ids(text.encode("utf-8"), max_len))
    return {"input_ids": ids, "label": labels}


def acl_imdb_rows(root: Path, split: str) -> list[hub.Row]:
    """Rows of the original Stanford release ``aclImdb/<split>/{neg,pos}/<id>_<stars>.txt`` (neg = 0)."""
    rows = []
    for label, folder in enumerate(("neg", "pos")):
        files = sorted((root / split / folder).glob("*.txt"), key=lambda f: (len(f.stem), f.stem))
        if not files:
            raise UserError(f"no reviews in {root / split / folder}; {HINT}")
        for path in files:
            try:
                rows.append(hub.Row(str(path), {"text": path.read_text(encoding="utf-8"), "label": label}))
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: not UTF-8 text ({e})") from None
    return rows


def read_source(source: Path | None) -> dict[str, dict[str, list]]:
    """All cache splits from a local export or ``aclImdb`` folder (``source``), or the hub (``None``)."""
    if source is not None and (Path(source) / "aclImdb").is_dir():
        source = Path(source) / "aclImdb"
    acl = source is not None and (Path(source) / "train" / "pos").is_dir()
    cache: dict[str, dict[str, list]] = {}
    for name in dict.fromkeys(SOURCE_SPLITS.values()):
        if acl:
            rows = acl_imdb_rows(Path(source), name)
        elif source is None:
            rows = hub.read_hub(HUB_ID, name, COLUMNS, HINT)
        else:
            rows = hub.read_local(source, name, COLUMNS, HINT)
        cache[name] = read_rows(rows)
    return {split: cache[name] for split, name in SOURCE_SPLITS.items()}


_WORDS = {
    0: "dull boring awful mess clumsy weak tedious bad".split(),
    1: "great moving superb charming clever fun brilliant good".split(),
}
_FILLER = "the a film movie plot actor scene story was is and of it café naïve — “quoted” ünïcödé".split()


def _review(rng: random.Random, label: int) -> str:
    """A short review of about 100-300 bytes, with multi-byte UTF-8 and IMDB's ``<br />`` tags."""
    words: list[str] = []
    target = rng.randint(100, 300)
    while len(" ".join(words).encode()) < target:
        words.append(rng.choice(_WORDS[label]) if rng.random() < 0.3 else rng.choice(_FILLER))
        if rng.random() < 0.05:
            words.append("<br /><br />")
    return " ".join(words)


def write_fixture(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny IMDB export in the hub's Parquet layout and schema; returns its root.

    Deterministic in ``seed``. Labels alternate within each split (balanced); the sentiment words
    make the task learnable, so a tiny fit has signal.
    """
    from datasets import ClassLabel, Features, Value

    features = Features({"text": Value("string"), "label": ClassLabel(names=["neg", "pos"])})
    root = Path(out_dir) / "imdb"
    (root / "plain_text").mkdir(parents=True, exist_ok=True)
    for split, size in FIXTURE_SIZES.items():
        rng = random.Random(f"imdb-fixture-{seed}-{split}")
        labels = [i % 2 for i in range(size)]
        table = pa.table(
            {"text": [_review(rng, y) for y in labels], "label": labels}, schema=features.arrow_schema
        )
        pq.write_table(table, root / "plain_text" / f"{split}-00000-of-00001.parquet")
    return root


def prepare(out_dir: Path, preset: str, source: Path | None, seed: int, workers: int) -> tuple[dict, dict]:
    """Splits and manifest; the tiny preset without ``source`` writes and reads the fixture."""
    if source is None and preset == "tiny":
        source = write_fixture(Path(out_dir) / "source", seed)
        origin = "fixture"
    elif source is None:
        origin = f"hub:{HUB_ID}"
    else:
        origin = str(Path(source).resolve())
    splits = read_source(source)
    manifest = {
        "source": origin,
        "max_len": MAX_LEN,
        "tokens": "utf-8 bytes, id = byte + 1",
        "val": "the test split (LRA convention: IMDB has no validation split)",
    }
    return splits, manifest
