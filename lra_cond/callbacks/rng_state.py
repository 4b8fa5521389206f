"""Saves the random number generators in checkpoints and restores them on resume.

Lightning checkpoints do not hold RNG states, so after ``--ckpt_path last`` dropout would draw a
different stream than the uninterrupted run. The state is captured when a checkpoint is written
(right after a training step or its validation) and put back in ``on_train_start``: after model
construction and the sanity validation of the resumed process, before any other callback's
``on_train_batch_start`` (which may draw random numbers, as it would have in the uninterrupted run).
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch


def collect_rng_states() -> dict[str, Any]:
    """RNG states as tensors and plain Python values (loadable with ``torch.load(weights_only=True)``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RngState(pl.Callback):
    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return collect_rng_states()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict or None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:
            set_rng_states(self._pending)
            self._pending = None
