"""ListOps generator and reader, checked against an evaluator and parser written here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from data_prep import listops
from lra_cond.errors import UserError

OPS = {"[MIN", "[MAX", "[MED", "[SM"}


def evaluate(source: str) -> tuple[int, int, int]:
    """Independent stack evaluator: (value, token length without parens, '(' count expected)."""
    stack: list[tuple[str, list[int]]] = []
    result = None
    length = 0
    parens = 0
    for tok in source.split():
        if tok in ("(", ")"):
            continue
        length += 1
        if tok in OPS:
            stack.append((tok, []))
        elif tok == "]":
            op, args = stack.pop()
            parens += len(args) + 1  # nested-pair serialization: one '(' per argument plus one
            s = sorted(args)
            if op == "[MIN":
                v = s[0]
            elif op == "[MAX":
                v = s[-1]
            elif op == "[SM":
                v = sum(args) % 10
            else:
                mid = len(s) // 2
                v = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2
            if stack:
                stack[-1][1].append(v)
            else:
                result = v
        else:
            d = int(tok)
            if stack:
                stack[-1][1].append(d)
            else:
                result = d
    assert not stack
    return result, length, parens


@pytest.fixture(scope="module")
def small_cfg() -> listops.ListOpsConfig:
    return dataclasses.replace(listops.PRESETS["tiny"], sizes=(300, 50, 50))


def test_labels_match_independent_evaluator(small_cfg):
    trees = listops.generate_trees(small_cfg, seed=3)
    assert len(trees) == sum(small_cfg.sizes)
    for source, label in trees:
        value, _, parens = evaluate(source)
        assert label == value, source
        assert source.count("(") == source.count(")") == parens


def test_lengths_respect_window_and_trees_are_distinct(small_cfg):
    trees = listops.generate_trees(small_cfg, seed=4)
    lengths = [evaluate(s)[1] for s, _ in trees]
    assert all(small_cfg.min_len < n < small_cfg.max_len for n in lengths)
    assert len({s for s, _ in trees}) == len(trees)


def test_reference_window_500_2000():
    cfg = dataclasses.replace(listops.PRESETS["full"], sizes=(40, 0, 0))
    for source, label in listops.generate_trees(cfg, seed=0):
        value, length, _ = evaluate(source)
        assert 500 < length < 2000 and label == value


def test_operators_and_labels_all_occur(small_cfg):
    trees = listops.generate_trees(small_cfg, seed=5)
    text = " ".join(s for s, _ in trees)
    assert all(op in text for op in OPS)
    assert len({label for _, label in trees}) >= 8


def _release_bytes(root, seed, workers=1) -> dict[str, bytes]:
    rel = listops.write_release(root, "tiny", seed=seed, workers=workers)
    return {p.name: p.read_bytes() for p in sorted(rel.iterdir())}


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = _release_bytes(tmp_path / "a", seed=7)
    b = _release_bytes(tmp_path / "b", seed=7, workers=2)
    c = _release_bytes(tmp_path / "c", seed=8)
    assert set(a) == {"basic_train.tsv", "basic_val.tsv", "basic_test.tsv"}
    assert a == b
    assert all(a[k] != c[k] for k in a)


def test_release_layout_header_and_sizes(tmp_path):
    rel = listops.write_release(tmp_path, "tiny", seed=0)
    assert rel.name == "listops-1000"
    for split, size in zip(listops.SPLITS, listops.PRESETS["tiny"].sizes):
        lines = (rel / f"basic_{split}.tsv").read_text().splitlines()
        assert lines[0] == "Source\tTarget"
        assert len(lines) == size + 1


def test_vocabulary_is_15_symbols_ids_1_to_15():
    assert sorted(listops.VOCAB.values()) == list(range(1, 16))
    assert set(listops.VOCAB) == OPS | {"]"} | {str(d) for d in range(10)}


OFFICIAL_STYLE = (
    "Source\tTarget\n"
    "( ( ( [MAX 2 ) 9 ) ] )\t9\n"
    "( ( ( ( [SM 3 ) ( ( ( [MIN 4 ) 1 ) ] ) ) 5 ) ] )\t9\n"
    "( ( ( [MED 1 ) 8 ) ] )\t4\n"
)


def test_reader_parses_hand_written_official_tsv(tmp_path):
    path = tmp_path / "basic_test.tsv"
    path.write_text(OFFICIAL_STYLE)
    rows = list(listops.read_tsv(path))
    inverse = {i: s for s, i in listops.VOCAB.items()}
    decoded = [" ".join(inverse[int(i)] for i in ids) for ids, _ in rows]
    assert decoded == ["[MAX 2 9 ]", "[SM 3 [MIN 4 1 ] 5 ]", "[MED 1 8 ]"]
    assert [label for _, label in rows] == [9, 9, 4]
    assert [evaluate(line.split("\t")[0])[0] for line in OFFICIAL_STYLE.splitlines()[1:]] == [9, 9, 4]


def test_reader_round_trips_generated_release(tmp_path):
    rel = listops.write_release(tmp_path, "tiny", seed=1)
    trees = listops.generate_trees(listops.PRESETS["tiny"], seed=1)
    splits = listops.read_release(rel)
    ids = splits["train"]["input_ids"] + splits["val"]["input_ids"] + splits["test"]["input_ids"]
    labels = splits["train"]["label"] + splits["val"]["label"] + splits["test"]["label"]
    assert labels == [label for _, label in trees]
    for got, (source, _) in zip(ids, trees):
        np.testing.assert_array_equal(got, listops.tokenize(source))
        assert len(got) == evaluate(source)[1]


@pytest.mark.parametrize(
    "body, message",
    [
        ("( [MAX 2 ] )\t2\textra\n", "basic_x.tsv:2: expected 2 tab-separated columns, got 3"),
        ("( [MAX 2 ] )\tseven\n", "basic_x.tsv:2: label 'seven' is not an integer"),
        ("( [MAX 2 ] [FOO )\t2\n", "basic_x.tsv:2: unknown ListOps token '[FOO'"),
    ],
)
def test_reader_reports_file_and_line(tmp_path, body, message):
    path = tmp_path / "basic_x.tsv"
    path.write_text("Source\tTarget\n" + body)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(")):
        list(listops.read_tsv(path))
