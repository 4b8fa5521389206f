"""A batch run as length groups (the training, validation and test path) against the same batch
padded to its longest sequence (the reference's computation): logits, loss and every gradient, for
every family, single and pair tasks, lengths from 1 token to the maximum in one batch."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from lra_cond.callbacks.layer_inputs import capture_layer_inputs
from lra_cond.models import length_groups as grouping
from lra_cond.models.attention import ATTENTIONS
from lra_cond.models.dropout import Dropout, quantized_rate
from lra_cond.models.encoder import Encoder, padded_batches
from lra_cond.models.length_groups import length_groups
from lra_cond.training.module import LraModel

MAX_LEN = 48
LENGTHS = [1, 48, 3, 40, 48, 17, 2, 29, 33, 9, 47, 1]  # 1 token to the maximum, unsorted


def brute_force_cost(lengths: list[int], charge: int) -> float:
    """The least sum of (size x longest) + charge over every split of the length-sorted positions."""
    s = sorted((max(1, n) for n in lengths), reverse=True)
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(s) - 1):
        bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], len(s)]
        cost = sum((b - a) * s[a] + charge for a, b in zip(bounds, bounds[1:]))
        best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("charge", [0, 20, 300])
def test_groups_partition_the_batch_at_the_least_cost(seed, charge):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 200, (9,), generator=g).tolist()
    groups = length_groups(lengths, charge)
    assert sorted(i for rows in groups for i in rows) == list(range(9))
    cost = sum(len(rows) * max(1, max(lengths[i] for i in rows)) + charge for rows in groups)
    assert cost == brute_force_cost(lengths, charge)
    for rows in groups:  # each group is a run of neighbouring lengths, ties in batch order
        assert rows == sorted(rows, key=lambda i: -lengths[i])


def batch(pair: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for suffix, lengths in (("", LENGTHS), ("2", LENGTHS[::-1])) if pair else (("", LENGTHS),):
        ids = torch.randint(1, 16, (len(lengths), MAX_LEN), generator=g)
        length = torch.tensor(lengths)
        ids[torch.arange(MAX_LEN)[None, :] >= length[:, None]] = 0
        out["input_ids" + suffix], out["length" + suffix] = ids, length
    out["label"] = torch.randint(0, 2, (len(LENGTHS),), generator=g)
    return out


@pytest.fixture(autouse=True)
def small_charge(monkeypatch):
    """A group charge in proportion to these short sequences, so the test batch splits."""
    monkeypatch.setattr(grouping, "GROUP_CHARGE_TOKENS", 40)


def model(family: str, task: str, dropout: float) -> LraModel:
    torch.manual_seed(0)
    options = {"num_landmarks": 8} if family == "nystrom" else {}
    m = LraModel(
        task=task,
        attention=family,
        attention_args=options,
        dim=16,
        mlp_dim=24,
        max_len=MAX_LEN,
        dropout=dropout,
    )
    return m.train()


def loss_and_grads(m: LraModel, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list]:
    m.zero_grad()
    logits = m(b)
    loss = F.cross_entropy(logits, b["label"])
    loss.backward()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("task", ["listops", "retrieval"])
@pytest.mark.parametrize("family", ATTENTIONS.names())
def test_grouped_equals_padded_logits_loss_and_every_gradient(family, task):
    # "Equal within float32 rounding": the grouped float32 result is as close to the exact (float64)
    # one as the padded float32 result is, quantity by quantity, and the two agree to 1e-4 relative
    # (Nystrom's pseudo-inverse iteration amplifies float32 rounding beyond 1e-5).
    m, b = model(family, task, dropout=0.0), batch(pair=task == "retrieval")
    assert len(length_groups(b["length"].tolist())) > 1  # the batch really runs as several groups
    grouped = loss_and_grads(m, b)
    with padded_batches(m):
        padded = loss_and_grads(m, b)
        exact = loss_and_grads(m.double(), b)
    names = ["logits", "loss", *(name for name, _ in m.named_parameters())]
    flat = [list(r[:2]) + r[2] for r in (grouped, padded, exact)]
    for name, g, p, e in zip(names, *flat):
        scale = max(e.abs().max().item(), 1e-3)
        err_grouped, err_padded = ((t.double() - e).abs().max().item() / scale for t in (g, p))
        assert err_grouped <= 4 * err_padded + 1e-6, (name, err_grouped, err_padded)
        assert (g - p).abs().max().item() <= 1e-4 * scale, name
    assert all(g.abs().max() > 0 for g in grouped[2][:4])  # the gradients are not all zero


def test_a_pooled_example_does_not_depend_on_its_batch():
    # Each example alone (a batch of one: no grouping, no padding) against the grouped batch.
    m, b = model("softmax", "listops", dropout=0.0), batch(pair=False)
    encoder = m.net.encoder
    with torch.no_grad():
        together = encoder(b["input_ids"], b["length"])
        alone = torch.cat(
            [encoder(b["input_ids"][i : i + 1, :n], b["length"][i : i + 1]) for i, n in enumerate(LENGTHS)]
        )
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["softmax", "nystrom"])
def test_grouped_and_padded_dropout_keep_the_same_rate(family):
    # The grouped and padded paths draw other masks (and the padded one also drops padding); both
    # keep 1 - rate of the values they see.
    p = 0.3
    m, b = model(family, "listops", dropout=p), batch(pair=False)
    kept: dict[bool, list[int]] = {True: [0, 0], False: [0, 0]}

    def count(grouped: bool):
        def hook(module, args, out):
            x = args[0]
            nonzero = x != 0
            kept[grouped][0] += int(((out != 0) & nonzero).sum())
            kept[grouped][1] += int(nonzero.sum())

        return hook

    for grouped in (True, False):
        handles = [d.register_forward_hook(count(grouped)) for d in m.modules() if isinstance(d, Dropout)]
        with torch.no_grad():
            for seed in range(20):
                torch.manual_seed(seed)
                if grouped:
                    m(b)
                else:
                    with padded_batches(m):
                        m(b)
        for h in handles:
            h.remove()
    rate = quantized_rate(p)
    for grouped, (k, n) in kept.items():
        assert abs(k / n - (1 - rate)) < 5 * (rate * (1 - rate) / n) ** 0.5, (grouped, k / n)


def test_the_probe_captures_the_padded_batch_in_its_order():
    m, b = model("softmax", "listops", dropout=0.0), batch(pair=False)
    m.eval()
    assert all(e.group_by_length for e in m.modules() if isinstance(e, Encoder))
    (_, x, mask), *_ = capture_layer_inputs(m, b)
    assert x.shape[:2] == (len(LENGTHS), MAX_LEN)
    assert torch.equal((~mask).sum(1), b["length"])
    with padded_batches(m), torch.no_grad():
        h = m.net.encoder.token_emb(b["input_ids"]) + m.net.encoder.pos_emb(torch.arange(MAX_LEN))[None]
    torch.testing.assert_close(x, m.net.encoder.blocks[0].norm1(h), atol=1e-6, rtol=1e-6)
    assert all(e.group_by_length for e in m.modules() if isinstance(e, Encoder))  # restored
