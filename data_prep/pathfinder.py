"""Pathfinder (32 px) and Path-X (128 px): reader of the official release layout, and ``prepare``.

Release layout: ``pathfinder<size>/<difficulty>/{imgs/<k>/sample_<i>.png, metadata/<k>.npy}`` with
difficulty ``curv_baseline`` (contour length 6), ``curv_contour_length_9`` or ``curv_contour_length_14``
(LRA's choice). The metadata files are space-separated *text* despite ``.npy``; per image one line whose
fields 0 and 1 locate the PNG (``imgs/<k> sample_<i>.png``) and field 3 is the label (as LRA's TFDS
builder and the Nystromformer preprocessing read them).

Tokens are the pixel values 0..255 (vocabulary 256, row-major). Black (0) is a real token: every sequence
has its true length (1024 or 16384), so nothing is masked. Empty images (a zero-byte file, as one in the
public release, or an all-black image) are skipped with a warning; a PNG that does not decode, a missing
file or a malformed metadata line aborts with file and line. Splits: a seeded permutation cut 80/10/10.

Presets: ``full`` (200000 images, contour 14 — LRA), ``intermediate`` (contour 9), ``easy`` (contour 6,
``curv_baseline``), ``tiny`` (a few images for smoke tests). Without ``--source`` the images are generated
(``pathfinder_gen``); with it, ``--source`` is the ``pathfinder<size>`` folder of the release, or one of
its difficulty folders.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from lra_cond.data_prep.pathfinder_gen import DIFFICULTIES, pathfinder_config
from lra_cond.data_prep.pathfinder_release import write_release
from lra_cond.errors import UserError

SPLIT_FRACTIONS = (0.8, 0.9)  # train ends at 80%, val at 90%, test takes the rest


@dataclass(frozen=True)
class Preset:
    images: int
    contour_length: int


PRESETS = {
    32: {
        "full": Preset(200_000, 14),
        "intermediate": Preset(200_000, 9),
        "easy": Preset(200_000, 6),
        "tiny": Preset(160, 14),
    },
    128: {
        "full": Preset(200_000, 14),
        "intermediate": Preset(200_000, 9),
        "easy": Preset(200_000, 6),
        "tiny": Preset(32, 14),
    },
}


def _metadata_files(root: Path) -> list[Path]:
    files = [p for p in (root / "metadata").iterdir() if p.suffix == ".npy" and p.is_file()]
    return sorted(files, key=lambda p: (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.stem))


def _metadata_rows(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, fields) per line. The release's files are text; a true ``.npy`` string array (what
    the reference generator's ``np.save`` would write) is accepted too, one row per line."""
    raw = path.read_bytes()
    if raw.startswith(b"\x93NUMPY"):
        try:
            table = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise UserError(f"{path}: unreadable .npy metadata ({e})") from None
        return [(i, [str(v) for v in row]) for i, row in enumerate(np.atleast_2d(table), start=1)]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text metadata file (expected space-separated lines)") from None
    return [(i, line.split()) for i, line in enumerate(text.splitlines(), start=1)]


