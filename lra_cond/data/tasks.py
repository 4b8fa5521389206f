"""Task registry: what each LRA task is (classes, vocabulary, length) and how to prepare it."""

from __future__ import annotations

import os
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
    vocab_size: int  # including the pad id 0
    max_len: int
    presets: tuple[str, ...]
    prepare_fn: Callable[[], PrepareFn]  # lazy import of the data_prep module
    generated: bool = False  # the source can be generated locally (no download needed)
    pair: bool = False  # two sequences per example (retrieval)

    def prepare_command(self, data_dir: str | Path, preset: str) -> str:
        return f"python -m lra_cond prepare --task {self.name} --preset {preset} --data-dir {data_dir}"

    def prepare(
        self,
        data_dir: str | Path,
        preset: str,
        source: str | Path | None = None,
        seed: int = 0,
        workers: int | None = None,
    ) -> Path:
        from lra_cond.errors import UserError

        if preset not in self.presets:
            raise UserError(
                f"unknown preset '{preset}' for task {self.name}; valid presets: {', '.join(self.presets)}"
            )
        out = cache.task_dir(data_dir, self.name, preset)
        workers = workers or min(os.cpu_count() or 1, 8)
        splits, manifest = self.prepare_fn()(out, preset, Path(source) if source else None, seed, workers)
        manifest = {"task": self.name, "preset": preset, **manifest}
        return cache.save_prepared(cache.prepared_dir(data_dir, self.name, preset), splits, manifest)


TASKS: Registry[TaskSpec] = Registry("task")


def _listops() -> PrepareFn:
    from data_prep import listops

    return listops.prepare


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
    ),
)


def _pathfinder() -> PrepareFn:
    from data_prep import pathfinder

    return pathfinder.prepare


def _pathx() -> PrepareFn:
    from data_prep import pathfinder

    return pathfinder.prepare_pathx


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
    ),
)
