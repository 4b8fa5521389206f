"""LightningDataModule over the prepared cache of any registered task."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from rich.console import Console
from torch.utils.data import DataLoader

from lra_cond.data import cache
from lra_cond.data.batches import PackedSplit, batch_identity
from lra_cond.data.documents import document_keys, is_length
from lra_cond.data.sampler import EpochShuffleSampler
from lra_cond.data.tasks import TASKS, TaskSpec
from lra_cond.errors import UserError, user_path

# The training loader resumes mid-epoch through this datamodule's state (see ``state_dict``), which
# Lightning's check for a resumable DataLoader does not know about.
warnings.filterwarnings("ignore", message=r".*ended before the epoch ended and your dataloader is not")


def default_workers() -> int:
    return min(2, max(0, (os.cpu_count() or 1) - 1)) if torch.cuda.is_available() else 0


class LraDataModule(pl.LightningDataModule):
    """Loads ``<data_dir>/<task>/<preset>/prepared``; generates it first for synthetic tasks.

    Args:
        task: LRA task name.
        data_dir: data root; defaults to ``$LRA_DATA``, else ``~/.cache/lra_cond``
            (``cache.default_data_dir``).
        preset: ``full`` (the LRA splits) or ``tiny`` (a few hundred examples, for smoke tests).
        batch_size: examples per batch.
        num_workers: DataLoader worker processes; default 0 on CPU-only machines (batches are cheap
            to assemble, see ``batches.py``, and workers would take cores from training), 2 when
            CUDA is available (assembly overlaps the GPU step).
        seed: generator seed used when the data must be generated on the fly.
        max_len: keep only the first ``max_len`` tokens of every sequence (default: the task's
            maximum, all that the cache holds). E.g. 1000 for the shorter text setup; the CLI links
            it to ``model.max_len`` so the position table matches.
        drop_tokens: symbols left out of every sequence, for a task with a symbol vocabulary
            (ListOps): ``["]"]`` gives the input of the LRA pipeline before its tokenizer fix, which
            the published Nyströmformer numbers were measured on (docs/differences.md).

    The training order is a seeded permutation per epoch (``EpochShuffleSampler``); its seed is the
    global seed at the first ``train_dataloader()`` (``seed_everything``), and it is saved in
    checkpoints together with the position in the epoch, so ``--ckpt_path last`` continues with
    exactly the batches an uninterrupted run would have used.
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
        drop_tokens: list[str] | None = None,
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
        self.drop_ids = self._token_ids(drop_tokens or [])
        self.task = task
        self.data_dir = Path(user_path(data_dir)) if data_dir else cache.default_data_dir()
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise UserError(
                f"data dir {self.data_dir} is not a directory; pass --data.data_dir DIR or set $LRA_DATA"
            )
        cache.check_data_root(self.data_dir, "--data.data_dir")
        self.preset = preset
        self.batch_size = batch_size
        if num_workers is not None and num_workers < 0:
            raise UserError(f"num_workers must be >= 0, got {num_workers}")
        self.num_workers = default_workers() if num_workers is None else num_workers
        self.seed = seed
        self.max_len = max_len
        self.splits = None
        self.shuffle_seed: int | None = None
        self._train_sampler: EpochShuffleSampler | None = None
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches already trained in it)

    def _token_ids(self, symbols: list[str]) -> tuple[int, ...]:
        if not symbols:
            return ()
        if self.spec.vocabulary is None:
            raise UserError(f"data.drop_tokens needs a symbol vocabulary; task {self.spec.name} has none")
        vocabulary = self.spec.vocabulary()
        unknown = [s for s in symbols if s not in vocabulary]
        if unknown:
            raise UserError(
                f"unknown token {unknown[0]!r} in data.drop_tokens; valid tokens of {self.spec.name}: "
                f"{', '.join(vocabulary)}"
            )
        return tuple(vocabulary[s] for s in symbols)

    @property
    def path(self) -> Path:
        return cache.prepared_dir(self.data_dir, self.task, self.preset)

    def prepare_data(self) -> None:
        if cache.is_prepared(self.path):
            # Check the cache here, before any callback writes into the run folder, so a corrupt
            # cache stops the run without touching a previous run's files.
            self.setup()
            return
        if not self.spec.local(self.preset):
            command = self.spec.prepare_command(self.data_dir, self.preset)
            raise UserError(f"no prepared data at {self.path}; run: {command}")
        console = Console(stderr=True)
        console.print(f"no prepared {self.task} data at {self.path}: generating it now")
        # if_missing: when several runs start at once, one generates and the others wait for it.
        self.spec.prepare(self.data_dir, self.preset, seed=self.seed, if_missing=True)
        console.print(f"prepared {self.task} ({self.preset}) at {self.path}")

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            hint = self.spec.prepare_command(self.data_dir, self.preset)
            with cache.locked(self.data_dir, self.task, self.preset, shared=True, on_wait=self._waiting):
                dd = cache.load_prepared(self.path, hint, self.task, self.preset, self.spec.limits)
                # What a run records of its data, and a resume checks.
                self.data_sha256: str = cache.data_sha256(cache.read_manifest(self.path))
            self.splits = dd.with_format("numpy")
        if stage == "fit":
            self._check_batches()

    def _waiting(self, pid: int | None) -> None:
        who = f" (pid {pid})" if pid else ""
        Console(stderr=True).print(f"waiting for a prepare of {self.path}{who} to finish")

    def _check_batches(self) -> None:
        """Training drops the last partial batch: a split smaller than a batch would train 0 steps."""
        trainer = getattr(self, "trainer", None)
        world = trainer.world_size if trainer is not None else 1
        n = len(self.splits["train"])
        if n // world < self.batch_size:
            per = f" ({n // world} per process on {world})" if world > 1 else ""
            raise UserError(
                f"data.batch_size {self.batch_size} is larger than the train split of {self.task} "
                f"({self.preset}): {n} examples{per}, so training would run 0 steps; choose "
                f"--data.batch_size <= {n // world}"
            )

    def _loader(self, split: str, sampler: EpochShuffleSampler | list[int] | None = None) -> DataLoader:
        # Whole batches come from the Arrow columns at once (PackedSplit.__getitems__).
        return DataLoader(
            PackedSplit(self.splits[split], max_len=self.max_len, drop_ids=self.drop_ids),
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=isinstance(sampler, EpochShuffleSampler),
            collate_fn=batch_identity,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            # Worker seeds come from this generator, not the global RNG, so creating a loader does
            # not shift the dropout stream (which resume restores exactly).
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_dataloader(self) -> DataLoader:
        if self.shuffle_seed is None:
            self.shuffle_seed = torch.initial_seed()
        self._train_sampler = EpochShuffleSampler(len(self.splits["train"]), self.shuffle_seed)
        if self._resume_at is not None:
            epoch, batches = self._resume_at
            self._train_sampler.resume(epoch, batches * self.batch_size)
            self._resume_at = None
        return self._loader("train", self._train_sampler)

    def longest_first(self, split: str) -> list[int]:
        """The split's examples from the most tokens to the fewest (ties in split order): evaluation
        batches of near-equal lengths, each then one length group with almost no padding (15% off a
        ListOps validation pass against batches in split order). Accuracy and mean loss do not
        depend on how examples are batched."""
        tokens = sum(
            np.asarray(self.splits[split][k], dtype=np.int64)
            for k in self.splits[split].column_names
            if is_length(k)
        )
        if self.max_len:
            tokens = np.minimum(tokens, self.max_len * len(document_keys(self.spec.pair)))
        return np.argsort(-tokens, kind="stable").tolist()

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.longest_first("val"))

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.longest_first("test"))

    def probe_dataloader(self) -> DataLoader:
        """The validation split in its own order: the condition-number probe takes its first examples."""
        return self._loader("val")

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the shuffled order; saved in every checkpoint."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or self.shuffle_seed is None:
            return {}
        # Batches finished in the current epoch (the checkpoint is written after a training step).
        epoch, done = trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if done >= trainer.num_training_batches:  # saved on the epoch's last batch: next epoch, from 0
            epoch, done = epoch + 1, 0
        return {"shuffle_seed": self.shuffle_seed, "epoch": epoch, "batches_done": done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.shuffle_seed = state_dict["shuffle_seed"]
            self._resume_at = (state_dict["epoch"], state_dict["batches_done"])
