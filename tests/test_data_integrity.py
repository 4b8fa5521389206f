"""Prepared cache: manifest contents, byte-reproducibility, atomic writes, corruption detection."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from datasets import Dataset

from lra_cond.data import cache
from lra_cond.data.tasks import TASKS
from lra_cond.data_prep import listops
from lra_cond.errors import UserError

SPEC = TASKS.get("listops")


def prepare(root: Path, seed: int = 0) -> Path:
    return SPEC.prepare(root, "tiny", seed=seed, workers=1)


def hint(root: Path) -> str:
    return SPEC.prepare_command(root, "tiny")


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def prepared(tmp_path, tiny_listops) -> tuple[Path, Path]:
    """(data root, prepared dir): a private copy of the tiny cache, mtimes preserved."""
    root = tmp_path / "data"
    shutil.copytree(tiny_listops, root)
    return root, cache.prepared_dir(root, "listops", "tiny")


def test_manifest_records_source_params_sizes_and_checksums(prepared):
    _, out = prepared
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == "generated" and manifest["seed"] == 0
    assert manifest["generator"]["sizes"] == [512, 128, 128] and manifest["generator"]["max_len"] == 200
    assert manifest["sizes"] == {"train": 512, "val": 128, "test": 128}
    on_disk = {
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and p.name not in ("manifest.json", "verified.json")
    }
    assert set(manifest["files"]) == on_disk
    assert {f"{s}/data-00000-of-00001.arrow" for s in ("train", "val", "test")} <= on_disk
    for name, info in manifest["files"].items():
        data = (out / name).read_bytes()
        assert info == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_same_seed_reproduces_sources_and_manifest_bytes(tmp_path):
    a, b, c = (prepare(tmp_path / name, seed) for name, seed in (("a", 3), ("b", 3), ("c", 4)))
    release = Path("listops/tiny/source") / listops.RELEASE_DIR
    assert tree_bytes(tmp_path / "a" / release) == tree_bytes(tmp_path / "b" / release)
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    arrow = {k: v for k, v in tree_bytes(a).items() if k.endswith(".arrow")}
    assert arrow == {k: v for k, v in tree_bytes(b).items() if k.endswith(".arrow")}
    other = json.loads((c / "manifest.json").read_text())["files"]
    mine = json.loads((a / "manifest.json").read_text())["files"]
    assert other["train/data-00000-of-00001.arrow"] != mine["train/data-00000-of-00001.arrow"]


def test_interrupted_prepare_leaves_nothing_that_loads(tmp_path, monkeypatch):
    """Die while writing the second split: first with no cache yet, then over a good cache."""
    root = tmp_path / "data"
    out = cache.prepared_dir(root, "listops", "tiny")
    original = Dataset.save_to_disk
    calls = []

    def dies_on_second_split(self, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C or a kill, after train/ is on disk
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(Dataset, "save_to_disk", dies_on_second_split)
    with pytest.raises(KeyboardInterrupt):
        prepare(root)
    assert (out.parent / "prepared.tmp" / "train").is_dir()  # the partial write really happened
    assert not cache.is_prepared(out)
    with pytest.raises(UserError, match="no prepared data at"):
        cache.load_prepared(out, hint(root))

    monkeypatch.setattr(Dataset, "save_to_disk", original)
    prepare(root)
    good = tree_bytes(out)
    assert not (out.parent / "prepared.tmp").exists()  # the leftover was cleared

    calls.clear()
    monkeypatch.setattr(Dataset, "save_to_disk", dies_on_second_split)
    with pytest.raises(KeyboardInterrupt):
        prepare(root, seed=1)
    assert tree_bytes(out) == good  # the previous cache is untouched and still loads
    assert len(cache.load_prepared(out, hint(root))["train"]) == 512


def test_truncated_arrow_file_is_reported_with_the_exact_prepare_command(prepared):
    root, out = prepared
    arrow = out / "train/data-00000-of-00001.arrow"
    size = arrow.stat().st_size
    with open(arrow, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(UserError) as e:
        cache.load_prepared(out, hint(root))
    message = str(e.value)
    assert "\n" not in message and "is corrupt" in message
    assert f"train/data-00000-of-00001.arrow: {size // 2} bytes, the manifest says {size}" in message
    assert message.endswith(f"re-run: {hint(root)} --seed 0")


@pytest.mark.parametrize("stamp", ["changed mtime", "same size and mtime"])
def test_same_size_corruption_fails_the_checksum(prepared, stamp):
    """A changed byte is caught whatever the file's metadata say: bit rot, or a copy tool that keeps
    modification times, leaves the size and mtime as they were."""
    root, out = prepared
    cache.load_prepared(out, hint(root))  # a good load first (it used to remember the metadata)
    arrow = out / "val/data-00000-of-00001.arrow"
    st = arrow.stat()
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0xFF
    arrow.write_bytes(bytes(data))
    shift = 10**9 if stamp == "changed mtime" else 0
    os.utime(arrow, ns=(st.st_atime_ns, st.st_mtime_ns + shift))
    with pytest.raises(UserError, match=r"val/data-00000-of-00001.arrow: sha256 differs from the manifest"):
        cache.load_prepared(out, hint(root))


def test_every_load_reads_every_file(prepared, monkeypatch):
    root, out = prepared
    hashed = []
    real = cache.file_sha256
    monkeypatch.setattr(cache, "file_sha256", lambda p: hashed.append(p) or real(p))
    manifest = json.loads((out / "manifest.json").read_text())
    for _ in range(2):
        hashed.clear()
        cache.load_prepared(out, hint(root))
        assert sorted(p.relative_to(out).as_posix() for p in hashed) == sorted(manifest["files"])
