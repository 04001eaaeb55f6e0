"""XAttention's antidiagonal block scores (Xu et al. 2025, "XAttention: Block Sparse Attention with Antidiagonal
Scoring"; mit-han-lab/x-attention, xattn/src/Xattention.py `xattn_estimate`, the torch path, and
xattn/src/utils.py `find_blocks_chunked`).

Per query block and head, over key blocks (both of the case's block_size; the paper's 128):
- strided antidiagonal scores: in every stride x stride tile, the sum over the antidiagonal of q . k, i.e. row
  r * S + S - 1 - i against key s * S + i for i < S (the reference's "inverse" reshape: queries taken in reverse
  order within a stride, keys in order, concatenated into S * D wide vectors), scaled by 1 / (sqrt(D) S);
- a softmax over the key tiles of each strided query row (the tiles the base pattern allows: at stride
  granularity, as the reference's causal mask is), summed over each (query block, key block): the block scores;
- the first key block and the diagonal block (the key block holding the query block's last position) kept, as
  `find_blocks_chunked` does under causal, then the other blocks in decreasing score while the score kept so far
  is short of `threshold` of the query block's total: the smallest set reaching it. Listed in that order.

The stride is 8 (the paper's S for its language-model results; it also runs 16), or gcd(block_size, 8) where the
block is not a multiple of 8, so that tiles tile the blocks. Keys and queries past the end are zero (the
reference's padding), so a partial tile scores only its real pairs.

Cost: the strided scores O(B H (Nq / S) (N / S) S D) = 1/S of dense attention's q.k, over each chunk's allowed
span, and their softmax O(B H Nq N / S^2); a sort of N / block scores per query block.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from bench.selection.registry import register_selector
from bench.selection.units import allowed_on, base_pattern, grouped_scores, key_span, row_chunks

STRIDE = 8  # the paper's S for its language-model results


def tile_stride(block_size: int) -> int:
    """The antidiagonal stride: STRIDE, or the largest divisor of it that divides the block (1: every pair)."""
    return math.gcd(block_size, STRIDE)


def strided(x: Tensor, stride: int, reverse: bool) -> Tensor:
    """(B, Hx, ceil(L / S), S * D): each run of S rows concatenated, in reverse order within the run if `reverse`
    (so that reversed queries against keys in order give the antidiagonal); zero rows pad the last run."""
    b, hx, length, d = x.shape
    runs = math.ceil(length / stride)
    x = torch.nn.functional.pad(x.float(), (0, 0, 0, runs * stride - length)).view(b, hx, runs, stride, d)
    if reverse:
        x = x.flip(3)
    return x.reshape(b, hx, runs, stride * d)


@register_selector("xattention", q_unit="block", kv_unit="block", shared="head", takes="threshold")
def xattention(q: Tensor, k: Tensor, case: Any) -> Tensor:
    """XAttention: per query block and head, the fewest key blocks whose antidiagonal score reaches `threshold`."""
    if case.threshold is None:
        raise ValueError("xattention keeps the key blocks reaching a share of the block scores: set `threshold` "
                         "in (0, 1]")
    b, h, q_len, d = q.shape
    bs = case.block_size
    stride = tile_stride(bs)
    per_block = bs // stride  # strided rows (or key tiles) per block
    pattern = base_pattern(case)
    blocks = allowed_on(pattern, bs, bs, q.device)  # (QB, KB)
    tiles = allowed_on(pattern, stride, stride, q.device)  # (Nq / S, N / S)
    q_blocks, kv_blocks = blocks.shape
    qs = strided(q, stride, reverse=True)  # (B, H, Nq / S, S D)
    ks = strided(k, stride, reverse=False)  # (B, Hkv, N / S, S D)
    kv_tiles = ks.shape[2]
    offset = pattern.seq_len - pattern.q_len
    scale = 1.0 / (math.sqrt(d) * stride)
    threshold = float(case.threshold)

    out = torch.full((b, h, q_blocks, kv_blocks), -1, dtype=torch.int32, device=q.device)
    for start, stop in row_chunks(q_blocks, b * h * per_block * kv_tiles):
        lo, hi = key_span(blocks[start:stop])
        if hi == lo:
            continue
        t_lo, t_hi = lo * per_block, min(hi * per_block, kv_tiles)  # key tiles of blocks [lo, hi)
        rows = slice(start * per_block, min(stop * per_block, qs.shape[2]))
        scores = grouped_scores(qs[:, :, rows], ks[:, :, t_lo:t_hi]) * scale  # (B, H, tile rows, tiles)
        seen = tiles[rows, t_lo:t_hi]
        probs = torch.softmax(scores.masked_fill(~seen, -math.inf), dim=-1).nan_to_num_(0.0)
        # pad to whole blocks both ways, then sum each (query block, key block)
        count = stop - start
        probs = torch.nn.functional.pad(probs, (0, (hi - lo) * per_block - (t_hi - t_lo),
                                                0, count * per_block - probs.shape[2]))
        mass = probs.view(b, h, count, per_block, hi - lo, per_block).sum(dim=(3, 5))  # (B, H, blocks, blocks)

        allowed = blocks[start:stop, lo:hi]
        last = torch.clamp(torch.arange(start, stop, device=q.device) * bs + bs - 1, max=q_len - 1) + offset
        key_blocks = torch.arange(lo, hi, device=q.device)
        kept = allowed & ((key_blocks[None, :] == 0) | (key_blocks[None, :] == (last // bs)[:, None]))
        # forced blocks first, then allowed ones by score; the rest last
        order_key = torch.where(kept, math.inf, torch.where(allowed, mass, -1.0))
        order = order_key.argsort(dim=-1, descending=True, stable=True)
        ordered = torch.where(allowed, mass, 0.0).gather(-1, order)
        # keep a block while the score before it is short of threshold * total: the score from it on (a sum from
        # the small end, exact at threshold 1: > 0 iff the block's own score is) exceeds (1 - threshold) * total
        from_here = ordered.flip(-1).cumsum(dim=-1).flip(-1)
        keep = (from_here > (1.0 - threshold) * from_here[..., :1]) | kept.expand_as(mass).gather(-1, order)
        keep &= allowed.expand_as(mass).gather(-1, order)
        out[:, :, start:stop, : hi - lo] = torch.where(keep, order + lo, -1).to(torch.int32)
    k_max = int((out >= 0).sum(dim=-1).max()) if out.numel() else 0
    return out[..., :k_max].contiguous()
