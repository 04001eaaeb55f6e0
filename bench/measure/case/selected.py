"""The steps of a selection case (a case with a `selector`): one selection, three timings, an exact check.

A data-dependent sparse attention costs a selection step and the attention over what it selected, and its output
is not dense attention's. For each (case, implementation):

1. the case's selection: the selector run once on the case's inputs (untimed, shared by the case's pairs) and
   validated (range, duplicates, padding, shape): an invalid one ends the pair `failed`, naming the first bad
   index;
2. the implementation's `prepare_selected` (untimed) and its first `attend(selection)`;
3. the check: the attention step against the float64 oracle under the effective mask (the base pattern AND the
   selection), output and log-sum-exp where the implementation returns one, gradients in fwd_bwd;
4. three timings: the selector alone, `attend` over the fixed selection, and end to end (`attend(selector(q,
   k))`, the record's `time_s`). Reference selectors (the oracles: dense attention's cost) are timed by one call;
5. fidelity to dense attention (bench.measure.oracle.fidelity), once per case.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from bench import registry
from bench.measure.case.steps import Phase, Prepared, set_up
from bench.measure.oracle.check import (
    OracleResults,
    checked_rows,
    grad_errors,
    nonfinite_only,
    rows_only,
    with_numerics,
)
from bench.measure.oracle.numerics import finite_rel_l2, reference_errors
from bench.measure.oracle.reference import compare, float64_grads, reference_attention_lse, tolerance_for
from bench.patterns import Pattern
from bench.results.records import ErrorInfo, SelectionInfo, TimeStats
from bench.selection import Selection, SelectorInfo, effective_mask, get_selector, run_selector
from bench.spec.case import Case

if TYPE_CHECKING:
    from bench.measure.case.case_cache import CaseCache


def case_selection(case: Case, q: Tensor, k: Tensor, cache: CaseCache) -> tuple[SelectorInfo, Selection]:
    """The case's selection, made and validated once (kept in `cache`). Raises SelectionError."""
    info = get_selector(str(case.selector))
    if cache.selection is None:
        selection = run_selector(info, q, k, case)
        selection.validate(case.batch, case.heads, case.n_kv_heads, case.n_queries, case.seq_len)
        cache.selection = selection
    return info, cache.selection


def split_output(result: Any) -> tuple[Any, Tensor | None]:
    """attend's result as (output, lse or None)."""
    if isinstance(result, tuple) and len(result) == 2:
        return result[0], result[1]
    return result, None


def set_up_selected(impl: registry.Impl, case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor,
                    selection: Selection, phase: Phase) -> tuple[Callable[[Selection], Any], Prepared]:
    """(attend, the Prepared of attend over the fixed selection after its first call). Raises what they raise."""
    made: list[Callable[[Selection], Any]] = []

    def make() -> Callable[[], Any]:
        made.append(impl.prepare_selected(case, pattern.fresh(), q, k, v))
        return lambda: made[0](selection)

    prepared = set_up(make, impl, case, phase)
    attend = made[0]
    return attend, Prepared(lambda: split_output(attend(selection))[0], prepared.first_output, prepared.setup_s,
                            prepared.setup, prepared.config)


def check_selected(case: Case, impl: registry.Impl, pattern: Pattern, selection: Selection, q: Tensor, k: Tensor,
                   v: Tensor, result: Any, grad_out: Tensor | None, full: bool, oracle: OracleResults
                   ) -> tuple[ErrorInfo, str | None]:
    """(error, problem or None) of the attention step against the float64 oracle under the effective mask."""
    out, lse = split_output(result)
    tol = tolerance_for(case.dtype, impl.tf32(case))
    if not full:
        return nonfinite_only(out, tol)
    rows = checked_rows(case)
    heads, kv_heads = case.heads, case.n_kv_heads
    sinks = case.sink_logits()

    def selected(r: Tensor) -> Tensor:
        return effective_mask(selection, pattern, r, heads, kv_heads)

    if oracle.selected_out is None:
        with torch.no_grad():
            oracle.selected_out = reference_attention_lse(q.detach(), k.detach(), v.detach(), pattern, rows,
                                                          selected, sinks=sinks)
    expected_out, expected_lse = oracle.selected_out
    stats = compare(out.detach()[:, :, rows.to(out.device)], expected_out, tol)
    problem = None if stats.passed else (f"output has {stats.nonfinite} NaN/Inf values" if stats.nonfinite else
                                         f"output off the float64 oracle under the selection: rel_l2 "
                                         f"{stats.rel_l2:.3g} > tolerance {tol:g}")
    lse_max_abs = lse_rel = None
    if lse is not None:
        checked_lse = lse.detach()[:, :, rows.to(lse.device)]
        lse_max_abs, lse_problem = _lse_error(checked_lse, expected_lse, tol)
        lse_rel = finite_rel_l2(checked_lse, expected_lse)
        problem = problem or lse_problem
    backward = grad_out is not None
    g = rows_only(case, grad_out, rows) if grad_out is not None else None
    if backward and oracle.selected_grads is None:
        assert g is not None
        oracle.selected_grads = float64_grads(q, k, v, g[:, :, rows.to(g.device)],
                                              lambda a, b, c: reference_attention_lse(a, b, c, pattern, rows,
                                                                                      selected, sinks=sinks)[0])
    if oracle.selected_reference is None or (backward and oracle.selected_reference.grads is None):
        oracle.selected_reference = reference_errors(q, k, v, pattern, rows, expected_out, expected_lse, g,
                                                     oracle.selected_grads if backward else None,
                                                     extra_mask=selected, sinks=sinks)
    grad_info = None
    if backward:
        assert g is not None and oracle.selected_grads is not None
        grads = torch.autograd.grad(out, (q, k, v), g, allow_unused=True)
        grad_info, grad_problem = grad_errors(grads, oracle.selected_grads, tol,
                                              "the float64 oracle under the selection", oracle.selected_reference,
                                              case.dtype)
        problem = problem or grad_problem
    error = ErrorInfo(max_abs=stats.max_abs, rel_l2=stats.rel_l2, max_rel=stats.max_rel, tolerance=tol,
                      rows_checked=stats.rows_checked,
                      nonfinite=stats.nonfinite, grads=grad_info, lse_max_abs=lse_max_abs, lse_rel_l2=lse_rel)
    error = with_numerics(error, oracle.selected_reference, case.dtype)
    return error, problem


