"""Pathfinder ("snakes") image generator: growth of dashed curves, labels, markers.

Our own vectorised re-implementation of the task of Linsley et al. (2018) / Kim et al. (2020) as used by
LRA. A *snake* is a chain of short straight *paddles* separated by gaps: after a paddle ending at ``head``
the next one starts ``2 * margin`` further on (measured through a pivot ``margin`` past the head) along a
direction turned by an angle drawn with weight ``cos(min(|turn| * continuity, pi/2))**2``. Two *target*
snakes grow from seeds ``seed_distance`` apart near the centre; short *distractor* snakes fill the rest.
One marker sits on the tail of the first paddle of a target snake, the other on the head of the last
paddle of the same snake (label 1) or of the other target snake (label 0).

Collisions are geometric and exact: every snake is stored as its *undashed path* (paddles plus the gap
pieces joining them) and a new piece must keep ``clearance = 2 * margin + thickness`` from all pieces of
other snakes and from its own older pieces. That is the reference's rule (margin-dilated paddle masks
must not overlap) applied to the whole path, so a curve never slips through another curve's gap and two
different snakes never touch: connectivity of the union of paths equals the label.

Differences from the reference generator (on purpose, documented):
- turns are drawn from a fixed angle grid among the collision-free candidates (the reference draws from a
  ring of pixels and retries twice), with the same cos^2 weights;
- the two target snakes are grown for many attempts at once in lockstep (numpy), and every successful
  pair is used; the reference restarts one attempt at a time (same conditional distribution: a pair is
  kept iff both snakes reach full length);
- rendering is analytic (``pathfinder_render``); intensities are ``contrast x coverage`` stored as
  ``round(255 v)`` (the reference rescaled each image by its own maximum, which is ~1 here as well).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

import numpy as np

from lra_cond.data_prep.pathfinder_geom import BatchCanvas, point_segment_sq, segment_distance, unit
from lra_cond.data_prep.pathfinder_render import render

SEED_TRIES = 32  # random seed positions drawn per distractor attempt
SEED_EXACT = 4  # of which at most this many (passing a cheap point test) get the exact test
IMAGE_BATCH = 256  # images whose distractors are grown in lockstep
TARGET_ROUNDS = 100  # batches tried before giving up (never reached with the shipped settings)
DISTRACTOR_ATTEMPTS = 4  # as the reference's max_distractor_contour_retrial

DIFFICULTIES = {6: "curv_baseline", 9: "curv_contour_length_9", 14: "curv_contour_length_14"}


@dataclass(frozen=True)
class SnakeConfig:
    """Geometry and contrast of one Pathfinder resolution (defaults: LRA's 32 px settings)."""

    size: int = 32
    contour_length: int = 14  # paddles per target snake (difficulty: 6, 9 or 14)
    paddle_length: float = 2.0
    thickness: float = 0.5
    margins: tuple[int, ...] = (1,)  # one drawn per image, as the reference's paddle_margin_list
    padding: float = 1.0  # paddle endpoints stay this far inside the border
    continuity: float = 1.0
    seed_distance: float = 7.0
    marker_radius: float = 1.5
    distractor_budget: int = 20  # number of distractor snakes = budget // distractor length
    target_contrast: float = 1.5  # reference quirk: snake contrast 2.0 x paddle contrast 0.75
    distractor_contrast: float = 2.0
    marker_contrast: float = 1.0
    blur: float = 1.0  # half-width (px) of the tent anti-aliasing filter
    turn_step_deg: float = 10.0  # angle grid of candidate turns
    target_batch: int = 64  # target-pair attempts grown in lockstep (speed only; ~6% succeed at 32 px)

    @property
    def distractor_length(self) -> int:
        return max(1, self.contour_length // 3)

    @property
    def num_distractors(self) -> int:
        return self.distractor_budget // self.distractor_length

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "distractor_length": self.distractor_length,
            "num_distractors": self.num_distractors,
        }


def pathfinder_config(size: int = 32, contour_length: int = 14) -> SnakeConfig:
    """LRA settings for 32 px (Pathfinder) and 128 px (Path-X).

    32 px: LRA's documented settings (paddle length 2, thickness 0.5, margin 1, marker radius 1.5,
    continuity 1.0, seed distance 7, contour // 3 long distractors, 20 // that many of them, target
    contrast 1.5 vs distractors 2.0). 128 px: the settings LRA documents for ``pathfinder128`` (paddle
    length 5 — the generator's default —, thickness 1.5, margin 2 or 3, marker radius 3, seed distance
    20, continuity 1.8, snake contrast 0.9 for targets and distractors alike, 35 // (contour // 3)
    distractors), with a finer 5-degree turn grid because continuity 1.8 allows only +-50 degrees.
    """
    if contour_length not in DIFFICULTIES:
        raise ValueError(f"contour length must be one of {sorted(DIFFICULTIES)}, got {contour_length}")
    if size == 32:
        return SnakeConfig(size=32, contour_length=contour_length)
    if size == 128:
        return SnakeConfig(
            size=128,
            contour_length=contour_length,
            paddle_length=5.0,
            thickness=1.5,
            margins=(2, 3),
            continuity=1.8,
            seed_distance=20.0,
            marker_radius=3.0,
            distractor_budget=35,
            target_contrast=0.9,
            distractor_contrast=0.9,
            turn_step_deg=5.0,
            target_batch=512,  # under 1% of target pairs succeed at 128 px
        )
    raise ValueError(f"image size must be 32 or 128, got {size}")


@dataclass
class Sample:
    """One generated image with the geometry behind it (for tests and inspection)."""

    image: np.ndarray  # (size, size) uint8
    label: int
    paddles: list[np.ndarray]  # per snake (targets first), (n, 2, 2) paddle endpoints as (row, col)
    markers: np.ndarray  # (2, 2) marker centres (row, col)
    marker_snakes: tuple[int, int]  # index of the snake each marker sits on
    margin: int = 1
    stats: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=8)
