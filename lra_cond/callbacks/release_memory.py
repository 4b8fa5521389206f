"""Free memory handed back to the system after every validation (``heap.release_free_memory``), so a
long fit's resident size stays at what it uses rather than growing with the heap's free blocks."""

from __future__ import annotations

import lightning.pytorch as pl

from lra_cond.heap import release_free_memory


class ReleaseFreeMemory(pl.Callback):
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        release_free_memory()
