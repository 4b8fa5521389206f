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


def collate(rows: list[dict[str, Any]], max_len: int | None = None) -> dict[str, torch.Tensor]:
    """Pad ``input_ids*`` columns; with ``max_len``, keep only each sequence's first max_len tokens."""
    batch: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if key.startswith("input_ids"):
            batch[key] = pad([v[:max_len] for v in values] if max_len else values)
        elif key.startswith("length") and max_len:
            batch[key] = torch.as_tensor(np.minimum(values, max_len), dtype=torch.long)
        else:
            batch[key] = torch.as_tensor(np.asarray(values), dtype=torch.long)
    return batch
