"""Softmax attention with dropout on the probabilities, computed in query blocks (CPU training path).

Why: torch's CPU flash kernel refuses ``dropout_p > 0``, so ``F.scaled_dot_product_attention`` falls
back to its math path, which materialises several (batch, heads, N, N) tensors (scores, probabilities,
dropout mask, dropped probabilities) and is memory-bound. Here each sample's queries are processed in
blocks against that sample's real keys only (padded keys are dropped rather than masked: same result,
less work). Below a memory budget the forward keeps each block's probabilities and dropout mask
for the backward; above it the backward recomputes a block's probabilities and regenerates its
dropout mask from a per-block seed, as GPU flash attention does, so nothing N x N is kept between
forward and backward.

In self-attention (``padded_queries``) a sample's padded query rows are skipped too: no real token
reads them (keys and values stop at the real length), so their rows stay zero and receive no
gradient. A block that holds real rows still draws its mask for all of its rows, and each block
draws from its own seeded generator, so every real row keeps the mask it has with the padded rows
computed.

Result: ``dropout(softmax(Q K^T / sqrt(d), padded keys excluded)) V`` with inverted dropout, its
masks drawn as the encoder's dropout draws them (``dropout.keep_mask``: 16-bit draws, rate ``p``
rounded to a multiple of 2**-16, unbiased). ``block_keep`` regenerates the masks so tests can check
the kernel against the formula exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from lra_cond.models.dropout import keep_mask, quantized_rate

# Scores of one block hold about this many numbers (8 MiB in float32: fits the last-level cache, and
# few blocks mean few thread-pool barriers, which matters when cores are shared).
BLOCK_ELEMENTS = 1 << 21
_MASK64 = (1 << 64) - 1
# A call whose scores number at most this many keeps its probabilities and keep-masks for the
# backward (5 bytes a score: 640 MiB here; a ListOps batch of 32 has ~80M per layer) instead of
# recomputing them there (see docs/benchmarks.md for what each saves); longer ones recompute.
SAVED_SCORES = 1 << 27


def block_rows(heads: int, n_keys: int) -> int:
    """Query rows per block so that one block of scores holds about ``BLOCK_ELEMENTS`` numbers."""
    return max(16, min(1024, BLOCK_ELEMENTS // max(1, heads * n_keys)))


def _block_seed(seed: int, index: int) -> int:
    """Independent 32-bit seed per block (splitmix64 finaliser; torch's mt19937 keeps 32 bits)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def block_keep(
    seed: int, index: int, shape: tuple[int, ...], p: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Float mask of ``shape``, 1 = kept, 0 = dropped (rate ``quantized_rate(p)``), for block ``index``:
    the same mask each time it is asked for, so the backward regenerates the forward's."""
    return keep_mask(shape, p, dtype, torch.Generator().manual_seed(_block_seed(seed, index)))


def _spans(n: int, rows: int) -> list[tuple[int, int]]:
    return [(s, min(n, s + rows)) for s in range(0, n, rows)]


class _BlockwiseAttention(torch.autograd.Function):
    """Blocks are visited as (sample b, query span); block index = b * spans + span number.

    When all of a call's scores number at most ``saved`` (``SAVED_SCORES``), the forward keeps each
    block's probabilities and its keep-mask (as booleans) for the backward, which then skips
    recomputing them: the same numbers, for 5 bytes a score of memory."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, p, seed, rows, scale, saved, padded_queries):  # noqa: ANN001, ANN205
        keep_scale = 1.0 / (1.0 - quantized_rate(p))
        qs = (q * scale).contiguous()  # fold the score scale into q (N x d) instead of the scores
        k = k.contiguous()
        vs = (v * keep_scale).contiguous() if p > 0 else v.contiguous()  # fold 1/(1-p) into v
        out = torch.zeros_like(qs)
        spans = _spans(q.shape[-2], rows)
        blocks: dict[int, tuple[torch.Tensor, torch.Tensor | None]] | None = None  # by block index
        if q.shape[1] * q.shape[-2] * sum(lengths) <= saved:
            blocks = {}
        for b, n_real in enumerate(lengths):
            kt, vb = k[b, :, :n_real].transpose(-1, -2), vs[b, :, :n_real]
            for index, s, e, real in _row_blocks(b, spans, n_real, padded_queries):
                probs = torch.softmax(torch.matmul(qs[b, :, s : s + real], kt), dim=-1)
                keep = _keep(seed, index, e - s, real, probs, p)
                if blocks is not None:
                    blocks[index] = (probs, None if keep is None else keep.bool())
                    kept = probs if keep is None else probs * keep
                else:
                    kept = probs if keep is None else probs.mul_(keep)
                out[b, :, s : s + real] = torch.matmul(kept, vb)
        ctx.save_for_backward(qs, k, vs, out)
        ctx.lengths, ctx.p, ctx.seed, ctx.rows = lengths, p, seed, rows
        ctx.padded_queries = padded_queries
        ctx.scale, ctx.keep_scale, ctx.blocks = scale, keep_scale, blocks
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        qs, k, vs, out = ctx.saved_tensors
        p, blocks = ctx.p, ctx.blocks
        ctx.blocks = None  # freed as soon as the backward is done with them
        grad_out = grad_out.contiguous()
        # rowsum(dP * P) equals rowsum(dO * O) (dropout included): no N x N reduction needed.
        delta = (grad_out * out).sum(-1, keepdim=True)
        dqs = torch.zeros_like(qs)
        dk = torch.zeros_like(k)
        dvs = torch.zeros_like(vs)
        spans = _spans(qs.shape[-2], ctx.rows)
        for b, n_real in enumerate(ctx.lengths):
            kb, vb = k[b, :, :n_real], vs[b, :, :n_real]
            kt, vt = kb.transpose(-1, -2), vb.transpose(-1, -2)
            # Key-side gradients accumulate transposed, (heads, d, keys): a faster matmul layout.
            dkt = qs.new_zeros(qs.shape[1], qs.shape[-1], n_real)
            dvt = vs.new_zeros(vs.shape[1], vs.shape[-1], n_real)
            for index, s, e, real in _row_blocks(b, spans, n_real, ctx.padded_queries):
                qb, gb = qs[b, :, s : s + real], grad_out[b, :, s : s + real]
                if blocks is not None:
                    probs, keep = blocks[index]
                else:
                    probs = torch.softmax(torch.matmul(qb, kt), dim=-1)
                    keep = _keep(ctx.seed, index, e - s, real, probs, p)
                kept = probs if keep is None else probs * keep  # the dropped-out probabilities
                dvt.baddbmm_(gb.transpose(-1, -2), kept)
                # dS = P (M dO V^T - delta) = kept dO V^T - P delta: the mask enters once, through kept
                dscores = (
                    torch.matmul(gb, vt).mul_(kept).addcmul_(probs, delta[b, :, s : s + real], value=-1.0)
                )
                dqs[b, :, s : s + real] = torch.matmul(dscores, kb)
                dkt.baddbmm_(qb.transpose(-1, -2), dscores)
            dk[b, :, :n_real] = dkt.transpose(-1, -2)
            dvs[b, :, :n_real] = dvt.transpose(-1, -2)
        dq = dqs.mul_(ctx.scale)
        dv = dvs.mul_(ctx.keep_scale) if p > 0 else dvs
        return dq, dk, dv, None, None, None, None, None, None, None


def _row_blocks(
    b: int, spans: list[tuple[int, int]], n_real: int, padded_queries: bool
) -> Iterator[tuple[int, int, int, int]]:
    """Sample b's blocks of query rows that are computed, as (block index, start, end, rows
    computed): every block whole, or with ``padded_queries`` those holding real rows, cut at the
    sample's real length."""
    for i, (start, end) in enumerate(spans):
        real = min(end, n_real) - start if padded_queries else end - start
        if real <= 0:
            return
        yield b * len(spans) + i, start, end, real


