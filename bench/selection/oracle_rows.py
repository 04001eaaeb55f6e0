"""The per-row yardstick: `oracle_topk_rows` keeps, for each query row and head, the `budget` key blocks of most
dense attention mass under the base pattern, the best recall any selector of that budget per row reaches (MoBA,
NSA and Quest choose per row; `oracle_topk` shares one choice per query block, which can need more blocks when the
rows of a block look far apart, as the queries of associative recall do). A reference selector: it computes dense
attention, as the oracle does (bench.selection.oracle)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from bench.selection.oracle import oracle_topk_indices
from bench.selection.registry import register_selector
from bench.selection.units import allowed_units, budget_counts


@register_selector("oracle_topk_rows", q_unit="row", kv_unit="block", shared="head", takes="budget",
                   reference=True)
def oracle_topk_rows(q: Tensor, k: Tensor, case: Any) -> Tensor:
    """The budget key blocks of most dense attention mass per (head, query row)."""
    pattern = case.make_pattern()
    counts = budget_counts(case.budget, allowed_units(pattern, 1, case.block_size))
    return oracle_topk_indices(q, k, pattern, 1, case.block_size, "head", counts)
