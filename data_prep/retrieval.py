"""Retrieval (ACL Anthology Network document matching): reader of the official TSV files.

Official release: ``lra_release/tsv_data/new_aan_pairs.{train,eval,test}.tsv`` (147086/18090/17437
rows), no header, five tab-separated columns ``label id1 id2 text1 text2``, no quoting. The label is
1 when the two papers are linked by a citation. The reference pipeline parses it as a float, so
both ``1`` and ``1.0`` are accepted (anything not integral in {0, 1} is an error). The text fields
are stored as Python bytes literals (``b'...'`` with backslash escapes); like the reference, which
byte-encodes the raw field, we tokenize them verbatim. Each document is truncated to
``MAX_LEN`` = 4000 bytes, id = byte + 1 (vocabulary 257). ``eval`` becomes the cache's ``val``.
"""

from __future__ import annotations

import random
from pathlib import Path

from lra_cond.data_prep.progress import progress_bar
from lra_cond.data_prep.text import byte_ids
from lra_cond.errors import UserError

MAX_LEN = 4000
FILES = {"train": "train", "val": "eval", "test": "test"}  # cache split -> file infix
NUM_COLUMNS = 5
HINT = (
    "download lra_release.gz from https://github.com/google-research/long-range-arena, "
    "extract it, and pass --source lra_release/tsv_data"
)
FIXTURE_SIZES = {"train": 64, "eval": 16, "test": 16}


def file_name(infix: str) -> str:
    return f"new_aan_pairs.{infix}.tsv"


def parse_label(field: bytes, where: str) -> int:
    try:
        value = float(field.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise UserError(f"{where}: label {field[:20]!r} is not a number") from None
    if value not in (0.0, 1.0):
        raise UserError(f"{where}: label {value:g} is not 0 or 1")
    return int(value)


def read_tsv(path: Path, max_len: int = MAX_LEN) -> dict[str, list]:
    """Columns ``input_ids``, ``input_ids2``, ``label`` of one official TSV, with file:line on errors."""
    path = Path(path)
    ids1, ids2, labels = [], [], []
    with progress_bar() as bar, open(path, "rb") as f:  # bytes: tokens are the raw field bytes
        task = bar.add_task(f"reading {path.name}", total=path.stat().st_size)
        for lineno, line in enumerate(f, start=1):
            if lineno % 1000 == 0:
                bar.update(task, completed=f.tell())
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            cols = line.split(b"\t")
            if len(cols) != NUM_COLUMNS:
                raise UserError(
                    f"{path}:{lineno}: expected {NUM_COLUMNS} tab-separated columns "
                    f"(label, id1, id2, text1, text2), got {len(cols)}"
                )
            labels.append(parse_label(cols[0], f"{path}:{lineno}"))
            ids1.append(byte_ids(cols[3], max_len))
            ids2.append(byte_ids(cols[4], max_len))
        bar.update(task, completed=path.stat().st_size)
    return {"input_ids": ids1, "input_ids2": ids2, "label": labels}


def read_release(tsv_dir: Path) -> dict[str, dict[str, list]]:
    tsv_dir = Path(tsv_dir)
    missing = [file_name(i) for i in FILES.values() if not (tsv_dir / file_name(i)).is_file()]
    if missing:
        raise UserError(f"missing {', '.join(missing)} in {tsv_dir}; {HINT}")
    return {split: read_tsv(tsv_dir / file_name(infix)) for split, infix in FILES.items()}


_TOPICS = (
    "parsing treebank grammar dependency syntax",
    "translation alignment phrase decoder bilingual",
    "sentiment opinion review polarity lexicon",
    "speech acoustic recognition phoneme prosody",
)


def _paper(rng: random.Random, topic: int) -> bytes:
    """A short paper text (about 100-250 bytes) about one topic."""
    words = _TOPICS[topic].split() + "we the a model corpus results show propose".split()
    target = rng.randint(100, 250)
    text = ""
    while len(text) < target:
        text += rng.choice(words) + ("\n" if rng.random() < 0.05 else " ")
    return text.encode()


def write_fixture(out_dir: Path, seed: int = 0) -> Path:
    """Write tiny ``new_aan_pairs.*.tsv`` files in the official format; returns their folder.

    Deterministic in ``seed``. Label 1 pairs share a topic (a stand-in for a citation link), so a
    tiny fit has signal; text fields are written as bytes literals like the release's.
    """
    root = Path(out_dir) / "tsv_data"
    root.mkdir(parents=True, exist_ok=True)
    for infix, size in FIXTURE_SIZES.items():
        rng = random.Random(f"aan-fixture-{seed}-{infix}")
        lines = []
        for i in range(size):
            label = i % 2
            t1 = rng.randrange(len(_TOPICS))
            t2 = t1 if label else (t1 + rng.randrange(1, len(_TOPICS))) % len(_TOPICS)
            id1, id2 = f"P{rng.randrange(80, 99)}-{rng.randrange(1000, 2000)}", f"W{i:02d}-{i:04d}"
            lines.append(f"{label}\t{id1}\t{id2}\t{_paper(rng, t1)!r}\t{_paper(rng, t2)!r}\n")
        (root / file_name(infix)).write_text("".join(lines))
    return root


def prepare(out_dir: Path, preset: str, source: Path | None, seed: int, workers: int) -> tuple[dict, dict]:
    """Splits and manifest; the tiny preset without ``source`` writes and reads the fixture."""
    if source is None and preset == "tiny":
        source, origin = write_fixture(Path(out_dir) / "source", seed), "fixture"
    elif source is None:
        raise UserError(f"retrieval cannot be downloaded automatically; {HINT}")
    else:
        origin = str(Path(source).resolve())
    manifest = {"source": origin, "max_len": MAX_LEN, "tokens": "raw field bytes, id = byte + 1"}
    return read_release(source), manifest
