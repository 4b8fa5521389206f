"""ListOps: seeded generator (reference algorithm) and reader of the official TSV format.

Official release layout: ``listops-1000/basic_{train,val,test}.tsv``, header ``Source\\tTarget``.
A tree is serialized with the reference's nested-pair parentheses, e.g. ``[MAX 2 9 ]`` is written
``( ( ( [MAX 2 ) 9 ) ] )``; the tokenizer drops the parentheses.
"""

from __future__ import annotations

import csv
import random
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lra_cond.data_prep.progress import progress_bar
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
PARTIAL = "listops-trees.partial"  # the trees of an interrupted generation, next to the release

# Probability that a node above max depth is an operator (reference VALUE_P).
OPERATOR_P = 0.25


@dataclass(frozen=True)
class ListOpsConfig:
    sizes: tuple[int, int, int]
    min_len: int  # exclusive
    max_len: int  # exclusive
    max_depth: int = 10
    max_args: int = 10


# The longest input a reader accepts: the task's maximum length (``TASKS.get("listops").max_len``, the
# model's position table; tests check they agree).
MAX_LEN = 2000

PRESETS = {
    "full": ListOpsConfig(sizes=(96000, 2000, 2000), min_len=500, max_len=2000),
    "tiny": ListOpsConfig(sizes=(512, 128, 128), min_len=20, max_len=200),
}

# Accepted trees per work unit. Fixed (independent of the worker count) so output is a function
# of the seed alone.
CHUNK = 500


# Serialization: n+1 "(" before an operator with n arguments, ")" after each argument.
_ARGS = tuple(f"{d} )" for d in DIGITS)
_CLOSE_INNER = END + " ) )"  # "]", the operator's own pair, and the argument pair of its parent
_CLOSE_ROOT = END + " )"


def _shape(rnd: Callable[[], float], cfg: ListOpsConfig) -> list[int] | None:
    """Arities of one tree's nodes in preorder (0 = leaf), or None once it cannot be short enough.

    Only the structure is drawn here: a node above ``max_depth`` is an operator with probability
    ``OPERATOR_P`` and then has randint(2, max_args) children. Digits and operator names do not affect
    the length, so they are drawn later and only for accepted trees (``_label``); the accepted trees
    have the reference distribution. A tree is abandoned as soon as its tokens so far plus one per
    child not yet started reach ``max_len``: the length filter would reject it anyway.
    """
    p, max_depth, max_len, span = OPERATOR_P, cfg.max_depth, cfg.max_len, cfg.max_args - 1
    scale = span / p
    arities: list[int] = []
    append = arities.append
    remaining: list[int] = []  # children still to start, per open operator
    length = pending = 0
    depth = 1
    while True:
        u = rnd() if depth < max_depth else 1.0
        if u <= p:
            # randint(2, max_args) from the same draw: u / p is uniform on [0, 1] given u <= p.
            n = 2 + min(span - 1, int(u * scale))
            append(n)
            length += 2
            pending += n
            if length + pending >= max_len:
                return None
            remaining.append(n)
            depth += 1
        else:
            append(0)
            length += 1
            if length + pending >= max_len:
                return None
            while remaining:  # close every operator whose last child just ended
                remaining[-1] -= 1
                if remaining[-1]:
                    break
                remaining.pop()
                depth -= 1
            if not remaining:
                return arities
        if remaining:
            pending -= 1  # the next node starts one of the pending children


def _label(rnd: Callable[[], float], arities: list[int]) -> tuple[str, int]:
    """Draw digits and operators for a tree shape; return its serialization and value."""
    parts: list[str] = []
    emit = parts.append
    stack: list[tuple[str, list[int], int]] = []  # (operator, argument values, arity)
    value = 0
    for n in arities:
        if n:
            op = OPERATORS[int(rnd() * 4)]
            emit("( " * (n + 1) + op)
            stack.append((op, [], n))
            continue
        value = int(rnd() * 10)
        if not stack:
            return DIGITS[value], value
        emit(_ARGS[value])  # "d )": a digit closing its argument pair
        while stack:  # the finished subtree is an argument of the innermost open operator
            op, args, n_args = stack[-1]
            args.append(value)
            if len(args) < n_args:
                break
            stack.pop()
            value = _apply(op, args)
            emit(_CLOSE_INNER if stack else _CLOSE_ROOT)
    return " ".join(parts), value


def _apply(op: str, values: list[int]) -> int:
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":  # floor of numpy's median (mean of the two middle values when even)
        s = sorted(values)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2
    return sum(values) % 10


def _chunk(args: tuple[int, int, ListOpsConfig]) -> list[tuple[str, int]]:
    seed, index, cfg = args
    rnd = random.Random(f"listops-{seed}-{index}").random
    out: list[tuple[str, int]] = []
    while len(out) < CHUNK:
        arities = _shape(rnd, cfg)
        if arities is None:
            continue
        length = len(arities) + sum(1 for n in arities if n)  # digits + opener and "]" per operator
        if length > cfg.min_len:
            out.append(_label(rnd, arities))
    return out


