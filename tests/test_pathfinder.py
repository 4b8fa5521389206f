"""Pathfinder / Path-X: generator determinism, balance and connectivity; reader; prepare; CLI smoke test.

Connectivity: each snake is a dashed curve, so its drawn pixels are not literally 4-connected. What
"the markers sit on one curve" means here: the test rasterises, with its own code, the *undashed*
path of every snake (paddles plus the gaps between consecutive paddles) as the pixels whose centre
lies within 0.71 px of it (0.71 > sqrt(2)/2, so a path gives a 4-connected pixel set), takes the union
over all snakes, and flood-fills from one marker. It separately checks that this geometry is what the
image shows: every paddle centre is drawn, gaps within a snake are at most 2 * margin (the dash), the
markers are bright, and no pixel is lit away from the geometry.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lra_cond.data_prep import pathfinder as pf
from lra_cond.data_prep.pathfinder_gen import generate_samples, pathfinder_config
from lra_cond.data_prep.pathfinder_release import chunk_labels, write_release
from lra_cond.errors import UserError
from tests.conftest import TINY_FIT, assert_one_line_error, run_cli

PATH_RADIUS = 0.71


# ---------------------------------------------------------------------------------------------------------
# independent helpers


def _dist_to_segments(points: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Naive distance of each point (P, 2) to the nearest segment a-b (S, 2); returns (P,)."""
    best = np.full(len(points), np.inf)
    for s0, s1 in zip(a, b):
        d = s1 - s0
        t = np.clip(((points - s0) @ d) / max(d @ d, 1e-12), 0, 1)
        best = np.minimum(best, np.linalg.norm(points - (s0 + t[:, None] * d), axis=1))
    return best


