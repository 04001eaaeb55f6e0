"""`blocked` over a selection of tokens (DSA's lightning indexer keeps, per query row, its top tokens).

A token selection has no block structure to lean on: the kept tokens of a row are scattered over the whole
context, so reading whole key blocks touches nearly every block at a budget of 1/8, and a dense mask of
(B, H, q_len, N) booleans holds 40 GB at 16K. Two paths:

- inference (`token_rows_attention`, config.path `token_rows`), where a KV group's query heads share the
  selection: each query row is a decode step over its own tokens. The decode kernel (impls/blocked/decode.cpp)
  takes, per (row, KV head), the rows of its kept keys and reads each in place once for the group's heads, with
  its prefetch and online softmax: no copy of a gathered key, no score outside the selection. DSA at 16K (H8/2,
  D128, bf16, 1/16 of the tokens, 2-core EPYC): 0.44 s against 4.6 s through the torch ops below.
- otherwise (`token_attention`, `token_union`: backward, per-head selections of GQA groups): torch ops. The rows
  go in tiles of ROW_TILE; per tile and selection head the tokens some row kept are gathered once (their keys and
  values, every KV head), the tile's rows are scored against that union only, each row masked to its own tokens
  and the base pattern, then softmax and products. Where adjacent queries keep mostly the same tokens the union
  stays near one row's count and the work near the selection's density. Where they do not (measured on
  structured inputs at 4K: the union of 32 rows held 7.5x one row's tokens), each row's own tokens are gathered
  instead, per KV head (the group's query heads share each gathered key), and scored in one batched product over
  the tile's rows: the work is the selection's own, paid in gathers and small products. Autograd differentiates
  both (fwd_bwd); the selection is not differentiated.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bench.patterns.builtin import Causal, Dense
from bench.selection import Selection
from impls.blocked.decode import DecodePlan, decode_attention, decode_unavailable
from impls.common import accum_dtype, masked_lse_softmax

ROW_TILE = 64  # query rows per tile: the union of fewer rows' tokens is tighter; more rows make a larger GEMM
# A tile goes through the union when it holds at most this many times the tokens its rows keep on average: past
# that the union's GEMM computes more scores than the per-row products gather keys.
UNION_FACTOR = 2.0


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


def _softmax_products(scores: Tensor, allowed: Tensor, values: Tensor, v_dtype: torch.dtype
                      ) -> tuple[Tensor, Tensor]:
    """(probs @ values, lse float32) of `scores` masked to `allowed` (a row with nothing allowed: zeros, -inf)."""
    probs, row_lse = masked_lse_softmax(scores, allowed)
    return probs.to(v_dtype) @ values, row_lse.float()


def _union_tile(q_heads: Tensor, keys: Tensor, values: Tensor, kv: Tensor, base_rows: Tensor, union: Tensor,
                member: Tensor, scale: float, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out (h_s, r, D), lse (h_s, r)) of a tile's rows over the union of their tokens: one GEMM per head.
    q_heads (h_s, r, D); keys, values (Hkv, N, D) of one batch; kv (h_s,) the KV head of each query head."""
    allowed = member & base_rows[:, union.to(base_rows.device)].to(q_heads.device)  # (r, U)
    u_keys, u_values = keys[:, union][kv], values[:, union][kv]  # (h_s, U, D): only the union is copied
    scores = (q_heads.to(acc) @ u_keys.to(acc).transpose(-1, -2)) * scale  # (h_s, r, U)
    return _softmax_products(scores, allowed, u_values, values.dtype)


