"""`blocked` over a selection of tokens (DSA's lightning indexer keeps, per query row, its top tokens): torch ops
over the union of a tile's rows' tokens.

A token selection has no block structure to lean on: the kept tokens of a row are scattered over the whole
context, so reading whole key blocks touches nearly every block at a budget of 1/8, and a dense mask of
(B, H, q_len, N) booleans holds 40 GB at 16K. Here the rows go in tiles of ROW_TILE; per tile and selection head
the tokens some row kept are gathered once (their keys and values, every KV head), the tile's rows are scored
against that union only, each row masked to its own tokens and the base pattern, then softmax and products.
Adjacent queries keep mostly the same tokens (the indexer scores them alike), so the union stays near one row's
count and the work near the selection's density. Autograd differentiates it (fwd_bwd); the selection is not
differentiated.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bench.selection import Selection

ROW_TILE = 32  # query rows per tile: the union of fewer rows' tokens is tighter; more rows make a larger GEMM


def _tile_tokens(kept: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """(union (U,) int64 sorted, member (rows, U) bool) of a tile's kept tokens `kept` (rows, K) int (-1: none)."""
    valid = kept >= 0
    union = torch.unique(kept[valid].to(torch.int64))  # sorted
    if union.numel() == 0:
        return union, torch.zeros(kept.shape[0], 0, dtype=torch.bool, device=kept.device)
    slot = torch.searchsorted(union, kept.clamp(min=0).to(torch.int64))
    member = torch.zeros(kept.shape[0], union.numel() + 1, dtype=torch.bool, device=kept.device)
    member.scatter_(1, torch.where(valid, slot, union.numel()), True)  # -1 lands in the spare column
    return union, member[:, :-1]


def token_attention(selection: Selection, pattern, q: Tensor, k: Tensor, v: Tensor, scale: float
                    ) -> tuple[Tensor, Tensor]:
    """(out (B, H, q_len, D), lse (B, H, q_len) float32) of attention over a token selection (kv_unit 1) under
    the base pattern; module docstring."""
    b, h, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = h // hkv
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    heads_of = selection.head_index(h, hkv)  # (H,) the selection head of each query head
    kv_of = torch.arange(h) // group  # (H,) the KV head of each query head
    unit_of_row = torch.arange(nq) // selection.q_unit
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for start in range(0, nq, ROW_TILE):
        rows = torch.arange(start, min(start + ROW_TILE, nq))
        base = pattern.mask(rows[:, None], torch.arange(n)[None, :])  # (r, N) the base pattern's rows
        tile_out = q.new_zeros(b, h, len(rows), d, dtype=acc)
        tile_lse = torch.full((b, h, len(rows)), -math.inf, dtype=torch.float32, device=q.device)
        for bi in range(b):
            for s in torch.unique(heads_of).tolist():
                heads = (heads_of == s).nonzero().flatten()
                kept = selection.indices[bi, s, unit_of_row[rows]].to(q.device)  # (r, K)
                union, member = _tile_tokens(kept, n)
                if union.numel() == 0:
                    continue
                allowed = member & base[:, union.cpu()].to(q.device)  # (r, U)
                kv = kv_of[heads].to(q.device)
                keys = k[bi][kv][:, union]  # (h_s, U, D)
                values = v[bi][kv][:, union]
                scores = (q[bi, heads.to(q.device)][:, rows.to(q.device)].to(acc) @ keys.to(acc).transpose(-1, -2))
                scores = (scores * scale).masked_fill(~allowed, -math.inf)  # (h_s, r, U)
                row_lse = torch.logsumexp(scores, dim=-1)
                probs = torch.exp(scores - row_lse.masked_fill(torch.isinf(row_lse), 0.0).unsqueeze(-1))
                tile_out[bi, heads] = (probs.to(v.dtype) @ values).to(acc)
                tile_lse[bi, heads] = row_lse.float()
        outs.append(tile_out)
        lses.append(tile_lse)
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