def generate_trees(
    cfg: ListOpsConfig, seed: int, workers: int = 1, partial: Path | None = None
) -> list[tuple[str, int]]:
    """Distinct (source, label) pairs, deterministic in ``seed`` whatever ``workers`` is.

    With ``partial``, the trees are also appended to that file chunk by chunk as they are made, so an
    interrupted generation (Ctrl-C, a kill) continues where it stopped: the chunks are seeded by
    their index, so the result is the same as one uninterrupted generation. The file is removed when
    the generation is complete.
    """
    total = sum(cfg.sizes)
    seen, index = _read_partial(partial, cfg, seed) if partial else ({}, 0)
    out = _open_partial(partial, cfg, seed, resumed=bool(index)) if partial else None
    # Workers ignore Ctrl-C: the main process stops them (running chunks finish, queued ones are dropped).
    pool = ProcessPoolExecutor(workers, initializer=_ignore_sigint) if workers > 1 else _Serial()
    try:
        with progress_bar() as bar:
            what = "generating ListOps trees" + (f" (continuing from {len(seen)})" if seen else "")
            task = bar.add_task(what, total=total, completed=min(len(seen), total))
            while len(seen) < total:
                need = -(-(total - len(seen)) // CHUNK)
                jobs = [(seed, index + i, cfg) for i in range(need)]
                for chunk_index, chunk in zip(range(index, index + need), pool.map(_chunk, jobs)):
                    new = []
                    for source, value in chunk:
                        if len(seen) < total and source not in seen:
                            seen[source] = value
                            new.append((source, value))
                    if out is not None:
                        out.writelines(f"{source}\t{value}\n" for source, value in new)
                        out.write(f"{_MARK}{chunk_index}\n")
                        out.flush()
                    bar.update(task, completed=len(seen))
                index += need
    except KeyboardInterrupt:
        pool.shutdown(wait=True, cancel_futures=True)
        if out is not None:
            out.close()
            raise UserInterrupt(
                f"while generating ListOps: {len(seen)} of {total} trees are kept in {partial}; the same "
                "command continues from there"
            ) from None
        raise
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        if out is not None:
            out.close()  # the complete chunks stay usable
        raise
    pool.shutdown()
    if out is not None:
        out.close()
        partial.unlink(missing_ok=True)
    return list(seen.items())


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class UserInterrupt(KeyboardInterrupt):
    """Ctrl-C during a resumable generation: the message says what was kept."""


_MARK = "#chunk "  # a line that ends one chunk's trees in the partial file


def _partial_header(cfg: ListOpsConfig, seed: int) -> str:
    return f"#listops trees seed={seed} config={cfg!r}\n"


def _read_partial(path: Path, cfg: ListOpsConfig, seed: int) -> tuple[dict[str, int], int]:
    """The trees of the complete chunks of an interrupted generation with the same seed and config,
    and the next chunk index (an empty start for another generator's file, or none)."""
    if not path.is_file():
        return {}, 0
    seen: dict[str, int] = {}
    pending: list[tuple[str, int]] = []
    index, keep = 0, 0
    with open(path) as f:
        if f.readline() != _partial_header(cfg, seed):
            return {}, 0
        keep = f.tell()
        for line in iter(f.readline, ""):
            if not line.endswith("\n"):
                break  # torn by a kill mid-write
            if line.startswith(_MARK):
                seen.update(pending)
                pending, index, keep = [], int(line[len(_MARK) :]) + 1, f.tell()
            else:
                source, value = line.rstrip("\n").split("\t")
                pending.append((source, int(value)))
    with open(path, "r+") as f:
        f.truncate(keep)  # drop a chunk that was not complete
    return seen, index


def _open_partial(path: Path, cfg: ListOpsConfig, seed: int, resumed: bool):  # noqa: ANN202
    path.parent.mkdir(parents=True, exist_ok=True)
    if resumed:
        return open(path, "a")
    f = open(path, "w")
    f.write(_partial_header(cfg, seed))
    return f


class _Serial:
    """Stand-in for a process pool when generating in-process."""

    def __enter__(self) -> _Serial:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn, jobs):  # noqa: ANN001, ANN201
        return map(fn, jobs)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        return None


def write_release(out_dir: Path, preset: str = "full", seed: int = 0, workers: int = 1) -> Path:
    """Generate ListOps and write it in the official release layout; returns the release dir."""
    cfg = PRESETS[preset]
    trees = generate_trees(cfg, seed, workers, partial=Path(out_dir) / PARTIAL)
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


def read_tsv(path: Path, max_len: int | None = None) -> Iterator[tuple[np.ndarray, int]]:
    """Yield (token ids, label) from one official-format TSV, with file:line on malformed rows.

    A row longer than ``max_len`` tokens (default: the task's maximum, the model's position table)
    is refused, as is a row with no tokens.
    """
    max_len = MAX_LEN if max_len is None else max_len
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
            if not len(ids):
                raise UserError(f"{path}:{lineno}: the expression has no tokens")
            if len(ids) > max_len:
                raise UserError(
                    f"{path}:{lineno}: {len(ids)} tokens, more than ListOps' maximum length {max_len} "
                    "(the model's position table); shorten or drop the row"
                )
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
