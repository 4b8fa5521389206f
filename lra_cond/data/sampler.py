"""A shuffling sampler whose order is a pure function of (seed, epoch), so a run resumed mid-epoch
sees exactly the batches an uninterrupted run would have seen.

``torch.utils.data.RandomSampler`` draws from the global RNG when an epoch starts; after a resume
the global RNG (and Lightning's restart logic, which starts a plain DataLoader's epoch over from its
first batch) would give a different order. Here epoch ``e`` is the permutation drawn from
``numpy.random.default_rng([seed, e])``, and ``resume(epoch, skip)`` drops the first ``skip``
indices of that epoch (until ``set_epoch`` moves to another epoch).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler


class EpochShuffleSampler(Sampler[int]):
    """Indices ``0..num_samples-1`` in a fresh seeded permutation each epoch.

    Lightning calls ``set_epoch`` at the start of every epoch. ``__len__`` is always the full epoch,
    so the trainer's batches-per-epoch count does not change on a mid-epoch resume; the resumed epoch
    simply ends early, where the interrupted one would have ended.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, indices to skip in that epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self._resume is not None and self._resume[0] != epoch:
            self._resume = None  # the resumed epoch is over

    def resume(self, epoch: int, skip: int) -> None:
        """Start at ``epoch``, skipping its first ``skip`` indices (already trained on)."""
        self.epoch = epoch
        self._resume = (epoch, skip)

    def permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def __iter__(self) -> Iterator[int]:
        order = self.permutation(self.epoch)
        if self._resume is not None and self._resume[0] == self.epoch:
            order = order[self._resume[1] :]
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.num_samples
