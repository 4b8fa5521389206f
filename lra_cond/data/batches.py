"""A prepared split served a whole batch at a time, straight from its Arrow columns.

Why: reading a ``datasets`` split row by row (numpy format) costs tens of microseconds per row in
formatting. Here the columns are viewed once as flat numpy arrays (zero-copy over the memory-mapped
Arrow files: values + offsets per chunk), and torch's DataLoader calls ``__getitems__`` with a
batch's indices, which pads the batch directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lra_cond.data.documents import ids_key, is_ids, is_length


class _Ragged:
    """One list column: per-chunk values and offsets, addressed by global row index."""

    def __init__(self, column: Any) -> None:
        chunks = [c for c in column.chunks if len(c)] or column.chunks[:1]
        self.values = [c.values.to_numpy(zero_copy_only=False) for c in chunks]
        self.offsets = [c.offsets.to_numpy() for c in chunks]
        self.starts = np.cumsum([0] + [len(c) for c in chunks])

    def rows(self, idx: np.ndarray) -> list[np.ndarray]:
        chunk = np.searchsorted(self.starts, idx, side="right") - 1
        out = []
        for c, i in zip(chunk.tolist(), (idx - self.starts[chunk]).tolist()):
            offsets = self.offsets[c]
            out.append(self.values[c][offsets[i] : offsets[i + 1]])
        return out


def pad_rows(rows: list[np.ndarray], max_len: int | None = None) -> torch.Tensor:
    """(batch, longest) int64 ids, zero-padded; each row cut to ``max_len`` tokens if given."""
    lengths = [min(len(r), max_len) if max_len else len(r) for r in rows]
    out = np.zeros((len(rows), max(lengths, default=0)), dtype=np.int64)
    for i, (r, n) in enumerate(zip(rows, lengths)):
        out[i, :n] = r[:n]
    return torch.from_numpy(out)


class PackedSplit(Dataset):
    """Rows of one prepared split; ``__getitems__(indices)`` returns the padded batch.

    Args:
        split: a ``datasets.Dataset`` of the prepared cache (any format).
        max_len: keep only the first ``max_len`` tokens of each sequence (and cap ``length*``).
        drop_ids: token ids removed from every sequence before padding (lengths follow).
    """

    def __init__(self, split: Any, max_len: int | None = None, drop_ids: tuple[int, ...] = ()) -> None:
        self.split = split
        self.max_len = max_len
        self.drop_ids = tuple(drop_ids)
        self._build()

    def _build(self) -> None:
        table = self.split.with_format("arrow")[:]  # a zero-copy slice unless rows were re-indexed
        self.n = table.num_rows
        self.ragged = {n: _Ragged(table.column(n)) for n in table.column_names if is_ids(n)}
        self.scalars = {
            n: table.column(n).to_numpy().astype(np.int64) for n in table.column_names if n not in self.ragged
        }

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64)
        rows = {name: col.rows(idx) for name, col in self.ragged.items()}
        if self.drop_ids:  # the tokens a variant leaves out (e.g. ListOps' closing brackets)
            rows = {name: [r[~np.isin(r, self.drop_ids)] for r in rs] for name, rs in rows.items()}
        batch = {name: pad_rows(rs, self.max_len) for name, rs in rows.items()}
        for name, col in self.scalars.items():
            values = col[idx]
            if self.drop_ids and is_length(name):
                values = np.array([len(r) for r in rows[ids_key(name)]], dtype=np.int64)
            if self.max_len and is_length(name):
                values = np.minimum(values, self.max_len)
            batch[name] = torch.from_numpy(values)
        return batch

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """One row as a batch of one (DataLoaders batch through ``__getitems__``)."""
        return self.__getitems__([index])

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes get the Dataset (pickled by file reference) and rebuild their views,
        # rather than a pickled copy of every token.
        return {"split": self.split, "max_len": self.max_len, "drop_ids": self.drop_ids}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._build()


def batch_identity(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DataLoader ``collate_fn`` for ``PackedSplit``: its batches arrive already collated."""
    return batch
