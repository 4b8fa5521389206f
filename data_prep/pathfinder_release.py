"""Write generated Pathfinder images in the official release layout, plus a grid for people to look at.

Layout (as the LRA release, so one reader serves both)::

    pathfinder<size>/<difficulty>/imgs/<k>/sample_<i>.png
    pathfinder<size>/<difficulty>/metadata/<k>.npy      # space-separated text despite the suffix
    pathfinder<size>/<difficulty>/samples.png           # ours: a labelled grid of the first images
    pathfinder<size>/<difficulty>/generator.json        # ours: settings, for resuming and provenance

One metadata line per image, fields as the reference generator writes them:
``imgs/<k> sample_<i>.png <i> <label> <continuity> <contour_length> <distractor_length> <paddle_length>
<paddle_thickness> <margin> <number of paddle contrasts>``; readers use fields 0, 1 and 3.

Chunk ``k`` (``chunk`` images) is drawn from its own seed ``(seed, size, contour_length, k)``, so the files
are a function of the seed alone, whatever the number of worker processes.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from lra_cond.data_prep.pathfinder_gen import DIFFICULTIES, SnakeConfig, balanced_labels, generate_samples
from lra_cond.data_prep.progress import progress_bar

CHUNK = 1000  # images per imgs/<k> folder and metadata file
GRID = 16  # images shown in samples.png
FORMAT_VERSION = 1


def release_dir(out_dir: Path, cfg: SnakeConfig) -> Path:
    return Path(out_dir) / f"pathfinder{cfg.size}" / DIFFICULTIES[cfg.contour_length]


def chunk_rng(seed: int, cfg: SnakeConfig, k: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, cfg.size, cfg.contour_length, k]))


def metadata_line(cfg: SnakeConfig, k: int, i: int, label: int, margin: int) -> str:
    fields = (
        f"imgs/{k}",
        f"sample_{i}.png",
        i,
        label,
        cfg.continuity,
        cfg.contour_length,
        cfg.distractor_length,
        cfg.paddle_length,
        cfg.thickness,
        margin,
        1,
    )
    return " ".join(f"{f:g}" if isinstance(f, float) else str(f) for f in fields)


def chunk_labels(
    seed: int, cfg: SnakeConfig, k: int, chunk: int, n: int
) -> tuple[np.random.Generator, np.ndarray]:
    """The chunk's random stream and its labels (drawn first from it)."""
    rng = chunk_rng(seed, cfg, k)
    return rng, balanced_labels(rng, n, offset=k * chunk)


def write_chunk(root: Path, cfg: SnakeConfig, seed: int, k: int, chunk: int, n: int) -> dict:
    """Generate chunk ``k`` (its n images) into ``root``; the metadata file is written last, atomically."""
    rng, labels = chunk_labels(seed, cfg, k, chunk, n)
    samples = generate_samples(rng, cfg, labels)
    img_dir = Path(root) / "imgs" / str(k)
    img_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, s in enumerate(samples):
        Image.fromarray(s.image, mode="L").save(img_dir / f"sample_{i}.png")
        lines.append(metadata_line(cfg, k, i, s.label, s.margin))
    meta = Path(root) / "metadata" / f"{k}.npy"
    meta.parent.mkdir(parents=True, exist_ok=True)
    tmp = meta.with_name(meta.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(meta)
    return {
        "images": n,
        "positives": sum(s.label for s in samples),
        "distractors": float(np.mean([s.stats["distractors"] for s in samples])),
        "target_attempts_per_image": samples[0].stats["target_attempts_per_image"],
    }


def _write_chunk_args(args: tuple) -> dict:
    return write_chunk(*args)


def write_release(
    out_dir: Path,
    cfg: SnakeConfig,
    n: int,
    seed: int = 0,
    workers: int = 1,
    chunk: int = CHUNK,
    grid: bool = True,
) -> Path:
    """Generate ``n`` images into the release layout under ``out_dir``; returns the difficulty dir.

    An interrupted run with the same settings resumes (chunks whose metadata exists are kept); a
    directory written with other settings is replaced.
    """
    root = release_dir(out_dir, cfg)
    spec = {"format": FORMAT_VERSION, "generator": cfg.to_dict(), "seed": seed, "images": n, "chunk": chunk}
    spec = json.loads(json.dumps(spec))  # as it reads back (tuples become lists)
    spec_path = root / "generator.json"
    if root.exists() and (not spec_path.is_file() or json.loads(spec_path.read_text()) != spec):
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    jobs = [
        (root, cfg, seed, k, chunk, min(chunk, n - k * chunk))
        for k in range(-(-n // chunk))
        if not (root / "metadata" / f"{k}.npy").is_file()
    ]
    with progress_bar() as bar:
        task = bar.add_task(f"generating pathfinder{cfg.size} {root.name}", total=n)
        bar.update(task, completed=n - sum(j[-1] for j in jobs))
        if workers > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
                for info in pool.map(_write_chunk_args, jobs):
                    bar.advance(task, info["images"])
        else:
            for job in jobs:
                bar.advance(task, write_chunk(*job)["images"])
    if grid:
        write_grid(root)
    return root


def write_grid(root: Path, count: int = GRID) -> Path:
    """``samples.png``: the first images of chunk 0 with their labels, for a person to check the task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = (Path(root) / "metadata" / "0.npy").read_text().split("\n")
    rows = [line.split() for line in lines if line.strip()][:count]
    cols = 4
    fig, axes = plt.subplots(-(-len(rows) // cols), cols, figsize=(2.2 * cols, 2.4 * -(-len(rows) // cols)))
    for ax in np.atleast_1d(axes).flat:
        ax.axis("off")
    for ax, fields in zip(np.atleast_1d(axes).flat, rows):
        image = np.asarray(Image.open(Path(root) / fields[0] / fields[1]))
        ax.imshow(image, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        label = int(fields[3])
        ax.set_title(f"{fields[1]}\nlabel {label}: {'connected' if label else 'not connected'}", fontsize=7)
    fig.suptitle(f"{Path(root).parent.name}/{Path(root).name}: are the two markers on one curve?", fontsize=9)
    fig.tight_layout()
    out = Path(root) / "samples.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
