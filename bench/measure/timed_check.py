"""The timed calls' own inputs and outputs: the input sets a pair's timed calls cycle through, and the check of
the outputs kept from them (bench.measure.cold says why).

The first call's output is checked before timing (`PreparedCase.check`); an implementation that returns a cached
output after it, computes properly on its first call only, or keys what it returns on the input pointers would
pass that check and then be timed doing less. Here the kept outputs of timed calls are compared with the float64
oracle for the input set each call was given, under the kind's mask: the pattern, a paged case's sequences, the
fixed selection (a selection's attention step) or the selection the selector makes of that set (end to end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from bench.inputs import another_set
from bench.inputs.paged import page_kv
from bench.measure.case.case_cache import CaseCache
from bench.measure.case.paged import check_sequences
from bench.measure.case.prepare import PreparedCase, StagedCase
from bench.measure.case.selected import check_selected, split_output
from bench.measure.cold import InputSets, KeptCall, TimedCalls, evictor_for, timing_info
from bench.measure.oracle.check import OracleResults, check_against_oracle
from bench.measure.timing import Timer, TimingPolicy
from bench.results.records import TimingInfo
from bench.selection import Selection, run_selector

# Which of a pair's timed steps a kept output came from: the plain or paged call (and a selection's end to end),
# or a selection's attention over the fixed selection.
StepKind = Literal["call", "attention"]
SETS = 2  # input sets the timed calls cycle through: the case's own and one more


def input_sets(staged: StagedCase, cache: CaseCache, rotate: bool) -> InputSets | None:
    """The staged case's input tensors (and a paged case's pool) with the values of each set (made once per case
    and shared by its implementations through `cache`); None when the suite turned rotation off."""
    if not rotate:
        return None
    targets: tuple[Tensor, ...] = (staged.q, staged.k, staged.v)
    if staged.paged is not None:
        targets += (staged.paged.k_pages, staged.paged.v_pages)
    if cache.input_sets is None:
        cache.input_sets = [tuple(t.detach().clone() for t in targets)]
        assert cache.inputs is not None
        case = staged.case
        for index in range(1, SETS):
            values: tuple[Tensor, ...] = another_set(cache.inputs, case.inputs, case.inputs_shape(),
                                                     case.torch_dtype, case.device, index)
            if staged.paged is not None:
                lengths = staged.paged.kv_lens.tolist()
                pool = page_kv(values[1], values[2], staged.paged.page_size, lengths, case.seed)
                values += (pool.k_pages, pool.v_pages)
            cache.input_sets.append(values)
    return InputSets(targets, list(cache.input_sets))


def check_kept(prepared: PreparedCase, cache: CaseCache, sets: InputSets | None, kept: list[KeptCall],
               step: StepKind, full: bool) -> tuple[float | None, str | None]:
    """(worst rel_l2, problem or None) of the kept outputs against the oracle for each one's input set; the
    staged tensors hold set 0's values again afterwards."""
    worst: float | None = None
    problem: str | None = None
    try:
        for call in sorted(kept, key=lambda c: c.input_set):
            if sets is not None:
                sets.load(call.input_set)
            rel_l2, found = _check_one(prepared, cache, call, step, full)
            if rel_l2 is not None:
                worst = rel_l2 if worst is None else max(worst, rel_l2)
            if found and problem is None:
                problem = (f"a timed call's output differed from the float64 oracle for its own inputs (timed call "
                           f"{call.index + 1}, input set {call.input_set}): {found}; the first call's output "
                           "is not what was timed")
    finally:
        if sets is not None:
            sets.load(0)
    return worst, problem


def _check_one(prepared: PreparedCase, cache: CaseCache, call: KeptCall, step: StepKind, full: bool
               ) -> tuple[float | None, str | None]:
    s = prepared.staged
    out = split_output(call.output)[0]
    if not isinstance(out, Tensor) or tuple(out.shape) != s.case.q_shape():
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        return None, f"wrong output: got {got}, expected a tensor of shape {s.case.q_shape()}"
    if s.kind == "selected":
        selection = s.selection if step == "attention" else _selection_of(s, cache, call.input_set)
        assert selection is not None
        oracle = _oracle(cache, step, call.input_set)
        error, problem = check_selected(s.case, prepared.impl, s.pattern, selection, s.q, s.k, s.v, out, None,
                                        full, oracle)
    elif s.patterns is not None:
        error, problem = check_sequences(s.case, prepared.impl, s.patterns, s.q, s.k, s.v, out, full)
    else:
        error, problem = check_against_oracle(s.case, prepared.impl, s.pattern, s.q, s.k, s.v, out, None, full,
                                              _oracle(cache, step, call.input_set))
    return error.rel_l2, problem


def _oracle(cache: CaseCache, step: StepKind, input_set: int) -> OracleResults:
    """The oracle's answers for one input set: the first call's (`cache.oracle`) for set 0, kept per set and
    step otherwise."""
    if input_set == 0:
        return cache.oracle
    return cache.set_oracles.setdefault((step, input_set), OracleResults())


def _selection_of(staged: StagedCase, cache: CaseCache, input_set: int) -> Selection | None:
    """The selection the case's selector makes of one input set (the staged one for set 0), made once per case."""
    if input_set == 0 or staged.selector is None:
        return staged.selection
    if input_set not in cache.set_selections:
        case = staged.case
        chosen = run_selector(staged.selector, staged.q.detach(), staged.k.detach(), case)
        chosen.validate(case.batch, case.heads, case.n_kv_heads, case.n_queries, case.seq_len)
        cache.set_selections[input_set] = chosen
    return cache.set_selections[input_set]


@dataclass
class TimedSteps:
    """Every run of timed calls of one pair (the steps it times), on one timer, input sets and cache state."""

    timer: Timer
    sets: InputSets | None
    device: str
    cache: str  # cold | warm
    runs: list[tuple[StepKind | None, TimedCalls]] = field(default_factory=list)

    def calls(self, step: StepKind | None, policy: TimingPolicy) -> TimedCalls:
        """A run of timed calls of one step: fresh inputs and cold caches before each, the outputs of `step`'s
        calls to check kept (None: not checked), one drawn among the calls the policy surely makes."""
        calls = TimedCalls(self.timer, self.sets, evictor_for(self.device, self.cache), check_from=policy.warmup,
                           check_to=policy.warmup + policy.repeat)
        self.runs.append((step, calls))
        return calls

    def check(self, prepared: PreparedCase, case_cache: CaseCache, full: bool) -> tuple[TimingInfo, str | None]:
        """The kept outputs against the oracle for their own inputs: the record's `timing` and the first problem.
        The staged tensors hold set 0's values again afterwards (what the memory step, quality and the case's next
        implementation read)."""
        checked, worst, problem = 0, None, None
        for step, calls in self.runs:
            kept = calls.to_check() if step is not None else []
            if kept:
                rel_l2, found = check_kept(prepared, case_cache, self.sets, kept, step or "call", full)
                checked += len(kept)
                worst = rel_l2 if worst is None or (rel_l2 is not None and rel_l2 > worst) else worst
                problem = problem or found
            calls.release()
        if self.sets is not None:
            self.sets.load(0)
        info = timing_info(self.cache, self.device, self.sets, checked, [calls for _, calls in self.runs], worst)
        return info, problem
