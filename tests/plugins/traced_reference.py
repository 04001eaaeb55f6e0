"""A reference selector (a yardstick, like oracle_topk) that notes each time it runs, in the file named by
BENCH_TEST_TRACE (`<event> <pid>` lines, as traced.py): tests/test_prepare_case.py sees that the fresh memory
process does not make it again. Standalone: a plugin file importing another is registered twice."""

from __future__ import annotations

import math
import os

import torch

from bench.selection import register_selector


@register_selector("traced_reference_blocks", q_unit="block", kv_unit="block", shared="head", takes=None,
                   reference=True)
def traced_reference_blocks(q, k, case):
    """The query block's own key block and the first, as a reference selector, noting each call."""
    path = os.environ.get("BENCH_TEST_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"reference_select {os.getpid()}\n")
    units = math.ceil(q.shape[2] / case.block_size)
    own = torch.arange(units) + (k.shape[2] - q.shape[2]) // case.block_size
    first = torch.where(own == 0, -1, 0)
    return torch.stack([own, first], dim=-1).to(torch.int32).expand(q.shape[0], q.shape[1], units, 2).contiguous()
