"""PackedSplit (whole-batch loading from the Arrow cache) against row-by-row collation."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets import Dataset, concatenate_datasets

from lra_cond.data.batches import PackedSplit
from lra_cond.data.cache import ragged
from lra_cond.data.datamodule import LraDataModule
from lra_cond.errors import UserError


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Row-by-row collation, written plainly: pad ``input_ids*`` to the longest, stack the rest."""
    batch = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if key.startswith("input_ids"):
            out = np.zeros((len(values), max(len(v) for v in values)), dtype=np.int64)
            for i, v in enumerate(values):
                out[i, : len(v)] = v
            batch[key] = torch.from_numpy(out)
        else:
            batch[key] = torch.as_tensor(np.asarray(values), dtype=torch.long)
    return batch


def make_split(lengths: list[int], seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, 16, n).astype(np.int16) for n in lengths]
    table = pa.table(
        {
            "input_ids": ragged(seqs),
            "length": pa.array(lengths, pa.int32()),
            "label": pa.array(rng.integers(0, 10, len(lengths)), pa.int32()),
        }
    )
    return Dataset(table)


def reference_batch(split: Dataset, indices: list[int], max_len: int | None = None) -> dict:
    """The old path: numpy-format rows, then ``collate`` (pad to the longest), truncation by hand."""
    rows = [split.with_format("numpy")[i] for i in indices]
    if max_len:
        rows = [
            {**r, "input_ids": r["input_ids"][:max_len], "length": min(r["length"], max_len)} for r in rows
        ]
    return collate(rows)


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == torch.long, key
        assert torch.equal(got[key], want[key]), key


def test_batches_equal_row_collation_across_chunks_and_slices():
    # Three Arrow chunks (concatenation), then a slice: offsets must be resolved per chunk.
    parts = [make_split([5, 9, 1], 0), make_split([7, 2], 1), make_split([12, 3, 4, 8], 2)]
    split = concatenate_datasets(parts)
    assert len(split.data.column("input_ids").chunks) == 3
    packed = PackedSplit(split)
    for indices in ([0], [2, 3, 8], [8, 0, 5, 4], list(range(9))):
        assert_same(packed.__getitems__(indices), reference_batch(split, indices))
    assert_same(PackedSplit(split, max_len=6).__getitems__([8, 5, 1]), reference_batch(split, [8, 5, 1], 6))


def test_pickled_copy_serves_the_same_batches():
    split = make_split([4, 6, 2, 9])
    packed = pickle.loads(pickle.dumps(PackedSplit(split)))
    assert_same(packed.__getitems__([3, 1]), reference_batch(split, [3, 1]))


def test_datamodule_loader_covers_the_split_once(tiny_listops):
    dm = LraDataModule("listops", str(tiny_listops), "tiny", batch_size=7, num_workers=0)
    dm.setup("fit")
    seen = []
    for batch in dm.val_dataloader():
        lengths = batch["length"]
        assert batch["input_ids"].shape[1] == int(lengths.max())
        assert bool(
            (batch["input_ids"][torch.arange(batch["input_ids"].shape[1]) >= lengths[:, None]] == 0).all()
        )
        seen.extend(batch["input_ids"][i, : lengths[i]].tolist() for i in range(len(lengths)))
    want = [list(r) for r in dm.splits["val"]["input_ids"]]
    assert sorted(seen) == sorted(want)  # every row once,
    assert [len(r) for r in seen] == sorted(map(len, want), reverse=True)  # the longest first,
    ties = [r for r in want if len(r) == len(seen[0])]
    assert seen[: len(ties)] == ties  # equal lengths in split order
    probe_rows = []
    for b in dm.probe_dataloader():
        probe_rows += [row[:n] for row, n in zip(b["input_ids"].tolist(), b["length"].tolist())]
    assert probe_rows == want  # the probe's loader: the split in its own order


def test_dropped_tokens_leave_every_sequence_and_its_length(tiny_listops):
    """``--data.drop_tokens '["]"]'``: ListOps without its closing brackets (the reference pipeline's
    input before LRA's tokenizer fix): each row is the original minus those ids, in order."""
    plain = LraDataModule("listops", str(tiny_listops), "tiny", batch_size=8)
    dropped = LraDataModule("listops", str(tiny_listops), "tiny", batch_size=8, drop_tokens=["]"])
    plain.setup("fit")
    dropped.setup("fit")
    closing = 5  # "]": after the four operators
    for a, b in zip(plain.val_dataloader(), dropped.val_dataloader()):
        for i in range(len(a["length"])):
            row = a["input_ids"][i, : a["length"][i]]
            want = row[row != closing]
            assert int(b["length"][i]) == len(want) < len(row)
            assert torch.equal(b["input_ids"][i, : b["length"][i]], want)
            assert not bool((b["input_ids"][i, b["length"][i] :] != 0).any())


def test_drop_tokens_names_are_checked(tiny_listops):
    with pytest.raises(
        UserError, match=r"unknown token '\)' in data.drop_tokens; valid tokens of listops: \[MIN"
    ):
        LraDataModule("listops", str(tiny_listops), "tiny", drop_tokens=[")"])
    with pytest.raises(UserError, match="data.drop_tokens needs a symbol vocabulary; task text has none"):
        LraDataModule("text", str(tiny_listops), "tiny", drop_tokens=["a"])