def _path_segments(paddles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Undashed path of one snake: its paddles and the gap pieces joining consecutive paddles."""
    pts = paddles.reshape(-1, 2)  # tail0, head0, tail1, head1, ...
    return pts[:-1], pts[1:]


def _flood(mask: np.ndarray, start: tuple[int, int]) -> np.ndarray:
    seen = np.zeros_like(mask)
    if not mask[start]:
        return seen
    queue = deque([start])
    seen[start] = True
    while queue:
        r, c = queue.popleft()
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nr < mask.shape[0] and 0 <= nc < mask.shape[1] and mask[nr, nc] and not seen[nr, nc]:
                seen[nr, nc] = True
                queue.append((nr, nc))
    return seen


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.parent.name != root.name  # imgs/* and metadata/*, not generator.json
    }


# ---------------------------------------------------------------------------------------------------------
# generator


def test_release_is_deterministic_and_independent_of_workers(tmp_path: Path) -> None:
    cfg = pathfinder_config(32, 14)
    a = write_release(tmp_path / "a", cfg, 20, seed=3, workers=1, chunk=6, grid=False)
    b = write_release(tmp_path / "b", cfg, 20, seed=3, workers=2, chunk=6, grid=False)
    c = write_release(tmp_path / "c", cfg, 20, seed=4, workers=1, chunk=6, grid=False)
    fa, fb, fc = _files(a), _files(b), _files(c)
    assert (
        len([k for k in fa if k.endswith(".png")]) == 20
        and len([k for k in fa if k.startswith("metadata")]) == 4
    )
    assert fa == fb  # byte-identical PNGs and metadata with 1 or 2 processes
    assert fa.keys() == fc.keys()
    assert sum(fa[k] != fc[k] for k in fa if k.endswith(".png")) == 20  # another seed: other images
    # metadata lines in the official format, with the label in field 3 matching the image count
    lines = (a / "metadata" / "3.npy").read_text().splitlines()
    assert [ln.split()[:3] for ln in lines] == [
        ["imgs/3", "sample_0.png", "0"],
        ["imgs/3", "sample_1.png", "1"],
    ]
    assert all(ln.split()[3] in ("0", "1") and len(ln.split()) == 11 for ln in lines)


def test_interrupted_release_resumes_identically(tmp_path: Path) -> None:
    cfg = pathfinder_config(32, 14)
    root = write_release(tmp_path, cfg, 12, seed=0, chunk=6, grid=False)
    before = _files(root)
    kept = root / "imgs" / "0" / "sample_0.png"
    stamp = kept.stat().st_mtime_ns
    (root / "metadata" / "1.npy").unlink()  # chunk 1 never finished
    (root / "imgs" / "1" / "sample_5.png").unlink()
    write_release(tmp_path, cfg, 12, seed=0, chunk=6, grid=False)
    assert _files(root) == before and kept.stat().st_mtime_ns == stamp  # chunk 0 kept, chunk 1 redone
    write_release(tmp_path, cfg, 12, seed=1, chunk=6, grid=False)  # other settings: replaced
    assert _files(root).keys() == before.keys() and _files(root) != before


def test_pathx_release_reads_back_at_128(tmp_path: Path) -> None:
    """Path-X: generated 128 px PNGs and metadata read back as 16384 tokens with their labels."""
    cfg = pathfinder_config(128, 14)
    root = write_release(tmp_path, cfg, 4, seed=0, workers=1, chunk=4, grid=False)
    assert root == tmp_path / "pathfinder128" / "curv_contour_length_14"
    pixels, labels, skipped = pf.read_release(root, 128)
    assert pixels.shape == (4, 16384) and not skipped
    rows = [ln.split() for ln in (root / "metadata" / "0.npy").read_text().splitlines()]
    assert labels.tolist() == [int(r[3]) for r in rows] and sorted(labels.tolist()) == [0, 0, 1, 1]
    for row, fields in zip(pixels, rows):
        np.testing.assert_array_equal(row, np.asarray(Image.open(root / fields[0] / fields[1])).reshape(-1))


@pytest.mark.parametrize("chunk", [1000, 7, 3])
def test_label_balance_on_1000(chunk: int) -> None:
    """Labels of a 1000-image release, chunk by chunk exactly as write_chunk draws them."""
    cfg = pathfinder_config(32, 14)
    labels = np.concatenate(
        [chunk_labels(0, cfg, k, chunk, min(chunk, 1000 - k * chunk))[1] for k in range(-(-1000 // chunk))]
    )
    assert len(labels) == 1000
    assert 0.45 <= labels.mean() <= 0.55
    assert 0.4 < labels[:100].mean() < 0.6 and np.abs(np.diff(labels)).sum() > 300  # not sorted runs


@pytest.mark.parametrize(("size", "count"), [(32, 60), (128, 6)])
def test_markers_connected_iff_label(size: int, count: int) -> None:
    cfg = pathfinder_config(size, 14)
    rng = np.random.default_rng(11)
    requested = np.arange(count) % 2
    samples = generate_samples(rng, cfg, requested)
    grid = (
        np.stack(np.meshgrid(np.arange(size), np.arange(size), indexing="ij"), -1)
        .reshape(-1, 2)
        .astype(float)
    )
    for s, want in zip(samples, requested):
        assert s.label == want
        # markers sit on the ends of the snakes they claim
        i, j = s.marker_snakes
        np.testing.assert_allclose(s.markers[0], s.paddles[i][0, 0])
        np.testing.assert_allclose(s.markers[1], s.paddles[j][-1, 1])
        assert (i == j) == bool(s.label) and i in (0, 1) and j in (0, 1)
        # the path mask, rasterised here
        a, b = zip(*(_path_segments(p) for p in s.paddles))
        a, b = np.concatenate(a), np.concatenate(b)
        mask = (_dist_to_segments(grid, a, b) <= PATH_RADIUS).reshape(size, size)
        start, goal = (tuple(np.rint(m).astype(int)) for m in s.markers)
        reached = _flood(mask, start)
        assert mask[start] and mask[goal]
        assert bool(reached[goal]) == bool(s.label), f"label {s.label} but flood fill reached={reached[goal]}"
        # the geometry is what the image shows
        for p in s.paddles:
            mid = np.rint(p.mean(axis=1)).astype(int)
            assert (s.image[mid[:, 0], mid[:, 1]] > 0).all()  # every paddle is drawn
            gaps = np.linalg.norm(p[1:, 0] - p[:-1, 1], axis=1)
            assert (gaps <= 2 * s.margin + 1e-9).all()  # dashes, not breaks
        for m in s.markers:
            r, c = np.rint(m).astype(int)
            assert s.image[r, c] >= 200  # bright markers
        lit = s.image.reshape(-1) > 0
        near = _dist_to_segments(grid[lit], a, b)
        near = np.minimum(near, np.linalg.norm(grid[lit][:, None] - s.markers[None], axis=2).min(1))
        assert near.max() < cfg.marker_radius + cfg.blur  # nothing drawn away from the geometry


def test_image_statistics_32() -> None:
    """Faint dashed curves (targets dimmer than distractors: the reference's quirk), about a third of
    pixels lit, bright markers."""
    samples = generate_samples(np.random.default_rng(5), pathfinder_config(32, 14), np.arange(24) % 2)
    lit = np.mean([(s.image > 0).mean() for s in samples])
    assert 0.25 < lit < 0.45

    def centre_values(s, snakes):  # noqa: ANN001, ANN202
        mid = np.rint(np.concatenate(snakes).mean(axis=1)).astype(int)
        return s.image[mid[:, 0], mid[:, 1]]

    targets = np.concatenate([centre_values(s, s.paddles[:2]) for s in samples])
    distractors = np.concatenate([centre_values(s, s.paddles[2:]) for s in samples if len(s.paddles) > 2])
    assert np.median(targets) < np.median(distractors) < 255
    assert all(s.image.max() >= 240 for s in samples)  # marker centres


# ---------------------------------------------------------------------------------------------------------
# reader


def _official_fixture(root: Path) -> dict[str, tuple[np.ndarray, int]]:
    """Four 32x32 PNGs with black pixels, one zero-byte PNG and one all-black PNG, release layout."""
    rng = np.random.default_rng(0)
    (root / "imgs" / "0").mkdir(parents=True)
    (root / "metadata").mkdir()
    expected, lines = {}, []
    for i, label in enumerate([1, 0, 0, 1, 1, 0]):
        path = root / "imgs" / "0" / f"sample_{i}.png"
        if i == 4:
            path.write_bytes(b"")  # the release's empty file
        else:
            image = rng.integers(0, 256, size=(32, 32), dtype=np.uint8) * (rng.random((32, 32)) < 0.6)
            if i == 5:
                image[:] = 0
            Image.fromarray(image.astype(np.uint8), mode="L").save(path)
            if i < 4:
                expected[f"sample_{i}.png"] = (np.asarray(Image.open(path)).reshape(-1), label)
        lines.append(f"imgs/0 sample_{i}.png {i} {label} 1.0 14 4 2 0.5 1 1")
    (root / "metadata" / "0.npy").write_text("\n".join(lines) + "\n")
    return expected


def test_reader_reproduces_pixels_and_labels(tmp_path: Path) -> None:
    root = tmp_path / "pathfinder32" / "curv_contour_length_14"
    expected = _official_fixture(root)
    with pytest.warns(UserWarning, match="skipped 2 empty image"):
        pixels, labels, skipped = pf.read_release(root, 32)
    assert [Path(s).name for s in skipped] == ["sample_4.png", "sample_5.png"]
    assert labels.tolist() == [v[1] for v in expected.values()]
    for row, (want, _) in zip(pixels, expected.values()):
        np.testing.assert_array_equal(row, want)
    assert (pixels == 0).any()  # black pixels kept as tokens
    # --source may name the resolution folder: the difficulty subfolder is found
    assert pf.resolve_source(tmp_path / "pathfinder32", 32, "curv_contour_length_14") == root


def test_reader_accepts_binary_npy_metadata(tmp_path: Path) -> None:
    """The reference generator's own ``np.save`` output (a string array) reads like the text files."""
    root = tmp_path / "curv_contour_length_14"
    expected = _official_fixture(root)
    rows = [
        ["imgs/0", name, str(i), str(label), "1.0"] for i, (name, (_, label)) in enumerate(expected.items())
    ]
    np.save(root / "metadata" / "0.npy", np.array(rows))
    pixels, labels, _ = pf.read_release(root, 32)
    assert labels.tolist() == [v[1] for v in expected.values()]
    np.testing.assert_array_equal(pixels, np.stack([v[0] for v in expected.values()]))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("imgs/0 sample_0.png 0", "expected at least 4"),
        ("imgs/0 sample_0.png 0 yes 1.0", "not an integer"),
        ("imgs/0 sample_0.png 0 2 1.0", "not 0 or 1"),
        ("imgs/0 missing.png 0 1 1.0", "does not exist"),
        ("imgs/0 broken.png 0 1 1.0", "does not decode"),
    ],
)
def test_reader_rejects_bad_input_with_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    root = tmp_path / "curv_contour_length_14"
    _official_fixture(root)
    (root / "imgs" / "0" / "broken.png").write_bytes(b"\x89PNG not really")
    (root / "metadata" / "1.npy").write_text("imgs/0 sample_0.png 0 1 1.0\n" + line + "\n")
    with pytest.raises(UserError, match=rf"1\.npy:2: .*{message}"):
        pf.read_metadata_file(root / "metadata" / "1.npy", root, 32)


