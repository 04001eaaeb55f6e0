"""`blocked` over a selection of pages (Quest's: per query row and query head, pages of page_size keys).

Inference (`page_rows_attention`, config.path `page_rows`): each (query head, row) is a decode sequence of its own
over its selected pages, read by the decode kernel's paged loop (impls/blocked/decode.cpp). The contiguous cache
is that loop's pool of pages as it lies (a view: a KV head's N keys are N / page pages side by side, nothing
copied); each sequence's page table lists its selected pages as the selection has them (sorted only where
dropped entries sit among the kept), the row's own page moved last so that the sequence's length cuts it at the
row's position, which is the base pattern's mask where that is causal (dense: nothing to cut). The
pages' rows are read in place with the kernel's prefetch of the next step's pages and its online softmax: no
gathered copy, no score outside the selection. A KV group's heads read their KV head's pages apart: the union of
Quest's 4 heads' pages at 16K (8 on 2 KV heads, 1/16: 32.5 pages a head, 76 together), read once for the group
with a bit per page and head, took 1.5x as long (2-core EPYC, interleaved): the compute of 4 rows over 2.3x the
pages outweighed the reads it saved.

Elsewhere (backward, a base pattern that is not a prefix of the keys, N not a whole number of pages) the pages
become their tokens (`tokens_of_pages`) and take the token paths (impls/blocked/tokens.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bench.selection import Selection
from impls.blocked.decode import DecodePlan, decode_attention, decode_unavailable
from impls.blocked.tokens import last_visible_key, selected_rows


def page_rows_unavailable(selection: Selection, pattern, q: Tensor, k: Tensor, mode: str) -> str | None:
    """Why `page_rows_attention` cannot run this call; None when it can."""
    why = decode_unavailable(q[:, :, :1], mode)
    if why is not None:
        return why
    if last_visible_key(pattern, 1, k.shape[2]) is None:
        return (f"base pattern {pattern.name}{' with documents' if pattern.documents is not None else ''}: the "
                "page path cuts only the last page of a row (causal or dense)")
    if k.shape[2] % selection.kv_unit:
        return f"{k.shape[2]} keys are not a whole number of pages of {selection.kv_unit}"
    return None


def _row_pages(selection: Selection, h: int, hkv: int, nq: int, last_key: Tensor, page: int
               ) -> tuple[Tensor, Tensor]:
    """(listed (B, H, nq, W) int32, counts (B, H, nq)): each (head, row)'s pages with a key it may see (at most
    `last_key`), first in the list, its own page (the one holding last_key) last where it is listed, so that the
    sequence's length cuts it; entries past counts are 0. In the selection's order where its kept entries already
    come first (Quest's), else sorted: no sort of every row where none is needed."""
    picked = selected_rows(selection, selection.head_index(h, hkv), nq)
    own = (last_key // page).to(torch.int32)[None, None, :, None]  # a page has a visible key iff it is <= own
    keep = (picked >= 0) & (picked <= own)
    counts = keep.sum(dim=-1, dtype=torch.int32)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    slots = torch.arange(picked.shape[-1])
    if not bool((keep == (slots < counts[..., None])).all()):
        picked = torch.where(keep, picked, torch.iinfo(torch.int32).max).sort(dim=-1).values  # own page: last
    listed = torch.where(slots[:width] < counts[..., None], picked[..., :width], 0)
    last = (counts - 1).clamp(min=0)[..., None]
    at_own = (listed == own) & (slots[:width] < counts[..., None])
    where_own = at_own.to(torch.int8).argmax(dim=-1, keepdim=True)
    has_own = at_own.any(dim=-1, keepdim=True)
    moved = torch.where(has_own, listed.gather(-1, last), listed.gather(-1, where_own))
    listed.scatter_(-1, where_own, moved)  # the last entry into the own page's slot, then the own page last
    listed.scatter_(-1, last, torch.where(has_own, own.expand_as(last), listed.gather(-1, last)))
    return listed, counts


def page_rows_attention(selection: Selection, pattern, q: Tensor, k: Tensor, v: Tensor, scale: float
                        ) -> tuple[Tensor, Tensor]:
    """(out (B, H, q_len, D), lse (B, H, q_len) float32) of inference over a page selection, each (query head,
    row) a decode sequence over its pages (module docstring); the base pattern causal or dense."""
    b, h, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    page = selection.kv_unit
    pages = n // page
    last_key = last_visible_key(pattern, nq, n)  # pages past it are dropped; page_rows_unavailable: not None
    assert last_key is not None, "page_rows_attention takes a causal or dense base (page_rows_unavailable)"
    ordered, counts = _row_pages(selection, h, hkv, nq, last_key, page)
    width = ordered.shape[-1]
    last_page = ordered.gather(-1, (counts - 1).clamp(min=0)[..., None]).squeeze(-1)
    lens = torch.where(counts > 0, (counts - 1) * page + (last_key - last_page * page + 1).clamp(max=page), 0)
    # The pool: k viewed as (B * Hkv * pages, 1, page, D); a query head reads its KV head's pages (entries past a
    # list's count hold page 0 of it: never read).
    kv_head = torch.arange(h) // (h // hkv)
    first_page = ((torch.arange(b)[:, None] * hkv + kv_head[None, :]) * pages).to(torch.int32)  # (B, H)
    table = first_page[:, :, None, None] + ordered
    # Sequences in (batch, head, row) order, one query row each: a thread walks a head's rows in turn, whose pages
    # are mostly the same from one row to the next (1.4x faster than the heads of a row in turn, one row's pages of
    # 8 heads overflowing L2).
    seq = lambda t: t.reshape(b * h * nq, *t.shape[3:])  # noqa: E731
    page_table = seq(table)
    plan = DecodePlan(torch.arange(width, dtype=torch.int32).expand(b * h * nq, width).contiguous(),
                      seq(counts).contiguous(), torch.ones(b * h * nq, width, dtype=torch.bool),
                      torch.ones(1, 1, 1, dtype=torch.bool), page)
    pool_k, pool_v = (t.contiguous().view(b * hkv * pages, 1, page, d) for t in (k, v))
    q_seq = q.reshape(b * h * nq, 1, 1, d)
    out, lse = decode_attention(plan, q_seq, pool_k, pool_v, scale, page_table, seq(lens).to(torch.int32))
    return out.view(b, h, nq, d), lse.view(b, h, nq)


def tokens_of_pages(selection: Selection, seq_len: int) -> Selection:
    """The same selection in tokens: each page's keys (those inside seq_len), -1 where a page was -1."""
    page = selection.kv_unit
    tokens = selection.indices.to(torch.int64)[..., None] * page + torch.arange(page)
    tokens = torch.where((selection.indices[..., None] >= 0) & (tokens < seq_len), tokens, -1)
    return Selection(tokens.flatten(-2).to(torch.int32), selection.q_unit, 1, selection.shared)