def _turns(cfg: SnakeConfig) -> tuple[np.ndarray, np.ndarray]:
    """Candidate turn angles (radians) with non-zero weight, and their weights."""
    turns = np.deg2rad(np.arange(-90.0, 90.0 + 1e-9, cfg.turn_step_deg))
    weights = np.cos(np.minimum(np.abs(turns) * cfg.continuity, np.pi / 2)) ** 2
    keep = weights > 1e-9
    return turns[keep], weights[keep]


@functools.lru_cache(maxsize=8)
def _needs_crossing_test(cfg: SnakeConfig) -> bool:
    """Whether a piece could cross another while keeping all endpoints ``keep`` away.

    Pieces are at most max(paddle length, 2 margin) long; path pieces keep 2 margin + thickness and
    markers keep marker_radius + margin + thickness / 2. If every keep exceeds every length, the
    endpoint distances alone decide collisions exactly (see ``segment_distance_sq``).
    """
    for m in cfg.margins:
        longest = max(cfg.paddle_length, 2 * m)
        if min(2 * m + cfg.thickness, cfg.marker_radius + m + cfg.thickness / 2) <= longest:
            return True
    return False


def _in_bounds(points: np.ndarray, cfg: SnakeConfig) -> np.ndarray:
    lo, hi = cfg.padding, cfg.size - 1 - cfg.padding
    return ((points >= lo) & (points <= hi)).all(axis=-1)


# ---------------------------------------------------------------------------------------------------------
# Lockstep growth (one row of a BatchCanvas per image or per attempt)