def test_bad_source_leaves_no_cache(tmp_path: Path) -> None:
    from lra_cond.data import cache
    from lra_cond.data.tasks import TASKS

    root = tmp_path / "release" / "curv_contour_length_14"
    _official_fixture(root)
    (root / "metadata" / "0.npy").write_text("imgs/0 sample_0.png 0 x\n")
    with pytest.raises(UserError, match="0.npy:1"):
        TASKS.get("pathfinder").prepare(tmp_path / "data", "tiny", source=root.parent, workers=1)
    assert not cache.prepared_dir(tmp_path / "data", "pathfinder", "tiny").exists()
    with pytest.raises(UserError, match="lra_release"):
        TASKS.get("pathfinder").prepare(tmp_path / "data", "tiny", source=tmp_path / "nowhere", workers=1)


def test_split_is_seeded_80_10_10() -> None:
    pixels = np.arange(50, dtype=np.uint8)[:, None].repeat(4, 1)
    labels = np.arange(50) % 2
    s1, s2, s3 = pf.split(pixels, labels, 0), pf.split(pixels, labels, 0), pf.split(pixels, labels, 1)
    assert [len(s1[k]["label"]) for k in ("train", "val", "test")] == [40, 5, 5]
    firsts = {k: sorted(int(x[0]) for x in s1[k]["input_ids"]) for k in s1}
    assert sorted(sum(firsts.values(), [])) == list(range(50))  # a partition
    assert all(int(x[0]) % 2 == y for x, y in zip(s1["train"]["input_ids"], s1["train"]["label"]))
    assert [int(x[0]) for x in s1["val"]["input_ids"]] == [int(x[0]) for x in s2["val"]["input_ids"]]
    assert [int(x[0]) for x in s1["val"]["input_ids"]] != [int(x[0]) for x in s3["val"]["input_ids"]]


