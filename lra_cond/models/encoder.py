"""Pre-LayerNorm Transformer encoder and classifier for LRA (reference hyper-parameters)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lra_cond.errors import UserError
from lra_cond.models.attention import build_attention
from lra_cond.models.dropout import Dropout
from lra_cond.models.length_groups import length_groups


@dataclass
class EncoderConfig:
    """The encoder's shape; the defaults are the reference architecture (and ``LraModel``'s)."""

    vocab_size: int
    max_len: int
    num_classes: int
    dim: int = 64
    depth: int = 2
    num_heads: int = 2
    head_dim: int | None = None
    mlp_dim: int = 128
    dropout: float = 0.1
    attention: str = "softmax"
    attention_options: dict[str, Any] = field(default_factory=dict)
    pool_length: int | None = None  # None: mean over real tokens; N: their sum over N (see masked_mean)


def padding_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """True at padded positions, as ``torch.nn.MultiheadAttention``'s key_padding_mask."""
    return torch.arange(seq_len, device=lengths.device)[None, :] >= lengths[:, None]


def masked_mean(h: torch.Tensor, mask: torch.Tensor, pool_length: int | None = None) -> torch.Tensor:
    """Mean over real tokens only; with ``pool_length`` N, their sum over N instead: the reference's
    mean over a batch padded to N (padding zeroed but counted), which scales an example by L / N."""
    keep = (~mask).unsqueeze(-1).to(h.dtype)
    count = keep.sum(1).clamp_min(1.0) if pool_length is None else float(pool_length)
    return (h * keep).sum(1) / count


class Block(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        # attention_args may override the encoder-wide head_dim/dropout for the attention layer.
        options = {"head_dim": cfg.head_dim, "dropout": cfg.dropout, **cfg.attention_options}
        self.attn = build_attention(cfg.attention, cfg.dim, cfg.num_heads, **options)
        self.drop = Dropout(cfg.dropout)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_dim),
            nn.GELU(),
            Dropout(cfg.dropout),
            nn.Linear(cfg.mlp_dim, cfg.dim),
            Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask=mask))
        return x + self.mlp(self.norm2(x))


class Encoder(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, masked mean pool.

    A batch runs as groups of similar length, each padded only to its own longest (``length_groups``),
    unless ``group_by_length`` is off (``padded_batches``): one sub-batch padded to the batch's longest,
    as the reference computes it. Per example, both give the same output.
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.dim)
        self.drop = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim)
        self.group_by_length = True
        problem = self.blocks[0].attn.max_len_problem(cfg.max_len) if cfg.depth else None
        if problem:
            raise UserError(f"{cfg.attention} attention: {problem}")

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        if n > self.cfg.max_len:
            raise ValueError(f"sequence length {n} exceeds max_len {self.cfg.max_len}")
        if not self.group_by_length or input_ids.shape[0] < 2:
            return self.encode(input_ids, lengths)
        groups = length_groups(lengths.clamp(max=n).tolist())
        if len(groups) == 1:
            return self.encode(input_ids, lengths)
        pooled = []
        for rows in groups:
            index = torch.tensor(rows, device=input_ids.device)
            group_lengths = lengths[index]
            longest = max(1, int(group_lengths.max()))
            pooled.append(self.encode(input_ids[index, :longest], group_lengths))
        position = torch.tensor([i for rows in groups for i in rows], device=input_ids.device)
        return torch.cat(pooled)[torch.argsort(position)]

    def encode(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The pooled encoding of one padded sub-batch."""
        n = input_ids.shape[1]
        mask = padding_mask(lengths, n)
        pos = torch.arange(n, device=input_ids.device)
        x = self.drop(self.token_emb(input_ids) + self.pos_emb(pos)[None])
        for block in self.blocks:
            x = block(x, mask)
        return masked_mean(self.norm(x), mask, self.cfg.pool_length)


@contextmanager
def padded_batches(model: nn.Module) -> Iterator[nn.Module]:
    """Run every encoder in ``model`` on its whole batch padded to the longest sequence (what the
    condition-number probe captures its layer inputs from, and the reference computes)."""
    encoders = [m for m in model.modules() if isinstance(m, Encoder)]
    saved = [m.group_by_length for m in encoders]
    for m in encoders:
        m.group_by_length = False
    try:
        yield model
    finally:
        for m, s in zip(encoders, saved):
            m.group_by_length = s


class Classifier(nn.Module):
    """Encoder + MLP head; ``forward(input_ids, lengths) -> logits``."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.encoder = Encoder(cfg)
        self.head = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_dim), nn.ReLU(), nn.Linear(cfg.mlp_dim, cfg.num_classes)
        )

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids, lengths))


class PairClassifier(nn.Module):
    """Dual encoder with shared weights for document matching (retrieval).

    Both sequences go through the same encoder; the head sees ``[e1, e2, e1*e2, e1-e2]`` (the LRA
    matching head) through Linear(4*dim, mlp_dim), ReLU, Linear(mlp_dim, classes).
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.encoder = Encoder(cfg)
        self.head = nn.Sequential(
            nn.Linear(4 * cfg.dim, cfg.mlp_dim), nn.ReLU(), nn.Linear(cfg.mlp_dim, cfg.num_classes)
        )

    @staticmethod
    def combine(e1: torch.Tensor, e2: torch.Tensor) -> torch.Tensor:
        return torch.cat([e1, e2, e1 * e2, e1 - e2], dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        input_ids2: torch.Tensor,
        lengths2: torch.Tensor,
    ) -> torch.Tensor:
        # Two passes rather than one stacked batch: each side is padded only to its own longest.
        e1 = self.encoder(input_ids, lengths)
        e2 = self.encoder(input_ids2, lengths2)
        return self.head(self.combine(e1, e2))
