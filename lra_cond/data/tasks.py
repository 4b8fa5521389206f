"""Task registry: what each LRA task is (classes, vocabulary, length) and how to prepare it."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lra_cond.data import cache
from lra_cond.registry import Registry

# (out_dir, preset, source, seed, workers) -> (splits, manifest)
PrepareFn = Callable[[Path, str, "Path | None", int, int], tuple[dict, dict]]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    num_classes: int
    vocab_size: int  # ids 0..vocab_size-1; 0 is the pad id of token tasks, black for pixel tasks
    max_len: int
    presets: tuple[str, ...]
    prepare_fn: Callable[[], PrepareFn]  # imports its data_prep module when called
    generated: bool = False  # the source can be generated locally (no download needed)
    pair: bool = False  # two sequences per example (retrieval)
    fixture_presets: tuple[str, ...] = ()  # presets built from a data_prep fixture (no download)
    # The task's token symbols and ids, where it has a symbol vocabulary (ListOps): what
    # ``--data.drop_tokens`` names.
    vocabulary: Callable[[], dict[str, int]] | None = None
    # The tiny preset's batch, where the task's reference batch is larger than its tiny training split
    # (``fit --task T --data.preset tiny`` then runs as written).
    tiny_batch_size: int | None = None

    def local(self, preset: str) -> bool:
        """Whether ``preset`` can be built here without a downloaded source."""
        return self.generated or preset in self.fixture_presets

    @property
    def limits(self) -> cache.Limits:
        return cache.Limits(max_len=self.max_len, vocab_size=self.vocab_size, num_classes=self.num_classes)

    def prepare_command(self, data_dir: str | Path, preset: str) -> str:
        """The shell command (quoted) that builds this task's cache for ``preset`` in ``data_dir``."""
        words = ["python", "-m", "lra_cond", "prepare", "--task", self.name, "--preset", preset]
        return shlex.join([*words, "--data-dir", str(data_dir)])

    def prepare(
        self,
        data_dir: str | Path,
        preset: str,
        source: str | Path | None = None,
        seed: int = 0,
        workers: int | None = None,
        if_missing: bool = False,
    ) -> Path:
        """Build the cache (under the cache lock: concurrent prepares of one cache take turns).

        ``if_missing``: a cache another process finished while this one waited is kept as it is
        (``fit`` generating missing data); otherwise the cache is rebuilt.
        """
        from rich.console import Console

        from lra_cond.errors import UserError

        if preset not in self.presets:
            raise UserError(
                f"unknown preset '{preset}' for task {self.name}; valid presets: {', '.join(self.presets)}"
            )
        cores = os.cpu_count() or 1
        if workers is not None and not 1 <= workers <= cores:
            raise UserError(
                f"--workers must be in 1..{cores} (generator processes, at most this machine's cores), "
                f"got {workers}"
            )
        cache.check_data_root(data_dir, "--data-dir")
        out = cache.task_dir(data_dir, self.name, preset)
        prepared = cache.prepared_dir(data_dir, self.name, preset)

        def waiting(pid: int | None) -> None:
            who = f" (pid {pid})" if pid else ""
            Console(stderr=True).print(f"waiting for another prepare of {out}{who} to finish")

        with cache.locked(data_dir, self.name, preset, on_wait=waiting):
            cache.recover(prepared)
            if if_missing and cache.is_prepared(prepared):
                return prepared
            workers = workers or min(os.cpu_count() or 1, 8)
            splits, manifest = self.prepare_fn()(out, preset, Path(source) if source else None, seed, workers)
            manifest = {"task": self.name, "preset": preset, **manifest}
            return cache.save_prepared(prepared, splits, manifest, limits=self.limits)


TASKS: Registry[TaskSpec] = Registry("task")


# The prepare functions, imported when a task is prepared (data_prep stays out of model-only code paths).
def _listops_vocabulary() -> dict[str, int]:
    from lra_cond.data_prep import listops

    return dict(listops.VOCAB)


def _listops() -> PrepareFn:
    from lra_cond.data_prep import listops

    return listops.prepare


def _text() -> PrepareFn:
    from lra_cond.data_prep import text

    return text.prepare


def _retrieval() -> PrepareFn:
    from lra_cond.data_prep import retrieval

    return retrieval.prepare


def _image() -> PrepareFn:
    from lra_cond.data_prep import image

    return image.prepare


def _pathfinder() -> PrepareFn:
    from lra_cond.data_prep import pathfinder

    return pathfinder.prepare


def _pathx() -> PrepareFn:
    from lra_cond.data_prep import pathfinder

    return pathfinder.prepare_pathx


TASKS.add(
    "listops",
    TaskSpec(
        name="listops",
        num_classes=10,
        vocab_size=16,
        max_len=2000,
        presets=("full", "tiny"),
        prepare_fn=_listops,
        generated=True,
        vocabulary=lambda: _listops_vocabulary(),
    ),
)


# Byte-level IMDB: ids byte + 1, 0 = pad. max_len is the cache's truncation; --data.max_len shortens.
TASKS.add(
    "text",
    TaskSpec(
        name="text",
        num_classes=2,
        vocab_size=257,
        max_len=4000,
        presets=("full", "tiny"),
        prepare_fn=_text,
        fixture_presets=("tiny",),
    ),
)
# AAN document pairs, each document byte-level and truncated to 4000.
TASKS.add(
    "retrieval",
    TaskSpec(
        name="retrieval",
        num_classes=2,
        vocab_size=257,
        max_len=4000,
        presets=("full", "tiny"),
        prepare_fn=_retrieval,
        pair=True,
        fixture_presets=("tiny",),
    ),
)
# Grayscale CIFAR-10: ids are pixel values 0..255 (0 is black, a real token; masks use lengths).
TASKS.add(
    "image",
    TaskSpec(
        name="image",
        num_classes=10,
        vocab_size=256,
        max_len=1024,
        presets=("full", "tiny"),
        prepare_fn=_image,
        fixture_presets=("tiny",),
        tiny_batch_size=16,  # 36 tiny training images against the reference's 256
    ),
)
# Pixel tasks: tokens are the pixel values 0..255 (0 is black, a real token; lengths are always full).
# Presets: full = LRA (contour length 14), intermediate (9), easy (6, curv_baseline), tiny (smoke tests).
TASKS.add(
    "pathfinder",
    TaskSpec(
        name="pathfinder",
        num_classes=2,
        vocab_size=256,
        max_len=1024,
        presets=("full", "intermediate", "easy", "tiny"),
        prepare_fn=_pathfinder,
        generated=True,
        tiny_batch_size=32,  # 128 tiny training images against the reference's 256
    ),
)
TASKS.add(
    "pathx",
    TaskSpec(
        name="pathx",
        num_classes=2,
        vocab_size=256,
        max_len=16384,
        presets=("full", "intermediate", "easy", "tiny"),
        prepare_fn=_pathx,
        generated=True,
        tiny_batch_size=1,  # 25 tiny training images of 16384 tokens: a smoke test, not a study
    ),
)
