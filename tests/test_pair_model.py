"""Retrieval dual encoder: shared weights and the [e1, e2, e1*e2, e1-e2] head, checked by hand."""

from __future__ import annotations

import torch

from lra_cond.models import PairClassifier
from lra_cond.models.encoder import Encoder, EncoderConfig
from lra_cond.training.module import LraModel


def small_cfg() -> EncoderConfig:
    return EncoderConfig(vocab_size=257, max_len=16, num_classes=2, dim=8, depth=1, num_heads=2, mlp_dim=12)


def batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids1, ids2 = torch.randint(1, 257, (3, 16), generator=g), torch.randint(1, 257, (3, 11), generator=g)
    len1, len2 = torch.tensor([16, 5, 9]), torch.tensor([11, 11, 2])
    return ids1, len1, ids2, len2


def test_head_sees_e1_e2_product_difference() -> None:
    torch.manual_seed(0)
    net = PairClassifier(small_cfg()).eval().double()
    ids1, len1, ids2, len2 = batch(1)
    with torch.no_grad():
        out = net(ids1, len1, ids2, len2)
        e1, e2 = net.encoder(ids1, len1), net.encoder(ids2, len2)  # the one shared encoder
        w1, b1 = net.head[0].weight, net.head[0].bias
        w2, b2 = net.head[2].weight, net.head[2].bias
        # Manual head: blocks of W1's columns act on e1, e2, e1*e2, e1-e2 in that order.
        d = e1.shape[1]
        blocks = [w1[:, i * d : (i + 1) * d] for i in range(4)]
        hidden = e1 @ blocks[0].T + e2 @ blocks[1].T + (e1 * e2) @ blocks[2].T + (e1 - e2) @ blocks[3].T + b1
        manual = torch.clamp(hidden, min=0) @ w2.T + b2
    assert w1.shape == (12, 32) and w2.shape == (2, 12)
    torch.testing.assert_close(out, manual, rtol=1e-12, atol=1e-12)
    # Order matters (e1 - e2 is antisymmetric): swapping the documents changes the logits.
    assert not torch.allclose(out, net(ids2, len2, ids1, len1))


def test_encoder_is_shared_and_padding_is_masked() -> None:
    torch.manual_seed(0)
    net = PairClassifier(small_cfg()).eval()
    single = sum(p.numel() for p in Encoder(small_cfg()).parameters())
    assert sum(p.numel() for p in net.encoder.parameters()) == single
    assert not any(name.startswith("encoder2") for name, _ in net.named_parameters())
    ids1, len1, ids2, len2 = batch(2)
    with torch.no_grad():
        out = net(ids1, len1, ids2, len2)
        padded = torch.cat([ids2, torch.randint(1, 257, (3, 4))], dim=1)  # junk beyond length2
        torch.testing.assert_close(net(ids1, len1, padded, len2), out)


def test_lra_model_uses_pair_classifier_for_retrieval() -> None:
    model = LraModel(task="retrieval", dim=8, depth=1, num_heads=2, mlp_dim=12, dropout=0.0).eval()
    assert isinstance(model.net, PairClassifier)
    assert not isinstance(LraModel(task="text", dim=8, depth=1, mlp_dim=12).net, PairClassifier)
    ids1, len1, ids2, len2 = batch(3)
    with torch.no_grad():
        logits = model({"input_ids": ids1, "length": len1, "input_ids2": ids2, "length2": len2})
        torch.testing.assert_close(logits, model.net(ids1, len1, ids2, len2))
    assert logits.shape == (3, 2)
