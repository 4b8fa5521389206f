"""The prepared cache: a Hugging Face ``datasets`` Arrow DatasetDict on disk.

Layout: ``<data_dir>/<task>/<preset>/prepared/`` with splits train/val/test and columns
``input_ids`` (ragged int16 token ids, 0 = pad never stored), ``length`` (true length) and
``label``. Pair tasks add ``input_ids2``/``length2``. Written to a temporary directory and renamed
on success, so an interrupted prepare leaves nothing that loads. ``manifest.json`` (written last, so
it marks a complete cache) records the source, generator parameters and seed, split sizes, and the
size and sha256 of every file; loading checks the sizes always and the checksums on first use and
whenever a file's size or mtime changed (``verified.json`` remembers the last full check), so a
truncated or altered cache is reported with the exact ``prepare`` command that rebuilds it.
"""

from __future__ import annotations

import hashlib
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
VERIFIED = "verified.json"  # {file: [size, mtime_ns]} of the last full checksum pass
_HASH_BUFFER = 1 << 20


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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_BUFFER):
            h.update(chunk)
    return h.hexdigest()


def _data_files(root: Path) -> list[Path]:
    """Every file of the saved DatasetDict (Arrow shards and their JSON metadata), sorted."""
    skip = {MANIFEST, VERIFIED}
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name not in skip)


def save_prepared(out: Path, splits: dict[str, dict[str, Any]], manifest: dict[str, Any]) -> Path:
    """Write splits atomically to ``out`` (a ``prepared`` directory) with a manifest."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    for stale in (tmp, old):  # left by an earlier interrupted prepare
        if stale.exists():
            shutil.rmtree(stale)
    dd = DatasetDict({name: Dataset(_table(cols)) for name, cols in splits.items()})
    dd.save_to_disk(str(tmp))
    sizes = {name: len(ds) for name, ds in dd.items()}
    files = {
        p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in _data_files(tmp)
    }
    _write_json(tmp / VERIFIED, _stamp(tmp, files))
    # The manifest goes last: its presence is what marks the cache complete.
    _write_json(tmp / MANIFEST, {**manifest, "sizes": sizes, "files": files})
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)
    return out


def _write_json(path: Path, data: Any) -> None:
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    part.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(part, path)


def _stamp(root: Path, files: dict[str, Any]) -> dict[str, list[int]]:
    stats = {name: (root / name).stat() for name in files}
    return {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}


def exact_prepare_command(manifest: dict[str, Any], hint: str) -> str:
    """``hint`` plus the ``--source``/``--seed`` recorded in the manifest, so a rebuild is identical."""
    source = manifest.get("source")  # a path, or "generated" / "fixture" / "hub:<id>"
    if isinstance(source, str) and os.path.isabs(source) and "--source" not in hint:
        hint += f" --source {source}"
    if "seed" in manifest and "--seed" not in hint:
        hint += f" --seed {manifest['seed']}"
    return hint


def verify_prepared(path: Path, manifest: dict[str, Any], prepare_hint: str) -> None:
    """Raise ``UserError`` if a file listed in the manifest is missing, resized or altered."""
    files = manifest.get("files")
    if files is None:  # caches written before checksums existed
        return
    command = exact_prepare_command(manifest, prepare_hint)

    def corrupt(name: str, what: str) -> UserError:
        return UserError(f"prepared data at {path} is corrupt ({name}: {what}); re-run: {command}")

    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise corrupt(name, "missing")
        if f.stat().st_size != info["bytes"]:
            raise corrupt(name, f"{f.stat().st_size} bytes, the manifest says {info['bytes']}")
    try:
        stamp = json.loads((path / VERIFIED).read_text())
    except (OSError, ValueError):
        stamp = None
    if stamp == _stamp(path, files):
        return  # unchanged since the last full check
    for name, info in files.items():
        if file_sha256(path / name) != info["sha256"]:
            raise corrupt(name, "sha256 differs from the manifest")
    try:
        _write_json(path / VERIFIED, _stamp(path, files))
    except OSError:
        pass  # a read-only cache is verified in full on every load


def is_prepared(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def load_prepared(path: Path, prepare_hint: str) -> DatasetDict:
    path = Path(path)
    if not is_prepared(path):
        raise UserError(f"no prepared data at {path}; run: {prepare_hint}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except ValueError:
        raise UserError(f"prepared data at {path} has a corrupt {MANIFEST}; re-run: {prepare_hint}") from None
    verify_prepared(path, manifest, prepare_hint)
    try:
        return load_from_disk(str(path))
    except Exception as e:  # corrupt Arrow files surface as many exception types
        reason = " ".join(str(e).split())[:200]
        command = exact_prepare_command(manifest, prepare_hint)
        raise UserError(f"prepared data at {path} is unreadable ({reason}); re-run: {command}") from None
