"""ListOps generator and reader, checked against an evaluator and parser written here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lra_cond.data_prep import listops
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


def test_reader_limit_is_the_task_max_len():
    from lra_cond.data.tasks import TASKS

    assert listops.MAX_LEN == TASKS.get("listops").max_len


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


def _reference_tree(rng, depth: int, cfg) -> tuple[list[str], int]:
    """The reference algorithm, written plainly: recursive, no early abort, numpy median."""
    if depth < cfg.max_depth and rng.random() <= listops.OPERATOR_P:
        n = rng.randint(2, cfg.max_args)
        kids = [_reference_tree(rng, depth + 1, cfg) for _ in range(n)]
        op = rng.choice(sorted(OPS))
        vals = [v for _, v in kids]
        value = {"[MIN": min(vals), "[MAX": max(vals), "[SM": sum(vals) % 10}.get(op)
        if value is None:
            value = int(np.median(vals))
        return [op, *(t for toks, _ in kids for t in toks), "]"], value
    d = rng.randrange(10)
    return [str(d)], d


def _tree_stats(tokens: list[str]) -> tuple[int, int, list[int]]:
    """(length, depth, arity of each operator) of a token list without parentheses."""
    open_counts: list[int] = []  # arguments seen so far, per open operator
    arities: list[int] = []
    depth = 0
    for tok in tokens:
        if tok == "]":
            arities.append(open_counts.pop())
            continue
        if open_counts:  # a digit or a nested operator is an argument of the innermost operator
            open_counts[-1] += 1
        if tok in OPS:
            open_counts.append(0)
            depth = max(depth, len(open_counts))
    return len(tokens), depth, arities


def test_generator_matches_reference_distribution():
    """Fast generator vs the plain reference algorithm (rejection sampling, distinct trees).

    Fixed seeds, so the test is deterministic; bounds are ~4 standard errors for 1500 trees.
    """
    import random

    cfg = dataclasses.replace(listops.PRESETS["tiny"], sizes=(1500, 0, 0))
    fast = [(s.split(), label) for s, label in listops.generate_trees(cfg, seed=11)]
    fast = [([t for t in toks if t not in "()"], label) for toks, label in fast]
    rng, seen, ref = random.Random(0), set(), []
    while len(ref) < 1500:
        toks, label = _reference_tree(rng, 1, cfg)
        key = " ".join(toks)
        if cfg.min_len < len(toks) < cfg.max_len and key not in seen:
            seen.add(key)
            ref.append((toks, label))
    summaries = {}
    for name, trees in (("fast", fast), ("ref", ref)):
        stats = [_tree_stats(toks) for toks, _ in trees]
        arities = np.array([a for _, _, ar in stats for a in ar])
        ops = [t for toks, _ in trees for t in toks if t in OPS]
        summaries[name] = {
            "length": np.array([n for n, _, _ in stats]),
            "depth": np.array([d for _, d, _ in stats]),
            "arity_hist": np.bincount(arities, minlength=11)[2:11] / len(arities),
            "op_freq": np.array([ops.count(o) for o in sorted(OPS)]) / len(ops),
            "labels": np.bincount([label for _, label in trees], minlength=10) / len(trees),
        }
    f, r = summaries["fast"], summaries["ref"]
    assert r["arity_hist"].min() > 0.08  # sanity of the reference itself: uniform over 2..10
    for key in ("length", "depth"):
        se = np.sqrt(f[key].var() / 1500 + r[key].var() / 1500)
        assert abs(f[key].mean() - r[key].mean()) < 4 * se, key
    # Two-sample Kolmogorov-Smirnov on lengths (critical value ~0.07 at alpha 1e-3 for 1500 vs 1500).
    grid = np.arange(cfg.max_len)
    ecdf = [np.searchsorted(np.sort(s["length"]), grid, side="right") / 1500 for s in (f, r)]
    assert np.abs(ecdf[0] - ecdf[1]).max() < 0.07
    for key, tol in (("arity_hist", 0.03), ("op_freq", 0.02), ("labels", 0.05)):
        assert np.abs(f[key] - r[key]).max() < tol, (key, f[key], r[key])


def test_an_interrupted_generation_continues_where_it_stopped(tmp_path, monkeypatch):
    """Ctrl-C at chunk 5 keeps chunks 0-4 in the partial file; the same call then makes only the rest,
    and the trees are those of one uninterrupted generation (also past a line torn by a kill)."""
    monkeypatch.setattr(listops, "CHUNK", 40)
    cfg = listops.PRESETS["tiny"]
    straight = listops.generate_trees(cfg, seed=3)
    real, made, armed = listops._chunk, [], [True]

    def chunk(args):  # noqa: ANN001, ANN202
        if args[1] == 5 and armed[0]:
            raise KeyboardInterrupt
        made.append(args[1])
        return real(args)

    monkeypatch.setattr(listops, "_chunk", chunk)
    partial = tmp_path / "source" / listops.PARTIAL
    with pytest.raises(
        KeyboardInterrupt, match=rf"while generating ListOps: \d+ of 768 trees are kept in {partial}"
    ):
        listops.generate_trees(cfg, 3, partial=partial)
    made.clear()
    lines = partial.read_text().splitlines()
    assert lines[0] == f"#listops trees seed=3 config={cfg!r}" and lines[-1] == "#chunk 4"
    with open(partial, "a") as f:
        f.write("( ( [MAX 2 ")  # a line cut short by a kill
    armed[0] = False
    assert listops.generate_trees(cfg, 3, partial=partial) == straight
    assert made[0] == 5 and not partial.exists()  # chunks 0-4 were not made again


def test_a_partial_file_of_another_seed_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(listops, "CHUNK", 40)
    cfg = listops.PRESETS["tiny"]
    partial = tmp_path / listops.PARTIAL
    partial.write_text(f"#listops trees seed=3 config={cfg!r}\n( 1 )\t1\n#chunk 0\n")
    assert listops.generate_trees(cfg, 4, partial=partial) == listops.generate_trees(cfg, 4)


def test_ctrl_c_of_prepare_is_one_line_saying_what_was_kept(tmp_path, monkeypatch, capfd):
    from lra_cond.cli import main

    real = listops._chunk

    def chunk(args):  # noqa: ANN001, ANN202
        if args[1] == 1:
            raise KeyboardInterrupt
        return real(args)

    monkeypatch.setattr(listops, "_chunk", chunk)
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "prepare",
                "--task",
                "listops",
                "--preset",
                "tiny",
                "--data-dir",
                str(tmp_path),
                "--workers",
                "1",
            ]
        )
    assert exit_.value.code == 130
    partial = tmp_path / "listops/tiny/source" / listops.PARTIAL
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"error: interrupted (Ctrl-C) while generating ListOps: 500 of 768 trees are kept in {partial}; "
        "the same "
        "command continues from there"
    )
    assert (
        not (tmp_path / "listops/tiny/.lock").exists() and not (tmp_path / "listops/tiny/prepared").exists()
    )
