"""Fixed probe batches and the inputs each attention layer sees on them (captured with hooks)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lra_cond.data.documents import LENGTH, is_ids, length_key
from lra_cond.models.attention.base import Attention, attention_layers
from lra_cond.models.encoder import padded_batches


def take_probe_batch(batches: Iterable[dict[str, torch.Tensor]], tokens: int) -> dict[str, torch.Tensor]:
    """The first examples of ``batches`` (in loader order), each cropped to ``tokens`` tokens, as many
    as bring their real tokens closest to ``tokens`` (an example that would overshoot it by more
    than the probe falls short without it is left out; a tie takes it). A fixed, deterministic
    probe batch.

    The attention layers see every document of an example (a pair task's two, as two sequences),
    so all of them count and share the crop: each of a pair's documents is cropped to half of
    ``tokens`` (rounded up). (Counting the first document alone, a Retrieval probe of 256 tokens
    held 512 at full length and 707 on the tiny split.) Why closest rather than at least: a probe's
    cost grows with its sequences as well as its tokens (linear and Nystrom attention most), and
    "at least" took a second whole example to cover the last few tokens (tiny Text: 254 + 256
    tokens where 254 is closer; tiny Retrieval: four documents where two hold 250)."""
    rows: list[dict[str, torch.Tensor]] = []
    total = 0
    for batch in batches:
        documents = [k for k in batch if is_ids(k)]
        crop = -(-tokens // len(documents))  # one long example reaches ``tokens``
        for i in range(len(batch[LENGTH])):
            row = {k: v[i : i + 1] for k, v in batch.items()}
            added = 0
            for key in documents:
                length = row[length_key(key)].clamp(max=crop)
                row[key] = row[key][:, : int(length.max())]
                row[length_key(key)] = length
                added += int(length.sum())
            if rows and total + added - tokens > tokens - total:
                return _stack(rows)
            rows.append(row)
            total += added
            if total >= tokens:
                return _stack(rows)
    if not rows:
        raise ValueError("the probe loader yielded no examples")
    return _stack(rows)


def _stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for key in rows[0]:
        if is_ids(key):
            n = max(r[key].shape[1] for r in rows)
            out[key] = torch.cat([nn.functional.pad(r[key], (0, n - r[key].shape[1])) for r in rows])
        else:
            out[key] = torch.cat([r[key] for r in rows])
    return out


def float64_copy(module: nn.Module) -> nn.Module:
    """An eval-mode float64 deep copy (a LightningModule's trainer is shared, not copied)."""
    memo: dict[int, Any] = {}
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        memo[id(trainer)] = None
    return copy.deepcopy(module, memo).double().eval()


def capture_layer_inputs(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> list[tuple[Attention, torch.Tensor, torch.Tensor | None]]:
    """Run ``model(batch)`` and return, per attention layer in order, (layer, x, key_padding_mask).

    A layer called more than once (the two documents of a pair task) gets its inputs stacked along
    the batch axis, padded to a common length and masked. The model runs its batch whole, padded to
    the longest sequence (``padded_batches``), so the layers see the probe's sequences in its order.
    """
    layers = [m for _, m in attention_layers(model)]
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {id(m): [] for m in layers}

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0]
        mask = kwargs.get("key_padding_mask", args[1] if len(args) > 1 else None)
        if mask is None:
            mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        seen[id(module)].append((x.detach(), mask.detach()))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in layers]
    try:
        with torch.no_grad(), padded_batches(model):
            model(batch)
    finally:
        for h in handles:
            h.remove()
    out = []
    for m in layers:
        calls = seen[id(m)]
        if not calls:
            continue
        n = max(x.shape[1] for x, _ in calls)
        xs = torch.cat([nn.functional.pad(x, (0, 0, 0, n - x.shape[1])) for x, _ in calls])
        masks = torch.cat([nn.functional.pad(k, (0, n - k.shape[1]), value=True) for _, k in calls])
        out.append((m, xs, masks))
    return out