def _lse_error(actual: Tensor, expected: Tensor, tol: float) -> tuple[float | None, str | None]:
    """Largest |difference| of the log-sum-exps; empty rows must be -inf on both sides. The allowance is the
    output's tolerance (an lse error e scales the row's weights by e^e, a relative error of about e)."""
    a = actual.to(torch.float64).cpu()
    e = expected.to(torch.float64).cpu()
    empty = torch.isinf(e) & (e < 0)
    if bool((~torch.isinf(a[empty]) | (a[empty] > 0)).any()):
        return None, "lse of a row without keys is not -inf"
    finite = ~empty
    if bool((~torch.isfinite(a[finite])).any()):
        return None, "lse has NaN/Inf values on rows with keys"
    worst = float((a[finite] - e[finite]).abs().max()) if bool(finite.any()) else 0.0
    limit = max(tol, 1e-6) * 10
    return worst, (f"lse off the float64 oracle by {worst:.3g} > {limit:g}" if worst > limit else None)


@dataclass
class SelectedSteps:
    """The three timed calls of a selection pair (fwd_bwd: the attention and end to end with their backward)."""

    selector: Callable[[], Any]
    attention: Callable[[], Any]
    end_to_end: Callable[[], Any]
    forward: Callable[[], Any]  # end to end without the backward: the output (the phase split of fwd_bwd)


def selected_steps(info: SelectorInfo | None, case: Case, attend: Callable[[Selection], Any], selection: Selection,
                   q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor | None) -> SelectedSteps:
    """The three timed calls. `info` None: a selection given as such (bench.api), whose selector step is the
    selection itself."""
    def select() -> Selection:
        return selection if info is None else run_selector(info, q, k, case)

    def forward_over(chosen: Selection) -> Tensor:
        return split_output(attend(chosen))[0]

    def end_to_end_forward() -> Tensor:
        return forward_over(select())

    if grad_out is None:
        return SelectedSteps(select, lambda: forward_over(selection), end_to_end_forward, end_to_end_forward)

    def backward_over(chosen_fn: Callable[[], Selection]) -> Callable[[], Tensor]:
        def step() -> Tensor:
            q.grad = k.grad = v.grad = None
            out = forward_over(chosen_fn())
            out.backward(grad_out)
            return out.detach()  # the output, for the check of timed calls

        return step

    return SelectedSteps(select, backward_over(lambda: selection), backward_over(select), end_to_end_forward)


def selection_kv_rows(selection: Selection, pattern: Pattern, heads: int, kv_heads: int) -> int:
    """`min_bytes`' kv_rows of a selection: per (sequence, KV head), the keys of the units some row of some query
    head of its group kept that the base pattern lets some row see, summed."""
    from bench.selection import allowed_units

    n = pattern.seq_len
    kv_units = math.ceil(n / selection.kv_unit)
    base_keys = allowed_units(pattern, max(1, pattern.q_len), 1)[0]  # (N,) keys some row may see
    per_unit = torch.nn.functional.pad(base_keys, (0, kv_units * selection.kv_unit - n)).view(
        kv_units, selection.kv_unit).sum(dim=-1)  # (KU,)
    kept = selection.kept_units(kv_units).cpu()  # (B, H_sel, KU): kept by some query unit
    heads_of = selection.head_index(heads, kv_heads)
    by_kv = torch.zeros(kept.shape[0], kv_heads, kv_units, dtype=torch.bool)
    for h in range(heads):  # a KV head reads what any of its query heads' selections keep
        by_kv[:, h // (heads // kv_heads)] |= kept[:, int(heads_of[h])]
    return int((by_kv.to(torch.int64) * per_unit).sum())


REFERENCE_SHARE_NOTE = ("a reference selector: time_s is one end-to-end call (the yardstick's dense scoring, then the "
                        "attention over its choice) and the selector's time one call of its own, each on fresh inputs "
                        "and cold caches; single calls of a yardstick make no share of a method's time")


def selection_record(info: SelectorInfo, case: Case, selection: Selection, density: float | None,
                     selector_time: TimeStats, attention_time: TimeStats, end_to_end: TimeStats) -> SelectionInfo:
    """The record's `selection` block."""
    counts = selection.counts()
    share = selector_time.median / end_to_end.median if end_to_end.median > 0 else None
    note = None
    if info.reference:  # one call each, of a yardstick that costs dense attention: no share of a method's time
        share, note = None, REFERENCE_SHARE_NOTE
    return SelectionInfo(selector=info.name, q_unit=selection.q_unit, kv_unit=selection.kv_unit,
                         shared=selection.shared, budget=case.budget, threshold=case.threshold,
                         units_mean=float(counts.to(torch.float64).mean()) if counts.numel() else 0.0,
                         density=density, reference=info.reference, time_s=selector_time,
                         attention_time_s=attention_time,
                         share=share if share is None or math.isfinite(share) else None, share_note=note)
