"""Ablations of the conditioned scheme: each keeps one of its ingredients or pushes one further.

  * ``conditioned-qk``: only W_Q/W_K per-head semi-orthogonal; W_V default.
  * ``conditioned-v``: only W_V = v_scale * rectangular identity; W_Q/W_K default.
  * ``identity-all``: W_Q = W_K = W_V = rectangular identity. Head h then scores with
    x[:, h*d_h:(h+1)*d_h] against itself, which the paper argues skews the logits toward the diagonal.
  * ``orthogonal-all``: W_Q, W_K and W_V all per-head semi-orthogonal (independent draws).
W_O, biases and all other parameters stay at the default init in every ablation.
"""

from __future__ import annotations

import torch
from torch import nn

from lra_cond.init.base import INITS
from lra_cond.init.conditioned import condition_layer, per_head_semi_orthogonal_, rectangular_identity_
from lra_cond.init.default import reset_defaults
from lra_cond.models.attention.base import attention_layers


@INITS.register("conditioned-qk")
@torch.no_grad()
def conditioned_qk_init(model: nn.Module) -> None:
    """Only the Q/K half of conditioned: per-head semi-orthogonal W_Q, W_K."""
    reset_defaults(model)
    for _, layer in attention_layers(model):
        condition_layer(layer, qk=True, v=False)


@INITS.register("conditioned-v")
@torch.no_grad()
def conditioned_v_init(model: nn.Module, v_scale: float = 1.0) -> None:
    """Only the V half of conditioned: W_V = v_scale * rectangular identity."""
    reset_defaults(model)
    for _, layer in attention_layers(model):
        condition_layer(layer, v_scale, qk=False, v=True)


@INITS.register("identity-all")
@torch.no_grad()
def identity_all_init(model: nn.Module, v_scale: float = 1.0) -> None:
    """W_Q = W_K = rectangular identity, W_V = v_scale * rectangular identity."""
    reset_defaults(model)
    for _, layer in attention_layers(model):
        rectangular_identity_(layer.q_proj.weight)
        rectangular_identity_(layer.k_proj.weight)
        rectangular_identity_(layer.v_proj.weight, v_scale)


@INITS.register("orthogonal-all")
@torch.no_grad()
def orthogonal_all_init(model: nn.Module) -> None:
    """W_Q, W_K, W_V each per-head semi-orthogonal, independently drawn."""
    reset_defaults(model)
    for _, layer in attention_layers(model):
        for proj in (layer.q_proj, layer.k_proj, layer.v_proj):
            per_head_semi_orthogonal_(proj.weight, layer.num_heads, layer.head_dim)
