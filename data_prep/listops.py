"""ListOps: seeded generator (reference algorithm) and reader of the official TSV format.

Official release layout: ``listops-1000/basic_{train,val,test}.tsv``, header ``Source\\tTarget``.
A tree is serialized with the reference's nested-pair parentheses, e.g. ``[MAX 2 9 ]`` is written
``( ( ( [MAX 2 ) 9 ) ] )``; the tokenizer drops the parentheses.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.progress import progress_bar
from lra_cond.errors import UserError

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
DIGITS = tuple(str(d) for d in range(10))
# ids 1..15; 0 is padding.
SYMBOLS = OPERATORS + (END,) + DIGITS
VOCAB = {s: i + 1 for i, s in enumerate(SYMBOLS)}
PAREN = {"(", ")"}
SPLITS = ("train", "val", "test")
RELEASE_DIR = "listops-1000"

# Probability that a node above max depth is an operator (reference VALUE_P).
OPERATOR_P = 0.25


@dataclass(frozen=True)
class ListOpsConfig:
    sizes: tuple[int, int, int]
    min_len: int  # exclusive
    max_len: int  # exclusive
    max_depth: int = 10
    max_args: int = 10


PRESETS = {
    "full": ListOpsConfig(sizes=(96000, 2000, 2000), min_len=500, max_len=2000),
    "tiny": ListOpsConfig(sizes=(512, 128, 128), min_len=20, max_len=200),
}

# Accepted trees per work unit. Fixed (independent of the worker count) so output is a function
# of the seed alone.
CHUNK = 500


class _TooLong(Exception):
    pass


def _node(rng: random.Random, depth: int, cfg: ListOpsConfig, budget: list[int]) -> tuple[str, int]:
    """Generate one subtree; returns (serialized string, value). Aborts once too long.

    Aborting early only discards trees that the length filter would reject anyway, so the
    distribution of accepted trees equals the reference's.
    """
    if depth < cfg.max_depth and rng.random() <= OPERATOR_P:
        budget[0] += 2
        if budget[0] >= cfg.max_len:
            raise _TooLong
        n = rng.randint(2, cfg.max_args)
        children = [_node(rng, depth + 1, cfg, budget) for _ in range(n)]
        op = OPERATORS[rng.randrange(4)]
        values = [v for _, v in children]
        parts = ["( " * (n + 1) + op]
        parts.extend(s + " )" for s, _ in children)
        parts.append(END + " )")
        return " ".join(parts), _apply(op, values)
    budget[0] += 1
    if budget[0] >= cfg.max_len:
        raise _TooLong
    d = rng.randrange(10)
    return DIGITS[d], d


def _apply(op: str, values: list[int]) -> int:
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":
        return int(np.median(values))
    return sum(values) % 10


def _chunk(args: tuple[int, int, ListOpsConfig]) -> list[tuple[str, int]]:
    seed, index, cfg = args
    rng = random.Random(f"listops-{seed}-{index}")
    out: list[tuple[str, int]] = []
    while len(out) < CHUNK:
        budget = [0]
        try:
            source, value = _node(rng, 1, cfg, budget)
        except _TooLong:
            continue
        if budget[0] > cfg.min_len:
            out.append((source, value))
    return out


def generate_trees(cfg: ListOpsConfig, seed: int, workers: int = 1) -> list[tuple[str, int]]:
    """Distinct (source, label) pairs, deterministic in ``seed`` whatever ``workers`` is."""
    total = sum(cfg.sizes)
    seen: dict[str, int] = {}
    index = 0
    with progress_bar() as bar, ProcessPoolExecutor(max(1, workers)) if workers > 1 else _Serial() as pool:
        task = bar.add_task("generating ListOps trees", total=total)
        while len(seen) < total:
            need = -(-(total - len(seen)) // CHUNK)
            jobs = [(seed, index + i, cfg) for i in range(need)]
            index += need
            for chunk in pool.map(_chunk, jobs):
                for source, value in chunk:
                    if len(seen) < total and source not in seen:
                        seen[source] = value
                bar.update(task, completed=len(seen))
    return list(seen.items())


class _Serial:
    """Stand-in for a process pool when generating in-process."""

    def __enter__(self) -> _Serial:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn, jobs):  # noqa: ANN001, ANN201
        return map(fn, jobs)


def write_release(out_dir: Path, preset: str = "full", seed: int = 0, workers: int = 1) -> Path:
    """Generate ListOps and write it in the official release layout; returns the release dir."""
    cfg = PRESETS[preset]
    trees = generate_trees(cfg, seed, workers)
    release = Path(out_dir) / RELEASE_DIR
    release.mkdir(parents=True, exist_ok=True)
    start = 0
    for split, size in zip(SPLITS, cfg.sizes):
        path = release / f"basic_{split}.tsv"
        tmp = path.with_suffix(".tsv.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f, delimiter="\t")
            writer.writerow(["Source", "Target"])
            writer.writerows(trees[start : start + size])
        tmp.replace(path)
        start += size
    return release


def tokenize(source: str) -> np.ndarray:
    """Token ids of a serialized tree; parentheses are dropped. Raises KeyError on unknown tokens."""
    return np.array([VOCAB[t] for t in source.split() if t not in PAREN], dtype=np.int16)


def read_tsv(path: Path) -> Iterator[tuple[np.ndarray, int]]:
    """Yield (token ids, label) from one official-format TSV, with file:line on malformed rows."""
    path = Path(path)
    with open(path, newline="") as f:
        for lineno, row in enumerate(csv.reader(f, delimiter="\t"), start=1):
            if lineno == 1:
                if row != ["Source", "Target"]:
                    raise UserError(f"{path}:1: expected header 'Source<TAB>Target', got {row!r}")
                continue
            if not row:
                continue
            if len(row) != 2:
                raise UserError(f"{path}:{lineno}: expected 2 tab-separated columns, got {len(row)}")
            source, target = row
            try:
                label = int(target)
            except ValueError:
                raise UserError(f"{path}:{lineno}: label {target!r} is not an integer") from None
            if not 0 <= label <= 9:
                raise UserError(f"{path}:{lineno}: label {label} is outside 0..9")
            try:
                ids = tokenize(source)
            except KeyError as e:
                raise UserError(f"{path}:{lineno}: unknown ListOps token {e.args[0]!r}") from None
            yield ids, label


def read_release(release_dir: Path) -> dict[str, dict[str, list]]:
    """Read ``basic_{train,val,test}.tsv`` into columns for the prepared cache."""
    release_dir = Path(release_dir)
    splits = {}
    for split in SPLITS:
        path = release_dir / f"basic_{split}.tsv"
        if not path.is_file():
            raise UserError(
                f"missing {path}; point --source at the release's listops-1000 directory, "
                "or omit --source to generate ListOps locally"
            )
        ids, labels = [], []
        for tokens, label in read_tsv(path):
            ids.append(tokens)
            labels.append(label)
        splits[split] = {"input_ids": ids, "label": labels}
    return splits


def prepare(out_dir: Path, preset: str, source: Path | None, seed: int, workers: int) -> tuple[dict, dict]:
    """Splits and manifest for the prepared cache; generates the release first if no source."""
    if source is None:
        release = write_release(Path(out_dir) / "source", preset, seed, workers)
        manifest = {"source": "generated", "seed": seed, "generator": PRESETS[preset].__dict__}
    else:
        release = Path(source)
        manifest = {"source": str(release.resolve())}
    return read_release(release), manifest
