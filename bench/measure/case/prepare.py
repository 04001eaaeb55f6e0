"""One way to prepare a case: every caller that times a case goes through `stage_case` and `prepare_case` (the
pair session, the memory probe, each rank, `bench profile`, the pytest-benchmark entry in benchmarks/,
`bench.api`), so a selection case is timed with its selector and a paged case through its page table wherever it
is timed.

A case is of one of three kinds, decided here once (`kind_of`); a new kind is one new branch here:

- plain: the implementation's `prepare` over contiguous q, k, v; the timed step is the call (with its backward
  from the seeded upstream gradient in fwd_bwd);
- selected (a `selector`, or a selection given to `bench.api.attention`): the case's selection, made once and
  validated (bench.measure.case.selected), then `prepare_selected`; the timed step is end to end,
  `attend(selector(q, k))`, with the selector alone and the attention over the fixed selection beside it;
- paged (a `page_size`): the pool and page table, made once (bench.measure.case.paged); an implementation that reads a
  page table gets the pool, every other one the pages gathered back into contiguous K/V inside its timed call.

`stage_case` does what does not depend on the implementation (the selection, the pool: shared by the case's
implementations through the CaseCache) and knows the least bytes the call must move; `prepare_case` runs the
implementation's untimed setup and first call. What each kind checks is `PreparedCase.check`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from bench import registry
from bench.errors import Unavailable
from bench.inputs.paged import PagedKV
from bench.measure.case import flops as flop_counts
from bench.measure.case.case_cache import CaseCache
from bench.measure.case.paged import (
    case_paged,
    check_sequences,
    paged_kv_rows,
    sequence_patterns,
    set_up_paged,
)
from bench.measure.case.selected import (
    SelectedSteps,
    case_selection,
    check_selected,
    selected_steps,
    selection_kv_rows,
    set_up_selected,
    split_output,
)
from bench.measure.case.steps import Phase, Prepared, no_phase, set_up_plain, skip_reason, timed_step
from bench.measure.oracle.check import OracleResults, check_against_oracle
from bench.patterns import Pattern
from bench.results.records import ErrorInfo
from bench.selection import Selection, SelectorInfo
from bench.spec.case import Case

CaseKind = Literal["plain", "selected", "paged"]


def kind_of(case: Case, selection: Selection | None = None) -> CaseKind:
    """The case's kind: selected (a selector, or a given selection), paged (a page size), else plain."""
    if case.selector is not None or selection is not None:
        return "selected"
    return "paged" if case.page_size is not None else "plain"


@dataclass
class StagedCase:
    """A case with what its kind needs made, before any implementation: q, k, v (leaves, requiring grad in
    fwd_bwd), the upstream gradient, the selection or the pool, and the key rows the call must read."""

    kind: CaseKind
    case: Case
    pattern: Pattern
    q: Tensor
    k: Tensor
    v: Tensor
    grad_out: Tensor | None
    kv_rows: int  # `min_bytes`' kv_rows: what the pattern, the selection or the sequences allow
    selector: SelectorInfo | None = None  # None with a selection given as such (bench.api)
    selection: Selection | None = None
    paged: PagedKV | None = None
    patterns: list[Pattern] | None = None  # a paged cache's sequences of their own lengths (kv_lens)

    @property
    def bytes(self) -> int:
        """The least bytes the call must move (bench.measure.case.flops.min_bytes)."""
        return flop_counts.min_bytes(self.case, self.kv_rows)


def stage_case(case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor | None,
               cache: CaseCache | None = None, phase: Phase = no_phase, selection: Selection | None = None
               ) -> StagedCase:
    """The case staged for its kind (the selection and the pool kept in `cache` for the case's next
    implementations). `selection`: attend over this one instead of running the case's selector. Raises
    SelectionError for an invalid selection."""
    cache = cache if cache is not None else CaseCache()
    kind = kind_of(case, selection)
    staged = StagedCase(kind, case, pattern, q, k, v, grad_out, 0)
    if kind == "selected":
        phase("selection")
        if selection is None:
            staged.selector, staged.selection = case_selection(case, q.detach(), k.detach(), cache)
        else:
            selection.validate(case.batch, case.heads, case.n_kv_heads, case.n_queries, case.seq_len)
            staged.selection = selection
        staged.kv_rows = selection_kv_rows(staged.selection, pattern, case.heads, case.n_kv_heads)
    elif kind == "paged":
        phase("paging")
        staged.paged = case_paged(case, k.detach(), v.detach(), cache)
        staged.patterns = sequence_patterns(case, staged.paged)
        staged.kv_rows = paged_kv_rows(case, pattern, staged.patterns)
    else:
        staged.kv_rows = flop_counts.pattern_kv_rows(case, pattern)
    return staged