def _keep(seed: int, index: int, rows: int, real: int, probs: torch.Tensor, p: float) -> torch.Tensor | None:
    """Block ``index``'s keep-mask (``rows`` query rows) for its first ``real`` rows, None without dropout."""
    if p == 0:
        return None
    return block_keep(seed, index, (probs.shape[0], rows, probs.shape[-1]), p, probs.dtype)[:, :real]


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int] | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    rows: int | None = None,
    scale: float | None = None,
    saved: int = SAVED_SCORES,
    padded_queries: bool = False,
) -> torch.Tensor:
    """``dropout(softmax(q k^T * scale)) v`` for q, k, v of shape (B, H, N, d), on CPU.

    ``lengths[b]``: sample b's keys at positions >= lengths[b] are padding (excluded); default all
    real. ``padded_queries``: its queries there are padding too (self-attention): their rows are
    not computed and come back zero. The dropout seed is drawn from torch's global generator unless
    given, so runs are reproducible under ``torch.manual_seed``. ``scale`` defaults to 1/sqrt(d).
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    n_keys = k.shape[-2]
    lengths = [n_keys] * q.shape[0] if lengths is None else [max(1, min(n_keys, int(n))) for n in lengths]
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), device="cpu").item()) if dropout_p > 0 else 0
    rows = rows or block_rows(q.shape[1], n_keys)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    device = q.device.type
    if torch.is_autocast_enabled(device):
        # As autocast does for SDPA: one low-precision dtype for q, k, v (a family may hand over
        # float32 q, k next to bf16 v), then forward and backward both compute in that dtype.
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast(device, enabled=False):
        return _BlockwiseAttention.apply(
            q, k, v, lengths, float(dropout_p), seed, rows, scale, saved, padded_queries
        )


def prefix_lengths(key_padding_mask: torch.Tensor) -> list[int] | None:
    """Per-sample real lengths if every row of the mask pads a suffix (as the encoder's do), else None."""
    n = key_padding_mask.shape[-1]
    lengths = (~key_padding_mask).sum(1)
    if not torch.equal(key_padding_mask, torch.arange(n, device=lengths.device)[None, :] >= lengths[:, None]):
        return None
    return lengths.tolist()
