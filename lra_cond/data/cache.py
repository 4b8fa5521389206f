"""The prepared cache: a Hugging Face ``datasets`` Arrow DatasetDict on disk.

Layout: ``<data_dir>/<task>/<preset>/prepared/`` with splits train/val/test and columns
``input_ids`` (ragged int16 token ids, 0 = pad never stored), ``length`` (true length) and
``label``. Pair tasks add ``input_ids2``/``length2``. Written to a temporary directory and renamed
on success, so an interrupted prepare leaves nothing that loads. ``manifest.json`` (written last, so
it marks a complete cache) records the source, generator parameters and seed, split sizes, and the
size and sha256 of every file; every load checks both, so a truncated or altered cache (even one
whose sizes and modification times were kept) is reported with the exact ``prepare`` command that
rebuilds it.

A cache is replaced only by a good one: splits are checked (none empty, every sequence within the
task's length and vocabulary, every label a class) before anything is written. Writers of one
``<task>/<preset>`` serialise on an ``flock`` (``<data_dir>/<task>/<preset>/.lock``); loading takes it
shared, so a cache is never read while it is being swapped. Loading also checks the manifest's task
and preset, so a cache copied to the wrong place is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, load_from_disk

from lra_cond.data.documents import is_ids, is_length, length_key
from lra_cond.errors import UserError, user_path
from lra_cond.locks import FileLock

MANIFEST = "manifest.json"
VERIFIED = "verified.json"  # written by earlier versions (checksums skipped when unchanged): ignored
LOCK = ".lock"
SPLITS = ("train", "val", "test")
_HASH_BUFFER = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What the model can take: sequences of 0..max_len ids below vocab_size, labels below num_classes."""

    max_len: int
    vocab_size: int
    num_classes: int


