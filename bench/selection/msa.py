"""MiniMax-M3's MSA block selection (llama.cpp#24908, docs/DESIGN.md "Round 5", [R5 5/6]).

Per query row and KV group, over key blocks of the case's block_size: the indexer score of a key is the summed
q . k of the group's query heads, and a block's score is the max over its keys (max-pooled, where MoBA and NSA
pool the keys first and score their mean). The row's own block and the block before it are forced in; then the
`budget` blocks of largest score, the forced ones included. Only keys the base pattern allows the row count
toward a block's max (a partly visible block is scored on its visible keys).

The sum over a group's heads is one q: sum_h q_h . k = (sum_h q_h) . k, so the scores are one (rows x keys)
product per KV group. Cost: O(B Hkv Nq N D) over each chunk's allowed span (a dense q.k of one head per group),
a max over each block, a top-k over N / block scores per row.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from bench.selection.registry import register_selector
from bench.selection.units import SCORE_ELEMENTS, base_pattern, per_row_topk


@register_selector("msa", q_unit="row", kv_unit="block", shared="kv_group", takes="budget")
def msa(q: Tensor, k: Tensor, case: Any) -> Tensor:
    """MSA: per row and KV group, the `budget` blocks of largest max-pooled summed q . k, own and previous forced."""
    b, h, q_len, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    bs = case.block_size
    summed = q.float().view(b, hkv, h // hkv, q_len, d).sum(dim=2)  # (B, Hkv, Nq, D): one query per KV group
    keys = k.float()
    pattern = base_pattern(case)

    def block_max(start: int, stop: int, lo: int, hi: int, allowed: Tensor) -> Tensor:
        first, last = lo * bs, min(hi * bs, n)
        out = torch.empty(b, hkv, stop - start, hi - lo, dtype=torch.float32, device=q.device)
        # key-level scores are `bs` times the block-level ones: rows again in slices that keep them bounded
        step = max(1, SCORE_ELEMENTS // max(1, b * hkv * (last - first)))
        for s0 in range(start, stop, step):
            s1 = min(s0 + step, stop)
            scores = summed[:, :, s0:s1] @ keys[:, :, first:last].transpose(-1, -2)  # (B, Hkv, rows, keys)
            rows = torch.arange(s0, s1, device=q.device)
            seen = pattern.mask(rows[:, None], torch.arange(first, last, device=q.device)[None, :])
            scores.masked_fill_(~seen.to(q.device), -math.inf)
            pad = (hi - lo) * bs - (last - first)
            scores = torch.nn.functional.pad(scores, (0, pad), value=-math.inf)
            pooled = scores.view(b, hkv, s1 - s0, hi - lo, bs).amax(dim=-1)
            # a block the row sees none of is dropped by `allowed` in pick_topk; a finite stand-in keeps the
            # forced bias finite there
            out[:, :, s0 - start : s1 - start] = pooled.nan_to_num_(neginf=-1e30)
        return out

    def own_and_previous(positions: Tensor, blocks: Tensor) -> Tensor:
        own = (positions // bs)[:, None]
        return 2 * (blocks[None, :] == own) + (blocks[None, :] == own - 1)

    return per_row_topk(q, case, bs, hkv, block_max, own_and_previous)