def read_metadata_file(path: Path, root: Path, size: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Pixels (n, size*size) uint8 and labels (n,) of one metadata file; also the skipped image paths."""
    pixels, labels, skipped = [], [], []
    for lineno, fields in _metadata_rows(Path(path)):
        if not fields:
            continue
        if len(fields) < 4:
            raise UserError(
                f"{path}:{lineno}: expected at least 4 space-separated fields (folder, file, index, label), "
                f"got {len(fields)}"
            )
        try:
            label = int(fields[3])
        except ValueError:
            raise UserError(f"{path}:{lineno}: label {fields[3]!r} is not an integer") from None
        if label not in (0, 1):
            raise UserError(f"{path}:{lineno}: label {label} is not 0 or 1")
        image_path = root / fields[0] / fields[1]
        if not image_path.is_file():
            raise UserError(f"{path}:{lineno}: image {image_path} does not exist")
        if image_path.stat().st_size == 0:
            skipped.append(str(image_path))
            continue
        try:
            with Image.open(image_path) as im:
                image = np.asarray(im if im.mode == "L" else im.convert("L"))
        except Exception as e:  # PIL raises several types for broken files
            raise UserError(f"{path}:{lineno}: image {image_path} does not decode ({e})") from None
        if image.shape != (size, size):
            raise UserError(
                f"{path}:{lineno}: image {image_path} is {image.shape}, expected ({size}, {size})"
            )
        if not image.any():
            skipped.append(str(image_path))
            continue
        pixels.append(image.reshape(-1))
        labels.append(label)
    empty = np.zeros((0, size * size), np.uint8)
    return (np.stack(pixels) if pixels else empty), np.asarray(labels, dtype=np.int64), skipped


def _read_args(args: tuple) -> tuple[np.ndarray, np.ndarray, list[str]]:
    return read_metadata_file(*args)


def read_release(root: Path, size: int, workers: int = 1) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """All images of one difficulty folder in metadata order: (pixels, labels, skipped paths).

    Empty images are skipped with a ``UserWarning`` naming them.
    """
    root = Path(root)
    if not (root / "metadata").is_dir():
        raise UserError(f"{root} has no metadata/ folder; expected the release layout {{imgs,metadata}}")
    files = _metadata_files(root)
    if not files:
        raise UserError(f"{root / 'metadata'} holds no .npy metadata files")
    jobs = [(f, root, size) for f in files]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
            parts = list(pool.map(_read_args, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
    else:
        parts = [read_metadata_file(*job) for job in jobs]
    pixels = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    skipped = [s for p in parts for s in p[2]]
    if skipped:
        shown = ", ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else "")
        warnings.warn(f"skipped {len(skipped)} empty image(s) in {root}: {shown}", UserWarning, stacklevel=2)
    if len(labels) == 0:
        raise UserError(f"{root} holds no usable images")
    return pixels, labels, skipped


def split(pixels: np.ndarray, labels: np.ndarray, seed: int) -> dict[str, dict[str, list]]:
    """Seeded permutation cut into train/val/test at 80% and 90% (the Nystromformer cut, seeded)."""
    n = len(labels)
    order = np.random.default_rng(seed).permutation(n)
    cuts = [0, int(n * SPLIT_FRACTIONS[0]), int(n * SPLIT_FRACTIONS[1]), n]
    out = {}
    for name, lo, hi in zip(("train", "val", "test"), cuts[:-1], cuts[1:]):
        idx = order[lo:hi]
        out[name] = {"input_ids": list(pixels[idx]), "label": labels[idx].tolist()}
    return out


def resolve_source(source: Path, size: int, difficulty: str) -> Path:
    """The difficulty folder to read: ``source`` itself if it holds metadata/, else a child of it."""
    source = Path(source)
    for candidate in (source, source / difficulty, source / f"pathfinder{size}" / difficulty):
        if (candidate / "metadata").is_dir():
            return candidate
    raise UserError(
        f"no Pathfinder data at {source}: expected {source}/{difficulty}/{{imgs,metadata}} (the "
        f"pathfinder{size} folder of lra_release.gz from github.com/google-research/long-range-arena), "
        "or omit --source to generate the images locally"
    )


def prepare_size(
    size: int, out_dir: Path, preset: str, source: Path | None, seed: int, workers: int
) -> tuple[dict, dict]:
    """Splits and manifest for one resolution; generates the release under ``out_dir/source`` if needed."""
    if preset not in PRESETS[size]:
        raise UserError(f"unknown preset '{preset}'; valid presets: {', '.join(PRESETS[size])}")
    p = PRESETS[size][preset]
    difficulty = DIFFICULTIES[p.contour_length]
    if source is None:
        cfg = pathfinder_config(size, p.contour_length)
        root = write_release(Path(out_dir) / "source", cfg, p.images, seed, workers)
        manifest = {"source": "generated", "seed": seed, "generator": cfg.to_dict(), "images": p.images}
    else:
        root = resolve_source(source, size, difficulty)
        manifest = {"source": str(root.resolve())}
    pixels, labels, skipped = read_release(root, size, workers)
    manifest |= {
        "difficulty": difficulty,
        "image_size": size,
        "split": f"seeded permutation (seed {seed}) cut 80/10/10",
        "skipped_empty_images": skipped,
        "positives": int(labels.sum()),
    }
    return split(pixels, labels, seed), manifest


def prepare(out_dir: Path, preset: str, source: Path | None, seed: int, workers: int) -> tuple[dict, dict]:
    """Pathfinder-32 (``pathfinder32``, 1024 tokens)."""
    return prepare_size(32, out_dir, preset, source, seed, workers)


def prepare_pathx(
    out_dir: Path, preset: str, source: Path | None, seed: int, workers: int
) -> tuple[dict, dict]:
    """Path-X (``pathfinder128``, 16384 tokens)."""
    return prepare_size(128, out_dir, preset, source, seed, workers)
