"""`blocked` over a selection of pages (Quest's: per query row and query head, pages of page_size keys).

Inference (`page_rows_attention`, config.path `page_rows`): each (query head, row) is a decode sequence of its own
over its selected pages, read by the decode kernel's paged loop (impls/blocked/decode.cpp). The contiguous cache is
that loop's pool of pages as it lies (a view: a KV head's N keys are N / page pages side by side, nothing copied);
each sequence's page table lists its selected pages that hold a key the row may see, in the selection's order (built
in one pass by the kernel's module, `page_row_tables`), the row's own page moved last so that the sequence's length
cuts it at the row's position, which is the base pattern's mask where that is causal (dense: nothing to cut). The
pages' rows are read in place with the kernel's prefetch of the next step's pages and its online softmax: no
gathered copy, no score outside the selection. A KV group's heads read their KV head's pages apart: the union of
Quest's 4 heads' pages at 16K (8 on 2 KV heads, 1/16: 32.5 pages a head, 76 together), read once for the group with
a bit per page and head, took 1.5x as long (2-core EPYC, interleaved): the compute of 4 rows over 2.3x the pages
outweighed the reads it saved.

Elsewhere (backward, a base pattern that is not a prefix of the keys, N not a whole number of pages) the pages
become their tokens (`tokens_of_pages`) and take the token paths (impls/blocked/tokens.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bench.selection import Selection
from impls.blocked.decode import DecodePlan, decode_attention, decode_module, decode_unavailable
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
    picked = selected_rows(selection, selection.head_index(h, hkv), nq).contiguous()  # (B, H, nq, K)
    # Sequences in (batch, head, row) order, one query row each: a thread walks a head's rows in turn, whose pages
    # are mostly the same from one row to the next (the heads of a row in turn overflow L2 with one row's pages of
    # 8 heads). Their page tables are built in one pass in the kernel's module, not by a dozen torch passes
    # (docs/performance.md, "Measured choices", P1).
    module = decode_module()
    assert module is not None, "page_rows_attention needs the built kernel (page_rows_unavailable)"
    page_table, counts, lens = module.page_row_tables(picked, last_key.to(torch.int64), page, pages, hkv)
    width = page_table.shape[1]
    # every sequence's list of blocks is its page table's entries in order: one list that all share
    plan = DecodePlan(torch.arange(width, dtype=torch.int32)[None], counts, torch.ones(1, width, dtype=torch.bool),
                      torch.ones(1, 1, 1, dtype=torch.bool), page)
    # The pool: k viewed as (B * Hkv * pages, 1, page, D), nothing copied where k is contiguous.
    pool_k, pool_v = (t.contiguous().view(b * hkv * pages, 1, page, d) for t in (k, v))
    out, lse = decode_attention(plan, q.reshape(b * h * nq, 1, 1, d), pool_k, pool_v, scale, page_table, lens,
                                pages_reread=True)
    return out.view(b, h, nq, d), lse.view(b, h, nq)


def tokens_of_pages(selection: Selection, seq_len: int) -> Selection:
    """The same selection in tokens: each page's keys (those inside seq_len), -1 where a page was -1."""
    page = selection.kv_unit
    tokens = selection.indices.to(torch.int64)[..., None] * page + torch.arange(page)
    tokens = torch.where((selection.indices[..., None] >= 0) & (tokens < seq_len), tokens, -1)
    return Selection(tokens.flatten(-2).to(torch.int32), selection.q_unit, 1, selection.shared)
