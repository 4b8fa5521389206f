"""Hugging Face hub datasets as sources: the hub itself, or a local Arrow/Parquet export of it.

Local exports accepted (all in the hub schema, e.g. IMDB ``text``/``label``, CIFAR-10 ``img``/``label``):

- the hub's own Parquet layout, e.g. ``plain_text/train-00000-of-00001.parquet``;
- ``DatasetDict.save_to_disk`` output (``train/data-00000-of-00001.arrow`` + ``dataset_dict.json``);
- Arrow files from the ``datasets`` cache, e.g. ``imdb-train.arrow``.

A file belongs to split S when S is its parent folder's name or one of the ``-``/``_``/``.``-separated
words of its name. Rows are yielded with their file and row index so malformed rows can be reported.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lra_cond.errors import UserError

SUFFIXES = (".parquet", ".arrow")


@dataclass(frozen=True)
class Row:
    where: str  # "FILE: row I" for messages
    values: dict[str, Any]


def split_files(root: Path, split: str) -> list[Path]:
    """Arrow/Parquet files of ``split`` under ``root``, in name order (shards stay in order)."""
    files = []
    for path in sorted(Path(root).rglob("*")):
        if path.suffix not in SUFFIXES or not path.is_file():
            continue
        words = re.split(r"[-_.]", path.name.removesuffix(path.suffix))
        if split in words or path.parent.name == split:
            files.append(path)
    return files


def read_table(path: Path) -> pa.Table:
    """One Parquet file, or one Arrow file (IPC stream as ``datasets`` writes it, or IPC file)."""
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        with pa.memory_map(str(path)) as f:
            try:
                return pa.ipc.open_stream(f).read_all()
            except pa.ArrowInvalid:
                f.seek(0)
                return pa.ipc.open_file(f).read_all()
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable {path.suffix[1:]} file ({e})") from None


def _rows(table: pa.Table, where: str, columns: tuple[str, ...]) -> Iterator[Row]:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise UserError(
            f"{where}: missing column(s) {', '.join(missing)} (has {', '.join(table.column_names)}); "
            "expected the hub schema"
        )
    offset = 0
    for batch in table.select(list(columns)).to_batches(max_chunksize=1024):
        for i, values in enumerate(batch.to_pylist()):
            yield Row(f"{where}: row {offset + i}", values)
        offset += batch.num_rows


def read_local(root: Path, split: str, columns: tuple[str, ...], hint: str) -> Iterator[Row]:
    """Rows of ``split`` from a local export; ``hint`` says what to download if nothing is there.

    Missing files are reported at the call (not on first iteration), before any progress bar.
    """
    files = split_files(root, split)
    if not files:
        raise UserError(f"no {split} split (*.parquet / *.arrow) under {root}; {hint}")
    return (row for path in files for row in _rows(read_table(path), str(path), columns))


def read_hub(hub_id: str, split: str, columns: tuple[str, ...], hint: str) -> Iterator[Row]:
    """Rows of ``split`` via ``datasets.load_dataset(hub_id)`` (network, or the local HF cache); loads now."""
    import datasets

    try:
        ds = datasets.load_dataset(hub_id, split=split)
    except Exception as e:  # offline, hub errors, missing cache: all mean "get the data another way"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load '{hub_id}' from the Hugging Face hub ({first}); {hint}") from None
    return _rows(ds.data.table, f"hub:{hub_id}[{split}]", columns)
