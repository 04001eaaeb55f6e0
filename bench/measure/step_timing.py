"""The timings of a step's parts beyond the pair's `time_s`: a fwd_bwd step's forward and backward apart, and a
selection's selector, attention and end-to-end times (used by bench.measure.pair).

Every part is timed through the pair's `TimedCalls` (bench.measure.cold: fresh inputs and cold caches before each
call); `calls_for(step, policy)` gives one per timed part, keeping the outputs of the steps it names for the check.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from bench.measure.case.case_cache import CaseCache
from bench.measure.case.prepare import PreparedCase
from bench.measure.case.selected import selection_record
from bench.measure.cold import TimedCalls
from bench.measure.timed_check import StepKind
from bench.measure.timing import TimingPolicy, measure, summarize
from bench.results.records import SelectionInfo, TimeStats
from bench.spec.case import Case

CallsFor = Callable[[StepKind | None, TimingPolicy], TimedCalls]  # None: outputs not checked


def phase_medians(prepared: PreparedCase, policy: TimingPolicy, calls_for: CallsFor) -> tuple[float, float]:
    """A fwd_bwd step's medians (forward alone, backward alone): each backward sample's forward run untimed before
    it on fresh inputs, the caches evicted between them (as many samples as the policy asks, within its time
    budget)."""
    staged, forward = prepared.staged, prepared.forward
    forward_median = measure(forward, policy, calls_for(None, policy)).median
    calls = calls_for(None, policy)
    samples: list[float] = []
    start = calls.clock()
    while len(samples) < policy.repeat or (calls.clock() - start < policy.max_time_s
                                           and len(samples) < policy.max_samples):
        staged.q.grad = staged.k.grad = staged.v.grad = None
        calls.before_call()  # fresh inputs for the forward, untimed
        out: Tensor = forward()
        if calls.evict is not None:
            calls.evict()

        def backward(out: Tensor = out) -> None:
            out.backward(staged.grad_out)

        samples.append(calls.timer.time_call(backward))
    calls.release()
    return forward_median, summarize(samples).median


def selected_times(prepared: PreparedCase, calls_for: CallsFor, policy: TimingPolicy, case: Case, cache: CaseCache,
                   density: float | None) -> tuple[TimeStats, SelectionInfo]:
    """The selector alone, the attention over the fixed selection, and end to end (the pair's time_s)."""
    staged, steps = prepared.staged, prepared.steps
    assert steps is not None and staged.selector is not None and staged.selection is not None
    # a reference selector computes dense attention: one call says what it costs, once per case (its time
    # does not depend on the implementation that attends over its selection)
    reference = staged.selector.reference
    once = TimingPolicy(warmup=0, repeat=1, max_time_s=1e-9) if reference else policy
    if reference and cache.reference_selector_time is not None:
        selector_time = cache.reference_selector_time
    else:
        selector_time = measure(steps.selector, once, calls_for(None, once))
        if reference:
            cache.reference_selector_time = selector_time
    attention_time = measure(steps.attention, policy, calls_for("attention", policy))
    end_to_end = measure(steps.end_to_end, once, calls_for("call", once))
    info = selection_record(staged.selector, case, staged.selection, density, selector_time, attention_time,
                            end_to_end)
    return end_to_end, info
