"""The batch keys of a task's documents, spelled once.

Every batch and prepared split holds ``input_ids`` (token ids) and ``length`` (real lengths); a
pair task (retrieval) adds its second document as ``input_ids2``/``length2``. Whatever builds or
reads a batch goes through these names.
"""

from __future__ import annotations

IDS, LENGTH = "input_ids", "length"


def document_keys(pair: bool) -> tuple[tuple[str, str], ...]:
    """(ids key, length key) of each document of a batch: one, or two for a pair task."""
    keys = ((IDS, LENGTH), (IDS + "2", LENGTH + "2"))
    return keys if pair else keys[:1]


def is_ids(key: str) -> bool:
    return key.startswith(IDS)


def is_length(key: str) -> bool:
    return key.startswith(LENGTH)


def length_key(ids_key: str) -> str:
    """The length column of an ids column (``input_ids2`` -> ``length2``)."""
    return LENGTH + ids_key.removeprefix(IDS)


def ids_key(length_key_: str) -> str:
    """The ids column of a length column (``length2`` -> ``input_ids2``)."""
    return IDS + length_key_.removeprefix(LENGTH)