def _extend(
    rng: np.random.Generator,
    cfg: SnakeConfig,
    canvas: BatchCanvas,
    rows: np.ndarray,
    theta: np.ndarray,
    pivot: np.ndarray,
    head: np.ndarray,
    margin: np.ndarray,
    ignore: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """Choose the next paddle of one snake per row among collision-free turns.

    Returns (ok, start, end, theta, pivot) per row; ``ok`` is False where no turn keeps clear. The
    candidate pieces are the gap (head -> start) and the paddle (start -> end); ``ignore`` holds the
    positions of the snake's own last paddle and the gap before it, which touch the candidates.
    """
    turns, weights = _turns(cfg)
    k = len(turns)
    th = theta[:, None] + turns  # (R, K)
    u = unit(th)
    starts = pivot[:, None] + margin[:, None, None] * u
    ends = starts + cfg.paddle_length * u
    q0 = np.concatenate([np.broadcast_to(head[:, None], starts.shape), starts], axis=1)
    q1 = np.concatenate([starts, ends], axis=1)
    near = (pivot, margin + cfg.paddle_length)  # every candidate point lies this close to the pivot
    clear = canvas.clear(rows, q0, q1, ignore=ignore, near=near)
    ok = _in_bounds(starts, cfg) & _in_bounds(ends, cfg) & clear[:, :k] & clear[:, k:]
    cum = np.cumsum(ok * weights, axis=1)
    total = cum[:, -1]
    j = (cum > (rng.uniform(size=len(rows)) * total)[:, None]).argmax(1)
    r = np.arange(len(rows))
    start, end = starts[r, j], ends[r, j]
    return total > 0, start, end, th[r, j], end + margin[:, None] * u[r, j]


@dataclass
class TargetPair:
    paddles: tuple[np.ndarray, np.ndarray]  # (contour_length, 2, 2) each
    pieces: tuple[np.ndarray, np.ndarray]  # path pieces p0 (n, 2), p1 (n, 2) of both snakes
    margin: int


def grow_target_pairs(rng: np.random.Generator, cfg: SnakeConfig, attempts: int) -> list[TargetPair]:
    """Grow ``attempts`` pairs of target snakes at once; return those where both reach full length.

    Seeds: the first tail uniform in the central square ``[2 sd, size - 2 sd]^2`` (as the reference,
    which masks ``2 * seed_distance`` from each border), the second ``seed_distance`` away in a random
    direction, both paddles in random directions. The snakes then grow alternately, as the reference.
    """
    length, steps = cfg.paddle_length, cfg.contour_length
    margin = np.asarray(cfg.margins, dtype=float)[rng.integers(len(cfg.margins), size=attempts)]
    clearance = 2 * margin + cfg.thickness
    lo, hi = 2 * cfg.seed_distance, cfg.size - 2 * cfg.seed_distance
    tail1 = rng.uniform(lo, hi, size=(attempts, 2)) if hi > lo else np.full((attempts, 2), (cfg.size - 1) / 2)
    tail2 = tail1 + cfg.seed_distance * unit(rng.uniform(-np.pi, np.pi, size=attempts))
    theta = rng.uniform(-np.pi, np.pi, size=(attempts, 2))
    tails = np.stack([tail1, tail2], axis=1)  # (A, snake, 2)
    heads = tails + length * unit(theta)
    alive = _in_bounds(tails, cfg).all(1) & _in_bounds(heads, cfg).all(1)
    alive &= segment_distance(tails[:, :1], heads[:, :1], tails[:, 1:], heads[:, 1:])[:, 0, 0] >= clearance

    canvas = BatchCanvas(attempts, 2 + 4 * (steps - 1), _needs_crossing_test(cfg))
    every = np.arange(attempts)
    last = np.full((attempts, 2, 2), -1)  # per snake: positions of its last gap and last paddle
    last[:, 0, 1] = canvas.add(every, tails[:, 0], heads[:, 0], clearance)
    last[:, 1, 1] = canvas.add(every, tails[:, 1], heads[:, 1], clearance)
    paddles = np.zeros((attempts, 2, steps, 2, 2))
    paddles[:, :, 0, 0], paddles[:, :, 0, 1] = tails, heads
    pivot = heads + margin[:, None, None] * unit(theta)
    rows = np.flatnonzero(alive)
    for step in range(1, steps):
        for s in (0, 1):
            if len(rows) == 0:
                return []
            head = paddles[rows, s, step - 1, 1]
            ok, start, end, th, piv = _extend(
                rng, cfg, canvas, rows, theta[rows, s], pivot[rows, s], head, margin[rows], last[rows, s]
            )
            rows, head, start, end = rows[ok], head[ok], start[ok], end[ok]
            last[rows, s, 0] = canvas.add(rows, head, start, clearance[rows])
            last[rows, s, 1] = canvas.add(rows, start, end, clearance[rows])
            paddles[rows, s, step, 0], paddles[rows, s, step, 1] = start, end
            theta[rows, s], pivot[rows, s] = th[ok], piv[ok]
    return [
        TargetPair(
            (paddles[i, 0], paddles[i, 1]),
            (canvas.p0[i, : canvas.n[i]].copy(), canvas.p1[i, : canvas.n[i]].copy()),
            int(margin[i]),
        )
        for i in rows
    ]


class TargetPool:
    """Successful target pairs, produced a batch at a time and handed out in order (deterministic)."""

    def __init__(self, rng: np.random.Generator, cfg: SnakeConfig) -> None:
        self.rng, self.cfg = rng, cfg
        self.queue: list[TargetPair] = []
        self.attempts = 0

    def pop(self) -> TargetPair:
        for _ in range(TARGET_ROUNDS):
            if self.queue:
                return self.queue.pop(0)
            self.queue = grow_target_pairs(self.rng, self.cfg, self.cfg.target_batch)
            self.attempts += self.cfg.target_batch
        raise RuntimeError(
            f"could not place two target snakes in {TARGET_ROUNDS * self.cfg.target_batch} attempts"
        )


def _seed(
    rng: np.random.Generator, cfg: SnakeConfig, canvas: BatchCanvas, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A first paddle per row at a random free place: (ok, tail, head, theta).

    ``SEED_TRIES`` random tails are screened with a point test (tail clear of every piece), then the
    first ``SEED_EXACT`` survivors get the exact segment test; the first that passes is used.
    """
    lo, hi = cfg.padding, cfg.size - 1 - cfg.padding
    n = len(rows)
    tails = rng.uniform(lo, hi, size=(n, SEED_TRIES, 2))
    thetas = rng.uniform(-np.pi, np.pi, size=(n, SEED_TRIES))
    heads = tails + cfg.paddle_length * unit(thetas)
    p0, p1, keep = canvas.p0[rows], canvas.p1[rows], canvas.keep[rows]
    dx, dy = (p1[..., 0] - p0[..., 0])[:, None], (p1[..., 1] - p0[..., 1])[:, None]
    d2 = point_segment_sq(
        tails[..., 0, None],
        tails[..., 1, None],
        p0[:, None, :, 0],
        p0[:, None, :, 1],
        dx,
        dy,
        np.maximum(dx * dx + dy * dy, 1e-12),
    )  # (R, S, P); unused slots are far away
    screened = (d2 >= keep[:, None, :] ** 2).all(-1) & _in_bounds(heads, cfg)
    pick = np.argsort(~screened, axis=1, kind="stable")[:, :SEED_EXACT]
    t, h = np.take_along_axis(tails, pick[..., None], 1), np.take_along_axis(heads, pick[..., None], 1)
    ok = np.take_along_axis(screened, pick, 1) & canvas.clear(rows, t, h)
    first = ok.argmax(1)
    r = np.arange(n)
    return ok.any(1), t[r, first], h[r, first], np.take_along_axis(thetas, pick, 1)[r, first]


def add_distractors(
    rng: np.random.Generator, cfg: SnakeConfig, canvas: BatchCanvas, margin: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Grow distractor snake k on every row at once, k = 0..num_distractors-1.

    A snake that does not fit in ``DISTRACTOR_ATTEMPTS`` tries is left out, as in the reference.
    Returns paddles (B, num, length, 2, 2) and placed (B, num).
    """
    b, num, dl = len(margin), cfg.num_distractors, cfg.distractor_length
    clearance = 2 * margin + cfg.thickness
    paddles = np.zeros((b, num, dl, 2, 2))
    placed = np.zeros((b, num), dtype=bool)
    for k in range(num):
        pending = np.arange(b)
        for _ in range(DISTRACTOR_ATTEMPTS):
            if len(pending) == 0:
                break
            mark = canvas.n[pending].copy()
            ok, tail, head, th = _seed(rng, cfg, canvas, pending)
            rows, tail, head, th = pending[ok], tail[ok], head[ok], th[ok]
            last = np.full((len(rows), 2), -1)
            last[:, 1] = canvas.add(rows, tail, head, clearance[rows])
            paddles[rows, k, 0, 0], paddles[rows, k, 0, 1] = tail, head
            piv = head + margin[rows, None] * unit(th)
            for step in range(1, dl):
                ok, start, end, th, piv = _extend(rng, cfg, canvas, rows, th, piv, head, margin[rows], last)
                rows, head, start, end, th, piv, last = (
                    a[ok] for a in (rows, head, start, end, th, piv, last)
                )
                last[:, 0] = canvas.add(rows, head, start, clearance[rows])
                last[:, 1] = canvas.add(rows, start, end, clearance[rows])
                paddles[rows, k, step, 0], paddles[rows, k, step, 1] = start, end
                head = end
            placed[rows, k] = True
            failed = ~np.isin(pending, rows)
            canvas.truncate(pending[failed], mark[failed])  # roll back partial snakes
            pending = pending[failed]
    return paddles, placed


# ---------------------------------------------------------------------------------------------------------
# Samples


def balanced_labels(rng: np.random.Generator, n: int, offset: int = 0) -> np.ndarray:
    """Labels of images ``offset .. offset + n - 1`` of a release, in random order within the range.

    Image j of the release gets label ``j % 2`` before shuffling, so any split of a release into
    ranges (chunks) is balanced overall to within one image.
    """
    return rng.permutation((offset + np.arange(n)) % 2)


def _batch(rng: np.random.Generator, cfg: SnakeConfig, pool: TargetPool, labels: np.ndarray) -> list[Sample]:
    pairs = [pool.pop() for _ in labels]
    b = len(labels)
    a = rng.integers(2, size=b)
    other = np.where(labels == 1, a, 1 - a)
    markers = np.stack(
        [np.stack([p.paddles[i][0, 0], p.paddles[j][-1, 1]]) for p, i, j in zip(pairs, a, other)]
    )  # (B, 2, 2)
    margin = np.array([p.margin for p in pairs], dtype=float)
    n_target = max(len(p.pieces[0]) for p in pairs)
    capacity = n_target + 2 + cfg.num_distractors * (2 * cfg.distractor_length - 1)
    canvas = BatchCanvas(b, capacity, _needs_crossing_test(cfg))
    every = np.arange(b)
    for i, p in enumerate(pairs):
        n = len(p.pieces[0])
        canvas.p0[i, :n], canvas.p1[i, :n], canvas.keep[i, :n] = (
            p.pieces[0],
            p.pieces[1],
            2 * p.margin + cfg.thickness,
        )
        canvas.n[i] = n
    # distractors keep off the markers too, so each marker visibly sits on one curve only
    marker_keep = cfg.marker_radius + margin + cfg.thickness / 2
    for m in range(2):
        canvas.add(every, markers[:, m], markers[:, m], marker_keep)
    distractors, placed = add_distractors(rng, cfg, canvas, margin)
    samples = []
    for i, p in enumerate(pairs):
        snakes = [*p.paddles, *distractors[i][placed[i]]]
        contrasts = np.repeat(
            [cfg.target_contrast] * 2 + [cfg.distractor_contrast] * (len(snakes) - 2),
            [len(s) for s in snakes],
        )
        image = render(
            cfg.size,
            np.concatenate(snakes),
            contrasts,
            cfg.thickness,
            markers[i],
            cfg.marker_radius,
            cfg.marker_contrast,
            cfg.blur,
        )
        stats = {"distractors": int(placed[i].sum())}
        samples.append(
            Sample(image, int(labels[i]), snakes, markers[i], (int(a[i]), int(other[i])), p.margin, stats)
        )
    return samples


def generate_samples(rng: np.random.Generator, cfg: SnakeConfig, labels: np.ndarray) -> list[Sample]:
    """One sample per label, drawing everything from ``rng`` in a fixed order (deterministic)."""
    labels = np.asarray(labels, dtype=np.int64)
    pool = TargetPool(rng, cfg)
    samples = []
    for start in range(0, len(labels), IMAGE_BATCH):
        samples += _batch(rng, cfg, pool, labels[start : start + IMAGE_BATCH])
    for s in samples:
        s.stats["target_attempts_per_image"] = pool.attempts / max(1, len(samples))
    return samples
