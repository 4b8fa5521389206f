"""Batch collation: pad to the longest sequence in the batch, keep the true lengths."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def pad(seqs: list[np.ndarray]) -> torch.Tensor:
    out = np.zeros((len(seqs), max(len(s) for s in seqs)), dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return torch.from_numpy(out)


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    batch: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if key.startswith("input_ids"):
            batch[key] = pad(values)
        else:
            batch[key] = torch.as_tensor(np.asarray(values), dtype=torch.long)
    return batch
