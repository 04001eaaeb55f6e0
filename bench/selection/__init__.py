"""Data-dependent sparse attention: selectors choose key units from (q, k), and implementations attend over them.

This is a public module (docs/DESIGN.md "Selection"): plugins import `register_selector`, implementations
`Selection` (what `prepare_selected`'s call receives) and the helpers that turn a selection into their own form
(`effective_mask`, `Selection.unit_mask`), selectors the helpers that turn a budget into counts
(`allowed_units`, `budget_counts`, `topk_indices`).
"""

from bench.selection.base import (
    DEFAULT_PAGE_SIZE,
    SHARED,
    Selection,
    SelectionError,
    TakesSelections,
    effective_mask,
    selection_heads,
    unit_size,
)
from bench.selection.registry import (
    SELECTORS,
    SelectorInfo,
    get_selector,
    register_selector,
    run_selector,
    selector_names,
)
from bench.selection.units import allowed_units, budget_counts, topk_indices

__all__ = [
    "DEFAULT_PAGE_SIZE", "SELECTORS", "SHARED", "Selection", "SelectionError", "SelectorInfo", "TakesSelections",
    "allowed_units", "budget_counts", "effective_mask", "get_selector", "register_selector", "run_selector",
    "selection_heads", "selector_names", "topk_indices", "unit_size",
]