@dataclass
class PreparedCase:
    """An implementation prepared for a staged case: its setup and first output (`call`), and what is timed."""

    staged: StagedCase
    impl: registry.Impl
    call: Prepared  # setup times, config and the first output of the attention call
    step: Callable[[], Any]  # what is timed: end to end, with the backward in fwd_bwd
    steps: SelectedSteps | None = None  # selected: the selector alone, attend alone, end to end

    @property
    def kind(self) -> CaseKind:
        return self.staged.kind

    @property
    def memory_step(self) -> Callable[[], Any]:
        """What the memory figure measures: the timed step, but for a reference selector's case the attention over
        its selection (the reference is a yardstick: its own cost, dense attention's and more, is no method's)."""
        selector = self.staged.selector
        if self.steps is not None and selector is not None and selector.reference:
            return self.steps.attention
        return self.step

    @property
    def forward(self) -> Callable[[], Any]:
        """The timed step's forward alone (its output): the phase split of a fwd_bwd step."""
        return self.steps.forward if self.steps is not None else self.call.fn

    @property
    def output(self) -> Any:
        """The first call's output (a selection's lse split off)."""
        return split_output(self.call.first_output)[0] if self.kind == "selected" else self.call.first_output

    def check(self, full: bool, oracle: OracleResults) -> tuple[ErrorInfo, str | None]:
        """(error, problem or None) of the first call against the float64 oracle under the kind's mask: the
        pattern; the selection's effective mask (and the lse where returned); each sequence's own pattern."""
        s = self.staged
        if s.kind == "selected":
            assert s.selection is not None
            return check_selected(s.case, self.impl, s.pattern, s.selection, s.q, s.k, s.v, self.call.first_output,
                                  s.grad_out, full=full, oracle=oracle)
        if s.patterns is not None:
            return check_sequences(s.case, self.impl, s.patterns, s.q, s.k, s.v, self.output, full=full)
        return check_against_oracle(s.case, self.impl, s.pattern, s.q, s.k, s.v, self.output, s.grad_out, full=full,
                                    oracle=oracle)


def prepare_case(impl: registry.Impl, staged: StagedCase, phase: Phase = no_phase,
                 upstream: Callable[[Tensor], Tensor] | None = None) -> PreparedCase:
    """The implementation's untimed setup and first call for the staged case, and its timed step. `upstream`
    (ranks): the part of the upstream gradient matching what the call returned. Raises Unavailable (the
    implementation cannot run this case here), and whatever the implementation raises."""
    case = staged.case
    reason = skip_reason(impl, case) or _selection_reason(impl, staged)
    if reason:
        raise Unavailable(reason)
    q, k, v, grad_out = staged.q, staged.k, staged.v, staged.grad_out
    if staged.kind == "selected":
        assert staged.selection is not None
        attend, call = set_up_selected(impl, case, staged.pattern, q, k, v, staged.selection, phase)
        steps = selected_steps(staged.selector, case, attend, staged.selection, q, k, v, grad_out)
        return PreparedCase(staged, impl, call, steps.end_to_end, steps)
    if staged.kind == "paged":
        assert staged.paged is not None
        call = set_up_paged(impl, case, staged.pattern, q, k, v, staged.paged, staged.patterns, phase)
        return PreparedCase(staged, impl, call, call.fn)  # paged cases are inference only
    call = set_up_plain(impl, case, staged.pattern, q, k, v, phase)
    return PreparedCase(staged, impl, call, timed_step(call.fn, q, k, v, grad_out, upstream))


def _selection_reason(impl: registry.Impl, staged: StagedCase) -> str | None:
    """Why the implementation cannot attend over a selection given as such (a case's selector: skip_reason)."""
    if staged.kind != "selected" or staged.selector is not None:
        return None
    assert staged.selection is not None
    chosen, case = staged.selection, staged.case
    kv_unit = "token" if chosen.kv_unit == 1 else "block" if chosen.kv_unit == case.block_size else "page"
    return impl.unsupported_selection(case, "row" if chosen.q_unit == 1 else "block", kv_unit, chosen.shared)


def prepare(impl: registry.Impl, case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor,
            grad_out: Tensor | None = None, cache: CaseCache | None = None, phase: Phase = no_phase,
            selection: Selection | None = None) -> PreparedCase:
    """`stage_case` then `prepare_case`: for callers that need nothing in between."""
    return prepare_case(impl, stage_case(case, pattern, q, k, v, grad_out, cache, phase, selection), phase)
