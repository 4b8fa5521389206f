"""LightningDataModule over the prepared cache of any registered task."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from rich.console import Console
from torch.utils.data import DataLoader

from lra_cond.data import cache
from lra_cond.data.batches import PackedSplit, batch_identity
from lra_cond.data.tasks import TASKS, TaskSpec
from lra_cond.errors import UserError


def default_workers() -> int:
    return min(2, max(0, (os.cpu_count() or 1) - 1)) if torch.cuda.is_available() else 0


class LraDataModule(pl.LightningDataModule):
    """Loads ``<data_dir>/<task>/<preset>/prepared``; generates it first for synthetic tasks.

    Args:
        task: LRA task name.
        data_dir: data root; defaults to ``$LRA_DATA`` or ``./data``.
        preset: ``full`` (the LRA splits) or ``tiny`` (a few hundred examples, for smoke tests).
        batch_size: examples per batch.
        num_workers: DataLoader worker processes; default 0 on CPU-only machines (batches are cheap
            to assemble, see ``batches.py``, and workers would take cores from training), 2 when
            CUDA is available (assembly overlaps the GPU step).
        seed: generator seed used when the data must be generated on the fly.
        max_len: keep only the first ``max_len`` tokens of every sequence (default: the task's
            maximum, all that the cache holds). E.g. 1000 for the shorter text setup; the CLI links
            it to ``model.max_len`` so the position table matches.
    """

    def __init__(
        self,
        task: str = "listops",
        data_dir: str | None = None,
        preset: str = "full",
        batch_size: int = 32,
        num_workers: int | None = None,
        seed: int = 0,
        max_len: int | None = None,
    ) -> None:
        super().__init__()
        self.spec: TaskSpec = TASKS.get(task)
        if preset not in self.spec.presets:
            raise UserError(
                f"unknown preset '{preset}' for task {task}; valid presets: {', '.join(self.spec.presets)}"
            )
        if batch_size <= 0:
            raise UserError(f"batch_size must be positive, got {batch_size}")
        if max_len is not None and not 0 < max_len <= self.spec.max_len:
            raise UserError(
                f"data.max_len must be in 1..{self.spec.max_len} for task {task} "
                f"(the prepared cache holds at most {self.spec.max_len} tokens), got {max_len}"
            )
        self.task = task
        self.data_dir = Path(data_dir) if data_dir else cache.default_data_dir()
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise UserError(
                f"data dir {self.data_dir} is not a directory; pass --data.data_dir DIR or set $LRA_DATA"
            )
        self.preset = preset
        self.batch_size = batch_size
        if num_workers is not None and num_workers < 0:
            raise UserError(f"num_workers must be >= 0, got {num_workers}")
        self.num_workers = default_workers() if num_workers is None else num_workers
        self.seed = seed
        self.max_len = max_len
        self.splits = None

    @property
    def path(self) -> Path:
        return cache.prepared_dir(self.data_dir, self.task, self.preset)

    def prepare_data(self) -> None:
        if cache.is_prepared(self.path):
            return
        if not self.spec.local(self.preset):
            command = self.spec.prepare_command(self.data_dir, self.preset)
            raise UserError(f"no prepared data at {self.path}; run: {command}")
        Console(stderr=True).print(f"no prepared {self.task} data at {self.path}: generating it now")
        self.spec.prepare(self.data_dir, self.preset, seed=self.seed)

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            hint = self.spec.prepare_command(self.data_dir, self.preset)
            self.splits = cache.load_prepared(self.path, hint).with_format("numpy")

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        # Whole batches come from the Arrow columns at once (PackedSplit.__getitems__).
        return DataLoader(
            PackedSplit(self.splits[split], max_len=self.max_len),
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            collate_fn=batch_identity,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
