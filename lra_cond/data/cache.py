"""The prepared cache: a Hugging Face ``datasets`` Arrow DatasetDict on disk.

Layout: ``<data_dir>/<task>/<preset>/prepared/`` with splits train/val/test and columns
``input_ids`` (ragged int16 token ids, 0 = pad never stored), ``length`` (true length) and
``label``. Pair tasks add ``input_ids2``/``length2``. Written to a temporary directory and renamed
on success, so an interrupted prepare leaves nothing that loads.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from datasets import Dataset, DatasetDict, load_from_disk

from lra_cond.errors import UserError

MANIFEST = "manifest.json"


def default_data_dir() -> Path:
    return Path(os.environ.get("LRA_DATA", "data"))


def task_dir(data_dir: str | Path, task: str, preset: str) -> Path:
    return Path(data_dir) / task / preset


def prepared_dir(data_dir: str | Path, task: str, preset: str) -> Path:
    return task_dir(data_dir, task, preset) / "prepared"


def ragged(seqs: Sequence[np.ndarray]) -> pa.Array:
    """Variable-length int16 sequences as one Arrow list column, without per-element Python work."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int32, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(seqs).astype(np.int16) if len(seqs) else np.zeros(0, np.int16)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _table(columns: dict[str, Any]) -> pa.Table:
    arrays = {}
    for name, col in columns.items():
        if name.startswith("input_ids"):
            arrays[name] = ragged(col)
            suffix = name.removeprefix("input_ids")
            arrays[f"length{suffix}"] = pa.array([len(s) for s in col], pa.int32())
        else:
            arrays[name] = pa.array(np.asarray(col), pa.int32())
    return pa.table(arrays)


def save_prepared(out: Path, splits: dict[str, dict[str, Any]], manifest: dict[str, Any]) -> Path:
    """Write splits atomically to ``out`` (a ``prepared`` directory) with a manifest."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    dd = DatasetDict({name: Dataset(_table(cols)) for name, cols in splits.items()})
    dd.save_to_disk(str(tmp))
    sizes = {name: len(ds) for name, ds in dd.items()}
    (tmp / MANIFEST).write_text(json.dumps({**manifest, "sizes": sizes}, indent=2) + "\n")
    old = out.with_name(out.name + ".old")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)
    return out


def is_prepared(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def load_prepared(path: Path, prepare_hint: str) -> DatasetDict:
    path = Path(path)
    if not is_prepared(path):
        raise UserError(f"no prepared data at {path}; run: {prepare_hint}")
    try:
        return load_from_disk(str(path))
    except Exception as e:  # corrupt Arrow files surface as many exception types
        raise UserError(f"prepared data at {path} is unreadable ({e}); re-run: {prepare_hint}") from None
