"""The smallest selector of the owners' brief (round 3, "Selection"), registered exactly as written there: no
`takes`, so a case may leave out the budget, and its id then carries none."""

from __future__ import annotations

import math

import torch

from bench.selection import register_selector


@register_selector("diag_and_first", q_unit="block", kv_unit="block", shared="head")
def diag_and_first(q, k, case):      # q [B, H, Nq, D], k [B, Hkv, N, D]; case: the Case (block_size, budget, ...)
    b, h, nq, _ = q.shape
    units = math.ceil(nq / case.block_size)
    offset = (k.shape[2] - nq) // case.block_size  # query block u is at key block u + offset (bottom-right)
    own = torch.arange(units) + offset
    first = torch.zeros(units, dtype=torch.int64)
    indices = torch.stack([own, first], dim=-1)  # (U, 2): the query block's own key block, and the first
    indices[:, 1] = torch.where(own == 0, -1, indices[:, 1])  # block 0: the first is its own, once
    return indices.to(torch.int32).expand(b, h, units, 2).contiguous()


@register_selector("fixed_first", q_unit="block", kv_unit="block", shared="head", takes=None)
def fixed_first(q, k, case):
    """Declared fixed (takes=None): only the first key block (and the query block's own, for causality)."""
    return diag_and_first(q, k, case)