@contextmanager
def no_hub_progress_bars() -> Iterator[None]:
    """Hugging Face ``datasets`` draws its own tqdm bars ("Saving the dataset"), which interleave with
    the suite's rich bars: one style of bar, so they are off while we save or load a cache."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def default_data_dir() -> Path:
    """Where data goes by default: ``$LRA_DATA``, else ``lra_cond`` in the per-user cache
    (``$XDG_CACHE_HOME``, else ``~/.cache``), as Hugging Face datasets and torch hub do, so the same
    data is found from any working directory."""
    if os.environ.get("LRA_DATA"):
        return Path(user_path(os.environ["LRA_DATA"]))
    return Path(user_path(os.environ.get("XDG_CACHE_HOME") or "~/.cache")) / "lra_cond"


def cache_around(data_dir: str | Path) -> Path | None:
    """The prepared cache that ``data_dir`` is, or lies inside of, or that lies one or two levels
    below it as ``<preset>/prepared`` or ``prepared`` (a task or preset folder given as the data
    root); None for a proper data root."""
    path = Path(data_dir).resolve()
    for p in (path, *path.parents):
        if p.name == "prepared" and (p / MANIFEST).is_file():
            return p
    for below in (path / "prepared", *path.glob("*/prepared")):
        if (below / MANIFEST).is_file():
            return below
    return None


def check_data_root(data_dir: str | Path, option: str) -> None:
    """A data root that is a prepared cache or part of one is refused (a second cache would be built
    inside the first); ``option`` names the flag to correct."""
    inside = cache_around(data_dir)
    if inside is not None:
        raise UserError(
            f"data dir {data_dir} is a prepared cache or part of one ({inside}); give the data root that "
            f"holds <task>/<preset>/prepared: {option} {inside.parent.parent.parent}"
        )


def task_dir(data_dir: str | Path, task: str, preset: str) -> Path:
    return Path(data_dir) / task / preset


def prepared_dir(data_dir: str | Path, task: str, preset: str) -> Path:
    return task_dir(data_dir, task, preset) / "prepared"


@contextmanager
def locked(
    data_dir: str | Path, task: str, preset: str, shared: bool = False, on_wait: Callable | None = None
) -> Iterator[None]:
    """Hold the ``<task>/<preset>`` cache lock: exclusive to write, shared to read (waits for a holder).

    A writer creates the lock file (``<data_dir>/<task>/<preset>/.lock``) and removes it when done,
    as it does the folders it made for nothing (a failed prepare leaves no trace). Readers write
    nothing: where there is no lock file no writer is at work, and where it cannot be opened (a
    read-only copy) they read without it.
    """
    folder = task_dir(data_dir, task, preset)
    lock = FileLock(folder / LOCK, shared=shared, create=not shared)
    made = []
    if not shared:
        p = folder
        while not p.exists():
            made.append(p)
            p = p.parent
        folder.mkdir(parents=True, exist_ok=True)
    try:
        lock.acquire(blocking=True, on_wait=on_wait)
    except OSError:
        if not shared:
            raise
        yield
        return
    try:
        yield
    finally:
        lock.release()
        for d in made:  # deepest first; stops at the first that is not empty
            try:
                d.rmdir()
            except OSError:
                break


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
        if is_ids(name):
            arrays[name] = ragged(col)
            arrays[length_key(name)] = pa.array([len(s) for s in col], pa.int32())
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


def check_tables(tables: dict[str, pa.Table], limits: Limits, source: str) -> None:
    """Refuse splits a run cannot use: a missing or empty split, a sequence longer than the model's
    position table, a token id outside the vocabulary, a label that is not a class."""

    def refuse(what: str) -> UserError:
        return UserError(f"{source}: {what}; nothing was written (an existing cache is unchanged)")

    for split in SPLITS:
        if split not in tables or tables[split].num_rows == 0:
            raise refuse(f"the {split} split is empty (0 examples): a run could not train or evaluate on it")
    for split, table in tables.items():
        for name in table.column_names:
            column = table.column(name)
            if is_length(name):
                longest = pc.max(column).as_py()
                if longest is not None and longest > limits.max_len:
                    i = pc.index(column, longest).as_py()
                    raise refuse(
                        f"example {i} of the {split} split has {longest} tokens, more than the task's "
                        f"maximum length {limits.max_len} (the model's position table)"
                    )
            elif is_ids(name):
                low, high = pc.min_max(pc.list_flatten(column)).values()
                if low.as_py() is not None and (low.as_py() < 0 or high.as_py() >= limits.vocab_size):
                    bad = low.as_py() if low.as_py() < 0 else high.as_py()
                    raise refuse(
                        f"the {split} split holds token id {bad}, outside the vocabulary "
                        f"0..{limits.vocab_size - 1}"
                    )
            elif name == "label":
                low, high = pc.min_max(column).values()
                if low.as_py() < 0 or high.as_py() >= limits.num_classes:
                    bad = low.as_py() if low.as_py() < 0 else high.as_py()
                    raise refuse(
                        f"the {split} split holds label {bad}, not a class 0..{limits.num_classes - 1}"
                    )


def recover(out: Path) -> None:
    """A prepare killed between its two renames (``out`` -> ``.old``, ``.tmp`` -> ``out``) left the
    previous good cache in ``.old``: put it back. The caller holds the cache lock."""
    out = Path(out)
    old = out.with_name(out.name + ".old")
    if not is_prepared(out) and is_prepared(old):
        if out.exists():
            shutil.rmtree(out)
        old.rename(out)


def save_prepared(
    out: Path, splits: dict[str, dict[str, Any]], manifest: dict[str, Any], limits: Limits | None = None
) -> Path:
    """Write splits atomically to ``out`` (a ``prepared`` directory) with a manifest.

    With ``limits``, the splits are checked first (``check_tables``): a bad source replaces nothing.
    The caller holds the cache lock (``TaskSpec.prepare`` does).
    """
    out = Path(out)
    tables = {name: _table(cols) for name, cols in splits.items()}
    if limits is not None:
        check_tables(tables, limits, f"source {manifest.get('source', '?')}")
    out.parent.mkdir(parents=True, exist_ok=True)
    recover(out)
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    for stale in (tmp, old):  # left by an earlier interrupted prepare
        if stale.exists():
            shutil.rmtree(stale)
    dd = DatasetDict({name: Dataset(table) for name, table in tables.items()})
    with no_hub_progress_bars():
        dd.save_to_disk(str(tmp))
    sizes = {name: len(ds) for name, ds in dd.items()}
    files = {
        p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in _data_files(tmp)
    }
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


def exact_prepare_command(manifest: dict[str, Any], hint: str) -> str:
    """``hint`` (a shell command) plus the ``--source``/``--seed`` recorded in the manifest, so a
    rebuild is identical; every added word is shell-quoted."""
    source = manifest.get("source")  # a path, or "generated" / "fixture" / "hub:<id>"
    words = shlex.split(hint)
    if isinstance(source, str) and os.path.isabs(source) and "--source" not in words:
        hint += f" --source {shlex.quote(source)}"
    if "seed" in manifest and "--seed" not in words:
        hint += f" --seed {shlex.quote(str(manifest['seed']))}"
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
    # Every load reads every byte: a change that keeps a file's size and modification time (bit rot,
    # a copy tool that keeps mtimes) is caught too. sha256 runs at about 1 GB/s: 0.2 s for ListOps.
    for name, info in files.items():
        if file_sha256(path / name) != info["sha256"]:
            raise corrupt(name, "sha256 differs from the manifest")


def is_prepared(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def check_manifest(
    path: Path, manifest: dict[str, Any], command: str, task: str | None, preset: str | None
) -> None:
    """The manifest belongs here (task and preset) and no split is empty."""
    if not isinstance(manifest, dict):
        raise UserError(f"prepared data at {path} has a corrupt {MANIFEST}; re-run: {command}")
    for key, want in (("task", task), ("preset", preset)):
        have = manifest.get(key)
        if want is not None and have is not None and have != want:
            raise UserError(
                f"prepared data at {path} was built for {key} {have!r} (its {MANIFEST}), not {want!r}: it "
                f"was copied or moved to the wrong folder; re-run: {command}"
            )
    for split, size in (manifest.get("sizes") or {}).items():
        if not size:
            raise UserError(
                f"prepared data at {path} has an empty {split} split (0 examples); re-run: {command}"
            )


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / MANIFEST).read_text())


def data_sha256(manifest: dict[str, Any]) -> str:
    """One checksum of a cache's content (over its files' checksums): equal for byte-identical data
    wherever it lives, different after a rebuild from another seed or source."""
    files = {name: info.get("sha256") for name, info in (manifest.get("files") or {}).items()}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def load_prepared(
    path: Path,
    prepare_hint: str,
    task: str | None = None,
    preset: str | None = None,
    limits: Limits | None = None,
) -> DatasetDict:
    """Load a prepared cache after checking it (manifest, sizes, checksums; with ``limits``, that its
    sequences fit the model). ``prepare_hint`` is the shell command that builds it."""
    path = Path(path)
    if not is_prepared(path):
        raise UserError(f"no prepared data at {path}; run: {prepare_hint}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except ValueError:
        raise UserError(f"prepared data at {path} has a corrupt {MANIFEST}; re-run: {prepare_hint}") from None
    command = exact_prepare_command(manifest, prepare_hint) if isinstance(manifest, dict) else prepare_hint
    check_manifest(path, manifest, command, task, preset)
    verify_prepared(path, manifest, prepare_hint)
    try:
        with no_hub_progress_bars():
            dd = load_from_disk(str(path))
    except Exception as e:  # corrupt Arrow files surface as many exception types
        reason = " ".join(str(e).split())[:200]
        raise UserError(f"prepared data at {path} is unreadable ({reason}); re-run: {command}") from None
    if limits is not None:
        # A cache written before these checks existed may hold what the model cannot take.
        try:
            check_tables({name: ds.data.table for name, ds in dd.items()}, limits, f"prepared data at {path}")
        except UserError as e:
            message = str(e).split("; nothing was written")[0]
            raise UserError(f"{message}; re-run: {command}") from None
    return dd