def _per_row_tile(q_heads: Tensor, keys: Tensor, values: Tensor, kv: Tensor, kept: Tensor, rows: Tensor,
                  pattern, scale: float, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out (h_s, r, D), lse (h_s, r)) of a tile's rows each over its own kept tokens: per KV head the rows' keys
    gathered once (r, K, D) and the group's query heads scored against them in one batched product. keys are
    already in the accumulation dtype (converted once per call, not per gather)."""
    h_s, r, d = q_heads.shape
    # -1 (none) to the end of each row, then only the columns some row uses: a tile of early causal rows keeps a
    # fraction of the selection's width K (its last row's count)
    kept = kept.sort(dim=-1, descending=True).values[:, : int((kept >= 0).sum(dim=-1).max())]
    token = kept.clamp(min=0).to(torch.int64)  # (r, K); -1 (none) reads token 0 and is masked out
    allowed = (kept >= 0) & pattern.mask(rows[:, None], token.cpu()).to(kept.device)  # (r, K)
    out = q_heads.new_zeros(h_s, r, d, dtype=acc)
    lse = torch.full((h_s, r), -math.inf, dtype=torch.float32, device=q_heads.device)
    for g in torch.unique(kv).tolist():
        at = (kv == g).nonzero().flatten()
        g_keys, g_values = keys[g][token], values[g][token]  # (r, K, D)
        group_q = q_heads[at].transpose(0, 1).to(acc)  # (r, h_g, D)
        scores = (group_q @ g_keys.transpose(-1, -2)) * scale  # (r, h_g, K)
        g_out, g_lse = _softmax_products(scores, allowed[:, None, :], g_values, values.dtype)
        out[at] = g_out.transpose(0, 1).to(acc)
        lse[at] = g_lse.transpose(0, 1)
    return out, lse


def token_attention(selection: Selection, pattern, q: Tensor, k: Tensor, v: Tensor, scale: float
                    ) -> tuple[Tensor, Tensor]:
    """(out (B, H, q_len, D), lse (B, H, q_len) float32) of attention over a token selection (kv_unit 1) under
    the base pattern; module docstring."""
    b, h, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = h // hkv
    acc = accum_dtype(q.dtype)
    heads_of = selection.head_index(h, hkv)  # (H,) the selection head of each query head
    kv_of = torch.arange(h) // group  # (H,) the KV head of each query head
    unit_of_row = torch.arange(nq) // selection.q_unit
    keys_acc = k.to(acc)  # the per-row path scores gathered keys in acc: convert the cache once, not each gather
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for start in range(0, nq, ROW_TILE):
        rows = torch.arange(start, min(start + ROW_TILE, nq))
        base_rows: Tensor | None = None  # the base pattern's rows over every key, made if a union needs it
        tile_out = q.new_zeros(b, h, len(rows), d, dtype=acc)
        tile_lse = torch.full((b, h, len(rows)), -math.inf, dtype=torch.float32, device=q.device)
        for bi in range(b):
            for s in torch.unique(heads_of).tolist():
                heads = (heads_of == s).nonzero().flatten()
                kept = selection.indices[bi, s, unit_of_row[rows]].to(q.device)  # (r, K)
                kept_per_row = float((kept >= 0).sum()) / len(rows)
                if kept_per_row == 0:
                    continue
                q_heads = q[bi, :, start : start + len(rows)][heads.to(q.device)]  # (h_s, r, D)
                kv = kv_of[heads].to(q.device)
                union, member = _tile_tokens(kept, n)
                if union.numel() <= UNION_FACTOR * kept_per_row:
                    if base_rows is None:
                        base_rows = pattern.mask(rows[:, None], torch.arange(n)[None, :])  # (r, N)
                    out, lse = _union_tile(q_heads, k[bi], v[bi], kv, base_rows, union, member, scale, acc)
                else:
                    out, lse = _per_row_tile(q_heads, keys_acc[bi], v[bi], kv, kept, rows, pattern, scale, acc)
                tile_out[bi, heads] = out.to(acc)
                tile_lse[bi, heads] = lse
        outs.append(tile_out)
        lses.append(tile_lse)
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def rows_as_sequences_unavailable(selection: Selection, q: Tensor, k: Tensor, mode: str) -> str | None:
    """Why `token_rows_attention` cannot run this call; None when it can."""
    why = decode_unavailable(q[:, :, :1], mode)
    if why is not None:
        return why
    if selection.shared == "head" and q.shape[1] != k.shape[1]:
        return "a token selection per query head of a GQA group: the group's rows would not share each key read"
    return None


def last_visible_key(pattern, nq: int, n: int) -> Tensor | None:
    """(nq,) int64: the last key each query row may see where the base pattern is a prefix of the keys (causal:
    the row's position; dense: N - 1), so that one comparison is its mask; None for any other base."""
    if type(pattern) not in (Causal, Dense) or pattern.documents is not None:
        return None
    return pattern.q_offset + torch.arange(nq) if isinstance(pattern, Causal) else torch.full((nq,), n - 1)


def selected_rows(selection: Selection, heads: Tensor, nq: int) -> Tensor:
    """int32 (B, len(heads), nq, K): the selection's indices of selection heads `heads` for each query row, read
    in place where that picks nothing out of them (no copy of a 16K x 1024 selection)."""
    picked = selection.indices
    if not torch.equal(heads, torch.arange(picked.shape[1])):
        picked = picked[:, heads]
    if selection.q_unit != 1 or picked.shape[2] != nq:
        picked = picked[:, :, torch.arange(nq) // selection.q_unit]
    return picked.to(torch.int32)


def token_rows_attention(selection: Selection, pattern, q: Tensor, k: Tensor, v: Tensor, scale: float
                         ) -> tuple[Tensor, Tensor]:
    """(out, lse) of inference over a token selection shared by a KV group's heads (DSA's), each query row read
    as a decode step over its own tokens: the decode kernel (impls/blocked/decode.cpp) given, per (row, KV head),
    the rows of its kept keys, in the selection's order. Each kept key and value row is read once for the group's
    heads, in place, with the kernel's prefetch; nothing is gathered into copies and no score outside the
    selection is computed."""
    b, h, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = h // hkv
    rows = torch.arange(nq)
    sel_of_kv = selection.head_index(h, hkv)[::group]  # (Hkv,) the selection head each KV head's group reads
    heads, kv_list = torch.unique(sel_of_kv, return_inverse=True)  # DSA's one selection serves every KV head
    kept = selected_rows(selection, heads, nq)  # (B, S, nq, K)
    last_key = last_visible_key(pattern, nq, n)
    if last_key is not None:  # the base as one comparison per token
        allowed = (kept >= 0) & (kept <= last_key.to(torch.int32)[None, None, :, None])
    else:
        allowed = (kept >= 0) & pattern.mask(rows[None, None, :, None], kept.clamp(min=0).to(torch.int64).cpu()
                                             ).to(kept.device)
    counts = allowed.sum(dim=-1, dtype=torch.int32)  # (B, S, nq); int32: half the time of int64 here
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    token = kept  # a list's entries past its count are never read
    if not torch.equal(allowed, torch.arange(kept.shape[-1]) < counts[..., None]):  # kept ones not first: order
        token = torch.where(allowed, kept, n).sort(dim=-1).values.clamp(max=n - 1)
    counts = counts[:, kv_list].permute(0, 2, 1).reshape(-1).to(torch.int32).contiguous()  # (B * nq * Hkv,)
    # A sequence per (batch, row); per (sequence, KV head) its tokens' rows after the KV head's first row of k:
    # one list per sequence where every KV head reads the same selection, else one per (sequence, KV head)
    shared = heads.numel() == 1
    lists = token[..., :width] if shared else token[..., :width][:, kv_list]  # (B, S, nq, W)
    lists = lists.permute(0, 2, 1, 3).reshape(-1, width).to(torch.int32).contiguous()
    heads_base = (torch.arange(b)[:, None] * hkv + torch.arange(hkv)[None, :]) * n * d  # (B, Hkv): element offsets
    key_base = heads_base[:, None, :].expand(b, nq, hkv).reshape(-1).contiguous()  # (B * nq * Hkv,)
    unused = torch.zeros(1, 1, dtype=torch.int32)  # the plan's blocks, one row all lists share: not read with key_rows
    plan = DecodePlan(unused, counts, torch.ones(1, 1, dtype=torch.bool), torch.ones(1, 1, 1, dtype=torch.bool), 1)
    q_rows = q.permute(0, 2, 1, 3).reshape(b * nq, h, 1, d)  # a sequence per row: its H heads, one query row
    k_seq, v_seq = (t.contiguous() for t in (k, v))
    out, lse = decode_attention(plan, q_rows, k_seq, v_seq, scale, key_rows=(lists, key_base))
    return out.view(b, nq, h, d).permute(0, 2, 1, 3).contiguous(), lse.view(b, nq, h).permute(0, 2, 1).contiguous()
