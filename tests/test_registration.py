"""A new attention family and a new init scheme are one definition each, through the public
registration API alone (defined here, in this file, and nowhere else), and ``fit`` trains with both
chosen by name."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lra_cond.errors import UserError
from lra_cond.init import INITS, apply_init
from lra_cond.models.attention import ATTENTIONS, Attention, Option, attention_layers, build_attention
from lra_cond.models.attention.base import masked_softmax
from tests.conftest import TINY_FIT, run_cli_in_process

FAMILY, SCHEME = "test-tempered", "test-constant-qk"


@pytest.fixture
def registered():
    """The throwaway family and scheme, registered for one test and removed after it (the registries
    are global: other tests list their names)."""
    seen: dict = {"temperatures": [], "first_q": {}}

    class TemperedAttention(Attention, name=FAMILY):
        """softmax(Q K^T / temperature) V per head."""

        options = {"temperature": Option(2.0, float, positive=True)}

        def kernel(self, q, k, v, key_padding_mask):  # noqa: ANN001, ANN201
            seen["temperatures"].append(self.temperature)
            seen["first_q"].setdefault(id(self), self.q_proj.weight.detach().clone())
            return masked_softmax(q @ k.transpose(-1, -2) / self.temperature, key_padding_mask) @ v

        kernel_explicit = kernel

    @INITS.register(SCHEME)
    @torch.no_grad()
    def constant_qk(model: nn.Module, value: float = 0.05) -> None:
        """W_Q = value, W_K = -value everywhere; every other parameter keeps its construction."""
        for _, layer in attention_layers(model):
            layer.q_proj.weight.fill_(value)
            layer.k_proj.weight.fill_(-value)

    try:
        yield seen
    finally:
        ATTENTIONS.remove(FAMILY)
        INITS.remove(SCHEME)
    assert FAMILY not in ATTENTIONS and SCHEME not in INITS


def test_options_and_parameters_are_declared_once_and_checked(registered):
    layer = build_attention(FAMILY, dim=8, num_heads=2, temperature=3)
    assert layer.temperature == 3.0 and isinstance(layer.temperature, float)
    with pytest.raises(UserError, match="temperature must be a positive number"):
        build_attention(FAMILY, dim=8, num_heads=2, temperature=-1.0)
    with pytest.raises(UserError, match="valid options: head_dim, dropout, bias, temperature"):
        build_attention(FAMILY, dim=8, num_heads=2, temprature=1.0)
    apply_init(layer, SCHEME, value=0.5)
    assert torch.equal(layer.q_proj.weight, torch.full_like(layer.q_proj.weight, 0.5))
    with pytest.raises(UserError, match="has no parameter 'scale'; valid parameters: value=0.05"):
        apply_init(layer, SCHEME, scale=1.0)


def test_fit_trains_with_a_family_and_a_scheme_defined_in_a_test(
    registered, tiny_listops, tmp_path, monkeypatch, capfd
):
    args = [
        *("fit", "--task", "listops", "--attention", FAMILY, "--init", SCHEME),
        *("--model.attention_args", '{"temperature": 3.0}', "--model.init_args", '{"value": 0.03}'),
        *("--data.data_dir", str(tiny_listops), "--run_root", "runs"),
        *TINY_FIT,
    ]
    proc = run_cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # The family's kernel ran (its option as given), from weights exactly as the scheme set them.
    assert registered["temperatures"] and set(registered["temperatures"]) == {3.0}
    firsts = list(registered["first_q"].values())
    assert len(firsts) == 2  # one per layer (depth 2)
    for q in firsts:
        assert torch.equal(q, torch.full_like(q, 0.03))

    run = tmp_path / "runs" / "listops-tiny" / FAMILY / SCHEME / "seed0"
    metrics = json.loads((run / "metrics.json").read_text())
    assert 0.0 <= metrics["test_acc"] <= 1.0
    config = (run / "config.yaml").read_text()
    assert f"attention: {FAMILY}" in config and f"init: {SCHEME}" in config
