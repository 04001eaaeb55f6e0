"""A selector and an implementation that say, in the file named by BENCH_TEST_TRACE, each time a selection is made,
attended over, or a paged cache is read through its page table: tests/test_prepare_case.py runs every caller that
times a case on them and reads who did what (one line per event: `<event> <pid>`)."""

from __future__ import annotations

import math
import os
from typing import ClassVar

import torch

from bench.registry import Impl, register
from bench.selection import TakesSelections, effective_mask, register_selector


def trace(event: str) -> None:
    path = os.environ.get("BENCH_TEST_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"{event} {os.getpid()}\n")


@register_selector("traced_first_blocks", q_unit="block", kv_unit="block", shared="head", takes=None)
def traced_first_blocks(q, k, case):
    """The query block's own key block and the first (a fixed selection), noting each call."""
    trace("select")
    units = math.ceil(q.shape[2] / case.block_size)
    own = torch.arange(units) + (k.shape[2] - q.shape[2]) // case.block_size
    first = torch.where(own == 0, -1, 0)
    return torch.stack([own, first], dim=-1).to(torch.int32).expand(q.shape[0], q.shape[1], units, 2).contiguous()


def _masked(q, k, v, mask):
    """Dense attention under a (B|1, H|1, Nq, N) boolean mask, in float32, GQA by repeating K/V heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    s = (q.float() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    w = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1).nan_to_num(0.0)
    return (w @ v).to(q.dtype)


@register
class Traced(Impl):
    name = "traced"
    description = "dense attention that notes each selection it attends over and each page table it reads"
    fwd_bwd = False
    selections: ClassVar[TakesSelections] = {"q_unit": ("block",), "kv_unit": ("block",)}

    def prepare(self, case, pattern, q, k, v):
        mask = pattern.dense_mask().to(q.device)
        return lambda: _masked(q, k, v, mask)

    def prepare_selected(self, case, pattern, q, k, v):
        rows = torch.arange(pattern.q_len)

        def attend(selection):
            trace("attend")
            return _masked(q, k, v, effective_mask(selection, pattern, rows, case.heads, case.n_kv_heads))

        return attend

    def paged_native(self, case):
        return True

    def prepare_paged(self, case, pattern, q, cache, patterns):
        trace("page_table")
        shape = (q.shape[0], cache.k_pages.shape[1], case.seq_len, q.shape[-1])
        k, v = torch.empty(shape, dtype=q.dtype), torch.empty(shape, dtype=q.dtype)
        mask = pattern.dense_mask()

        def call():
            trace("paged_call")
            cache.gather_(k, v)  # through the table, page by page
            return _masked(q, k, v, mask)

        return call
