"""Encoder behaviour and the conditioned init, checked against direct computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lra_cond.init import apply_init
from lra_cond.models import Classifier, EncoderConfig
from lra_cond.models.attention import ATTENTIONS
from lra_cond.models.encoder import masked_mean, padding_mask
from lra_cond.training.module import LraModel
from tests.conftest import seeded_loss_and_grads, small_lra_model


def small_model(init: str = "default", seed: int = 0, **kw) -> Classifier:
    torch.manual_seed(seed)
    cfg = EncoderConfig(vocab_size=16, max_len=64, num_classes=10, **kw)
    return apply_init(Classifier(cfg), init).eval()


def test_masked_mean_counts_only_real_tokens():
    h = torch.randn(3, 7, 5)
    lengths = torch.tensor([7, 3, 1])
    got = masked_mean(h, padding_mask(lengths, 7))
    want = torch.stack([h[i, : lengths[i]].mean(0) for i in range(3)])
    torch.testing.assert_close(got, want)


def test_padding_does_not_change_logits():
    model = small_model("conditioned")
    torch.manual_seed(1)
    lengths = torch.tensor([20, 13, 5])
    ids = torch.randint(1, 16, (3, 20))
    ids[padding_mask(lengths, 20)] = 0
    base = model(ids, lengths)
    # More padding, and garbage where padding should be: neither may leak into real outputs.
    padded = torch.cat([ids, torch.zeros(3, 17, dtype=torch.long)], dim=1)
    garbage = padded.clone()
    garbage[padding_mask(lengths, 37)] = torch.randint(1, 16, (int(padding_mask(lengths, 37).sum()),))
    torch.testing.assert_close(model(padded, lengths), base, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(garbage, lengths), base, atol=1e-5, rtol=1e-5)


def test_conditioned_init_identity_v_orthonormal_heads():
    model = small_model("conditioned", dim=64, num_heads=2)
    layers = [b.attn for b in model.encoder.blocks]
    for attn in layers:
        assert torch.equal(attn.v_proj.weight, torch.eye(64))
        d = attn.head_dim
        for proj in (attn.q_proj, attn.k_proj):
            w = proj.weight.double()
            for h in range(attn.num_heads):
                block = w[h * d : (h + 1) * d]
                assert (block @ block.T - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-6
            assert not torch.allclose(w[:d], w[d:], atol=1e-3)  # two heads differ
        assert not torch.allclose(attn.q_proj.weight, attn.k_proj.weight, atol=1e-3)
    assert not torch.allclose(layers[0].q_proj.weight, layers[1].q_proj.weight, atol=1e-3)


def test_conditioned_keeps_out_proj_at_default_and_is_seeded():
    a, b = small_model("conditioned", seed=5), small_model("conditioned", seed=5)
    c = small_model("conditioned", seed=6)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(a.encoder.blocks[0].attn.q_proj.weight, c.encoder.blocks[0].attn.q_proj.weight)
    out = a.encoder.blocks[0].attn.out_proj.weight
    bound = 1 / out.shape[1] ** 0.5  # nn.Linear default: U(-1/sqrt(in), 1/sqrt(in))
    assert out.abs().max() <= bound and out.std() > 0.5 * bound / 3**0.5


def test_default_init_embeddings_std_002():
    model = small_model("default", seed=2)
    std = model.encoder.pos_emb.weight.std().item()
    assert abs(std - 0.02) < 0.003


def test_fused_and_explicit_softmax_paths_agree():
    from lra_cond.models.attention import explicit_math

    model = small_model("conditioned")
    ids = torch.randint(1, 16, (2, 30))
    lengths = torch.tensor([30, 11])
    fused = model(ids, lengths)
    with explicit_math(model):
        explicit = model(ids, lengths)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def test_loss_falls_when_overfitting_a_few_batches(tiny_listops):
    from lra_cond.data import LraDataModule

    dm = LraDataModule("listops", data_dir=str(tiny_listops), preset="tiny", batch_size=16)
    dm.setup()
    batches = [b for _, b in zip(range(2), dm.train_dataloader())]
    torch.manual_seed(0)
    model = LraModel(task="listops", init="conditioned", dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        for batch in batches:
            loss = F.cross_entropy(model(batch), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], (losses[0], losses[-1])


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("family", ATTENTIONS.names())
def test_training_step_creates_its_tensors_on_the_inputs_device(family: str, mode: str) -> None:
    """Forward and backward make no tensor on torch's default device, only on the inputs' (a
    CUDA run breaks on one made on the CPU): under default device ``meta`` such a tensor would meet
    the CPU inputs, so this checks it on a CPU-only machine. Same loss and gradients bit for bit."""
    torch.manual_seed(0)
    model = small_lra_model(family, dim=16, mlp_dim=32, max_len=64)
    model.train(mode == "train")  # train: dropout, and the blockwise CPU kernel for softmax-based families
    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1, 16, (3, 40), generator=gen), "length": torch.tensor([40, 30, 12])}
    batch["input_ids"][1, 30:] = 0
    batch["input_ids"][2, 12:] = 0
    batch["label"] = torch.tensor([0, 3, 7])
    loss, grads = seeded_loss_and_grads(model, batch)
    with torch.device("meta"):
        loss_meta, grads_meta = seeded_loss_and_grads(model, batch)
    assert torch.equal(loss, loss_meta) and loss.device.type == "cpu"
    assert len(grads) == len(grads_meta) and all(torch.equal(a, b) for a, b in zip(grads, grads_meta))


def test_pool_length_divides_the_real_tokens_sum_by_a_fixed_length():
    """The reference's mean over a batch padded to N: an example of L real tokens scaled by L / N."""
    h = torch.randn(3, 7, 5)
    lengths = torch.tensor([7, 3, 1])
    mask = padding_mask(lengths, 7)
    got = masked_mean(h, mask, pool_length=2048)
    torch.testing.assert_close(got, masked_mean(h, mask) * (lengths[:, None] / 2048))
    model = small_model("default")
    model.encoder.cfg.pool_length = 64
    ids = torch.randint(1, 16, (3, 20))
    ids[padding_mask(torch.tensor([20, 13, 5]), 20)] = 0
    scaled = model.encoder(ids, torch.tensor([20, 13, 5]))
    model.encoder.cfg.pool_length = None
    mean = model.encoder(ids, torch.tensor([20, 13, 5]))
    torch.testing.assert_close(scaled, mean * torch.tensor([20, 13, 5])[:, None] / 64)
