"""Paged KV caches: K and V in a pool of pages with a page table per sequence, as serving systems keep them.

vLLM's PagedAttention and FlashInfer keep a sequence's keys in fixed-size pages scattered over a shared pool, and
a decode kernel reads them through the sequence's page table. A case with `page_size` lays its K and V out that
way: sequence b's first kv_lens[b] keys (all seq_len without `kv_lens`) cut into pages of page_size tokens, every
sequence's pages placed in one pool in a seeded shuffled order; the page table lists sequence b's pages in
order (-1 past its last). The pool layout is FlashInfer's HND: (pages, Hkv, page_size, D). The oracle reads the
logical order (the contiguous tensors the pool was made from); an implementation reads through the table, or
gathers the pages back inside its timed call (`gather_`: that copy is part of what it costs).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PagedKV:
    k_pages: Tensor  # (P, Hkv, page_size, D)
    v_pages: Tensor  # (P, Hkv, page_size, D)
    page_table: Tensor  # int32 (B, max_pages): sequence b's pages in order, -1 past its last
    kv_lens: Tensor  # int32 (B,): keys per sequence
    page_size: int

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    def gather_(self, k_out: Tensor, v_out: Tensor) -> None:
        """Write the pages back in logical order into contiguous (B, Hkv, N, D) buffers (positions past a
        sequence's length are left as they are)."""
        for bi, (length, pages) in enumerate(self._pages_in_order):
            for src, dst in ((self.k_pages, k_out), (self.v_pages, v_out)):
                rows = src.index_select(0, pages)  # (p, Hkv, page, D)
                dst[bi, :, :length] = rows.transpose(0, 1).reshape(dst.shape[1], -1, dst.shape[3])[:, :length]

    @functools.cached_property
    def _pages_in_order(self) -> list[tuple[int, Tensor]]:
        """(length, int64 page indices) per sequence, read once: the gather runs inside timed calls, where reading
        a length off a GPU tensor would wait for the device at every call."""
        out = []
        for bi, length in enumerate(self.kv_lens.tolist()):
            out.append((int(length), self.page_table[bi, : math.ceil(length / self.page_size)].to(torch.int64)))
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_pages, self.v_pages, self.page_table))


def kv_lengths(spec: tuple[int, ...] | str | None, batch: int, seq_len: int, q_len: int, seed: int) -> list[int]:
    """Keys per sequence: every sequence seq_len (None), the lengths given, or `random`: drawn from the seed in
    [q_len, seq_len]."""
    if spec is None:
        return [seq_len] * batch
    if spec == "random":
        gen = torch.Generator().manual_seed(seed * 7919 + 13)
        return (torch.randint(q_len, seq_len + 1, (batch,), generator=gen)).tolist()
    return [int(x) for x in spec]


def page_kv(k: Tensor, v: Tensor, page_size: int, lengths: list[int], seed: int) -> PagedKV:
    """The pool and page table of contiguous k, v (B, Hkv, N, D), module docstring."""
    b, hkv, _, d = k.shape
    per_seq = [math.ceil(length / page_size) for length in lengths]
    total = sum(per_seq)
    gen = torch.Generator().manual_seed(seed * 104_729 + page_size)
    slots = torch.randperm(total, generator=gen)  # where each sequence's pages land in the pool
    k_pages = k.new_zeros(total, hkv, page_size, d)
    v_pages = v.new_zeros(total, hkv, page_size, d)
    table = torch.full((b, max(per_seq, default=0)), -1, dtype=torch.int32)
    taken = 0
    for bi, (length, count) in enumerate(zip(lengths, per_seq, strict=True)):
        own = slots[taken : taken + count]
        taken += count
        table[bi, :count] = own.to(torch.int32)
        for src, dst in ((k, k_pages), (v, v_pages)):
            padded = torch.nn.functional.pad(src[bi, :, :length], (0, 0, 0, count * page_size - length))
            dst[own.to(src.device)] = padded.view(hkv, count, page_size, d).transpose(0, 1)
    return PagedKV(k_pages, v_pages, table.to(k.device), torch.tensor(lengths, dtype=torch.int32,
                                                                       device=k.device), page_size)