# ---------------------------------------------------------------------------------------------------------
# CLI


def test_cli_prepare_and_fit_tiny(tmp_path: Path) -> None:
    from lra_cond.data import cache
    from lra_cond.data.batches import PackedSplit
    from lra_cond.models.encoder import padding_mask

    bad = run_cli(
        ["prepare", "--task", "pathfinder", "--preset", "tiny", "--source", "nowhere"], cwd=tmp_path
    )
    assert_one_line_error(bad, "lra_release")  # says what to download, or to omit --source
    r = run_cli(["prepare", "--task", "pathfinder", "--preset", "tiny", "--workers", "2"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    prepared = cache.prepared_dir(tmp_path / "data", "pathfinder", "tiny")
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["sizes"] == {"train": 128, "val": 16, "test": 16} and manifest["positives"] == 80
    assert (
        tmp_path / "data/pathfinder/tiny/source/pathfinder32/curv_contour_length_14/samples.png"
    ).is_file()
    ds = cache.load_prepared(prepared, "").with_format("numpy")
    train = ds["train"]
    assert (np.asarray(train["length"]) == 1024).all()
    batch = PackedSplit(train).__getitems__(list(range(8)))
    assert (batch["input_ids"] == 0).any()  # black pixels are present ...
    assert not padding_mask(batch["length"], batch["input_ids"].shape[1]).any()  # ... and not masked

    fit = ["fit", "--task", "pathfinder", "--init", "conditioned", *TINY_FIT]
    fit += ["--data.batch_size", "16", "--trainer.max_steps", "4"]  # later flags win
    r = run_cli(fit, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (metrics_file,) = (tmp_path / "runs" / "pathfinder-tiny").rglob("metrics.json")
    metrics = json.loads(metrics_file.read_text())
    assert metrics["total_steps"] == 4
    assert 0.0 <= metrics["best_val_acc"] <= 1.0 and 0.0 <= metrics["test_acc"] <= 1.0
