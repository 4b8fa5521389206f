"""LightningDataModule over the prepared cache of any registered task."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import lightning.pytorch as pl
from rich.console import Console
from torch.utils.data import DataLoader

from lra_cond.data import cache
from lra_cond.data.collate import collate
from lra_cond.data.tasks import TASKS, TaskSpec
from lra_cond.errors import UserError


class LraDataModule(pl.LightningDataModule):
    """Loads ``<data_dir>/<task>/<preset>/prepared``; generates it first for synthetic tasks.

    Args:
        task: LRA task name.
        data_dir: data root; defaults to ``$LRA_DATA`` or ``./data``.
        preset: ``full`` (the LRA splits) or ``tiny`` (a few hundred examples, for smoke tests).
        batch_size: examples per batch.
        num_workers: DataLoader worker processes.
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
        num_workers: int = 0,
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
        self.num_workers = num_workers
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
        return DataLoader(
            self.splits[split],
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            collate_fn=partial(collate, max_len=self.max_len),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
