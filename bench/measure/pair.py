"""The measurement of one (case, implementation) in this process: the one copy every caller uses.

The worker (`bench.run.worker`), each rank (`bench.measure.rank`), `bench profile`, the pytest-benchmark entry
in benchmarks/, `bench ab`'s blocks and `bench.api` all go through these steps, in this order:

1. `skip_reason` (bench.measure.steps): the implementation cannot run here or this case (a `skipped` record);
2. `CaseCache.for_case`: the case's pattern, its density and FLOPs (shared by the case's implementations);
3. `make_inputs`, then `prepare_call`: the implementation's untimed `prepare` and the first call, with the setup
   phases an implementation marks (`bench.registry.setup_phase`: mask building, compilation) timed apart;
4. `check_against_oracle` (bench.measure.check): the output (and dq, dk, dv in fwd_bwd) against the oracle;
5. timing (`bench.measure.timing`), in one adaptive run or in short blocks (`PairSession.block`);
6. memory (`bench.measure.memory`): on CPU, where the caller can, in a fresh process (`memory_alone`, run there by
   the worker's fork server, bench.run.forkserver), so that no earlier case moves the figure;
7. the `Record`.

Any exception of the implementation becomes a `failed` record naming the phase, an output off the oracle an
`incorrect` one; nothing here raises for the implementation's faults.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch import Tensor

from bench import registry
from bench.errors import Unavailable
from bench.measure import flops as flop_counts
from bench.measure.calibrate import gpu_identity, peak_for
from bench.measure.case_cache import CaseCache, case_attention_stats
from bench.measure.check import check_against_oracle
from bench.measure.contention import ContentionMeter, wait_for_quiet
from bench.measure.env import device_description
from bench.measure.fidelity import fidelity
from bench.measure.memory import measure_peak, track_allocations
from bench.measure.memory_model import does_not_fit
from bench.measure.nvml import device_monitor
from bench.measure.paged import case_paged, check_sequences, paged_kv_rows, prepare_paged_call, sequence_patterns
from bench.measure.selected import (
    SelectedSteps,
    case_selection,
    check_selected,
    prepare_selected_call,
    selected_steps,
    selection_kv_rows,
    selection_record,
    split_output,
)
from bench.measure.steps import (
    Phase,
    call_inputs,
    describe_failure,
    failure_kind,
    make_inputs,
    no_phase,
    policy_of,
    prepare_call,
    release_memory,
    skip_reason,
    timed_step,
)
from bench.measure.task import Task
from bench.measure.timing import Timer, TimingPolicy, measure, summarize, timer_for
from bench.results.records import Record
from bench.results.store import utc_now
from bench.selection import Selection, SelectionError, SelectorInfo
from bench.spec.case import Case

# {"answer": memory dict} from `memory_alone(task)` run in a fresh process, or {"error": why not}
FreshMemory = Callable[[Task], dict[str, Any]]

# --- one pair in this process --------------------------------------------------------------------------------


class PairSession:
    """One (case, impl) measured in this process: `open()`, then `time()` or `block()`s, `memory()`, `record()`.

    `open()` returns the final record when the pair ends before timing (skipped, failed, incorrect outputs are
    still timed: only a failure ends it early).
    """

    def __init__(self, task: Task, cache: CaseCache, phase: Phase = no_phase, timer: Timer | None = None,
                 fresh: FreshMemory | None = None) -> None:
        self.task, self.cache, self.phase, self.fresh = task, cache, phase, fresh
        self.case = Case(**task.case)
        self.impl = registry.get(task.impl)
        self.started, self._t0 = utc_now(), time.perf_counter()
        self.base: dict[str, Any] = {"case_id": task.case_id, "impl": task.impl, "params": task.params,
                                     "started_at": self.started}
        self.timer = timer
        self.current = "start"
        self.step: Callable[[], Any] | None = None
        self.q: Tensor | None = None
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.samples: list[float] = []
        self.contention = ContentionMeter()  # over the timed calls only
        self.selected: tuple[SelectorInfo, Selection, SelectedSteps] | None = None

    def _finish(self, **fields: Any) -> Record:
        if fields.get("status") == "failed":
            fields.setdefault("failure", "error")
        return Record(**{**self.base, **fields, "wall_s": time.perf_counter() - self._t0})

    def failed(self, exc: BaseException) -> Record:
        """The failed record of an exception in the current phase (an out-of-memory one says so)."""
        reason, details = describe_failure(self.current, exc)
        return self._finish(status="failed", reason=reason, details=details, failure=failure_kind(exc))

    def open(self) -> Record | None:
        """Everything before timing; a final Record when the pair cannot go on, else None."""
        case, impl, cache = self.case, self.impl, self.cache
        reason = skip_reason(impl, case)
        if reason:
            return self._finish(status="skipped", reason=reason)
        self.base["device"] = device_description(case.device)
        too_big = does_not_fit(impl, case, already_held=cache.input_bytes(case))
        if too_big is not None:
            reason, model = too_big
            memory = {"peak_bytes": model.total_bytes, "method": "model",
                      "note": "modelled lower bound; the case was not run"}
            return self._finish(status="skipped", reason=reason, memory=memory)
        try:
            self.current = "pattern"
            self.phase(self.current)
            pattern = cache.for_case(case)
            self.base.update(density=pattern.density, block_density=pattern.block_density(case.block_size),
                             flops=flop_counts.useful_flops(case, pattern.nnz),
                             flops_dense=flop_counts.dense_flops(case),
                             bytes=flop_counts.min_bytes(case, flop_counts.pattern_kv_rows(case, pattern)))
            self.current = "inputs"
            self.phase(self.current)
            if cache.inputs is None:
                cache.inputs = make_inputs(case)
            self.base["inputs"] = cache.inputs.info()
            q, k, v, grad_out = call_inputs(case, cache.inputs)
            if self.task.measure.attention_stats:
                self.current = "attention statistics"
                self.base["attention_stats"] = case_attention_stats(case, pattern, cache)
            patterns = None  # sequences of their own lengths (a paged cache's kv_lens)
            if case.selector is not None:
                self.current = "selection"
                info, selection = case_selection(case, q, k, cache.oracle)
                self.current = "prepare"
                attend, prepared = prepare_selected_call(impl, case, pattern, q, k, v, selection, self._phase)
            elif case.page_size is not None:
                self.current = "paging"
                paged = case_paged(case, cache.inputs, cache.oracle)
                patterns = sequence_patterns(case, paged)
                self.base["bytes"] = flop_counts.min_bytes(case, paged_kv_rows(case, pattern, patterns))
                self.current = "prepare"
                prepared = prepare_paged_call(impl, case, pattern, q, k, v, paged, patterns, self._phase)
            else:
                self.current = "prepare"
                prepared = prepare_call(impl, case, pattern, q, k, v, self._phase)
        except Unavailable as exc:
            return self._finish(status="skipped", reason=exc.reason)
        except SelectionError as exc:
            return self._finish(status="failed", reason=f"invalid selection from selector {case.selector}: {exc}")
        except Exception as exc:
            if self.current == "pattern":
                cache.key = None  # a pattern that failed half-way is not kept for the next impl
            return self.failed(exc)
        self.base.update(setup_s=prepared.setup_s, setup=prepared.setup, config=prepared.config,
                         interpreter=bool((prepared.config or {}).get("interpreter", False)))
        result = prepared.first_output
        out = split_output(result)[0] if case.selector is not None else result
        expected = case.q_shape()
        if not isinstance(out, Tensor) or tuple(out.shape) != expected:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            return self._finish(status="failed", reason=f"wrong output: got {got}, expected a tensor of shape "
                                                        f"{expected}")
        try:
            self.current = "check"
            self.phase(self.current)
            started = time.perf_counter()
            if case.selector is not None:
                self.error, self.problem = check_selected(case, impl, pattern, selection, q, k, v, result,
                                                          grad_out, full=self.task.measure.check,
                                                          oracle=cache.oracle)
            elif patterns is not None:
                self.error, self.problem = check_sequences(case, impl, patterns, q, k, v, out,
                                                           full=self.task.measure.check)
            else:
                self.error, self.problem = check_against_oracle(case, impl, pattern, q, k, v, out, grad_out,
                                                                full=self.task.measure.check, oracle=cache.oracle)
            self.base["check_s"] = time.perf_counter() - started
            if case.selector is not None:
                self.current = "fidelity"
                self.phase(self.current)
                if "fidelity" not in cache.oracle:
                    assert cache.inputs is not None
                    cache.oracle["fidelity"] = fidelity(selection, pattern, cache.inputs, case.seed)
                self.base["fidelity"] = cache.oracle["fidelity"]
        except Exception as exc:
            return self.failed(exc)
        del out, result, prepared.first_output
        self.q, self.k, self.v = q, k, v
        if case.selector is not None:
            self.selected = (info, selection, selected_steps(info, case, attend, selection, q, k, v, grad_out))
            self.step = self.selected[2].end_to_end
        else:
            self.step = timed_step(prepared.fn, q, k, v, grad_out)
        if self.timer is None:
            self.timer = timer_for(case.device)
        return None

    def _phase(self, name: str) -> None:
        self.current = name
        self.phase(name)

    def time(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Adaptive timing per the suite's policy: (time_s, device state around it). Raises what the call raises."""
        assert self.step is not None and self.timer is not None
        self.current = "timing"
        self.phase(self.current)
        monitor = device_monitor(self.case.device)  # GPU clocks, temperature, throttling around the timing
        if monitor is not None:
            monitor.start()
        policy = policy_of(self.task.measure)
        if self.task.measure.wait_for_quiet_s > 0:
            self.contention.waited_s = wait_for_quiet(self.task.measure.wait_for_quiet_s)
        self.contention.start()
        time_s = self._time_selected(policy) if self.selected is not None else measure(self.step, policy, self.timer)
        self.contention.stop()
        return time_s, monitor.stop() if monitor is not None else None

    def _time_selected(self, policy: TimingPolicy) -> dict[str, Any]:
        """The selector alone, the attention over the fixed selection, and end to end (the pair's time_s)."""
        assert self.selected is not None and self.timer is not None
        info, selection, steps = self.selected
        # a reference selector computes dense attention: one call says what it costs, once per case (its time
        # does not depend on the implementation that attends over its selection)
        once = TimingPolicy(warmup=0, repeat=1, max_time_s=1e-9) if info.reference else policy
        if info.reference and "reference_selector_time" in self.cache.oracle:
            selector_time = self.cache.oracle["reference_selector_time"]
        else:
            selector_time = measure(steps.selector, once, self.timer)
            if info.reference:
                self.cache.oracle["reference_selector_time"] = selector_time
        attention_time = measure(steps.attention, policy, self.timer)
        end_to_end = measure(steps.end_to_end, once, self.timer)
        fid = self.base.get("fidelity") or {}
        pattern = self.cache.pattern
        if pattern is not None:  # the bytes of what the selection keeps, not of the whole base
            rows = selection_kv_rows(selection, pattern, self.case.heads, self.case.n_kv_heads)
            self.base["bytes"] = flop_counts.min_bytes(self.case, rows)
        self.base["selection"] = selection_record(info, self.case, selection, fid.get("density"), selector_time,
                                                  attention_time, end_to_end)
        return end_to_end

    def warm_up(self, calls: int) -> None:
        assert self.step is not None and self.timer is not None
        for _ in range(calls):
            self.timer.time_call(self.step)

    def block(self, calls: int, min_s: float = 0.0) -> list[float]:
        """`calls` timed calls (more until `min_s` has passed), for interleaved A/B rounds; kept for the record."""
        assert self.step is not None and self.timer is not None
        self.current = "timing"
        samples: list[float] = []
        self.contention.start()
        start = self.timer.clock()
        while len(samples) < calls or self.timer.clock() - start < min_s:
            samples.append(self.timer.time_call(self.step))
        self.contention.stop()
        self.samples += samples
        return samples

    def close_blocks(self) -> Record:
        """The record of a pair timed in blocks (`bench ab`): every block's samples, then memory."""
        try:
            memory = self.memory()
        except Exception as exc:
            return self.failed(exc)
        return self.record(summarize(self.samples, "blocks"), memory)

    def memory(self) -> dict[str, Any]:
        assert self.step is not None and self.q is not None and self.k is not None and self.v is not None
        self.current = "memory"
        self.phase(self.current)
        self.q.grad = self.k.grad = self.v.grad = None  # freed inside the measured step, they would hide its own
        started = time.perf_counter()
        try:
            return self._memory()
        finally:
            self.base["memory_s"] = time.perf_counter() - started

    def _memory(self) -> dict[str, Any]:
        assert self.step is not None
        note = None
        if self.fresh is not None and self.case.device == "cpu" and self.task.measure.memory == "fresh":
            fresh = self.fresh(self.task)
            if "answer" in fresh:
                return fresh["answer"]
            note = f"measured in the worker after earlier cases: the fresh process failed ({fresh['error']})"
        measured = measure_peak(self.step, self.case.device)
        if measured["method"] != "rss_hwm":
            return measured
        return {**measured, "process": "shared", "note": measured["note"] or note}

    def record(self, time_s: dict[str, Any], memory: dict[str, Any] | None,
               device_state: dict[str, Any] | None = None) -> Record:
        flops_per_s = self.base["flops"] / time_s["median"] if time_s["median"] > 0 else None
        moved = self.base.get("bytes")
        bytes_per_s = moved / time_s["median"] if moved is not None and time_s["median"] > 0 else None
        peak = peak_for(flops_per_s, self.case.dtype, self.case.device, self.impl.tf32(self.case),
                        self.task.measure.calibration, gpu_identity(self.case.device), bytes_per_s,
                        self.base["flops"], moved)
        status = "incorrect" if self.problem else "ok"
        return self._finish(status=status, reason=self.problem, time_s=time_s, memory=memory, error=self.error,
                            flops_per_s=flops_per_s, env=device_state, peak=peak,
                            contention=self.contention.result(self.case.device, device_state))


def memory_alone(task_json: dict[str, Any]) -> dict[str, Any]:
    """The task's memory figure (PairSession.memory's) measured in this process as its only case: pattern,
    inputs, prepare and the first call (plans, buffers and compiled code made; in fwd_bwd one more step, so that
    the backward has run once too), then the measured call, every large allocation mapped afresh from the start
    (`track_allocations`). Run in a fresh process (bench.run.forkserver); raises what the implementation raises."""
    task = Task.model_validate(task_json)
    case = Case(**task.case)
    if case.device == "cpu":
        track_allocations()  # no large free chunk on the heap for the measured call to reuse
    impl = registry.get(task.impl)
    pattern = case.make_pattern()
    q, k, v, grad_out = call_inputs(case)
    if case.page_size is not None:  # through the pool (or gathered from it inside the call)
        made = make_inputs(case)
        q, k, v = made.tensors
        paged = case_paged(case, made, {})
        prepared = prepare_paged_call(impl, case, pattern, q, k, v, paged, sequence_patterns(case, paged), no_phase)
        step = prepared.fn
    elif case.selector is not None:  # end to end: the selector, then the attention over what it chose
        info, selection = case_selection(case, q, k, {})
        attend, prepared = prepare_selected_call(impl, case, pattern, q, k, v, selection, no_phase)
        step = selected_steps(info, case, attend, selection, q, k, v, grad_out).end_to_end
    else:
        prepared = prepare_call(impl, case, pattern, q, k, v)
        step = timed_step(prepared.fn, q, k, v, grad_out)
    del prepared
    if grad_out is not None:
        step()  # the first call ran forward only: the measured one is not the first backward
    q.grad = k.grad = v.grad = None
    return {**measure_peak(step, case.device), "process": "fresh"}


def measure_task(task: Task, cache: CaseCache, phase: Phase = no_phase, fresh: FreshMemory | None = None
                 ) -> Record:
    """Measure one (case, impl) as `bench run` does; never raises for problems of the implementation.

    After an out-of-memory failure the memory the failed call left behind is released here, once its frames
    are gone, so that the next (case, impl) in this worker starts from a clean device.
    """
    session = PairSession(task, cache, phase, fresh=fresh)
    record = _measure(session)
    if record.failure == "out_of_memory":
        release_memory(session.case.device)
    return record


def _measure(session: PairSession) -> Record:
    final = session.open()
    if final is not None:
        return final
    try:
        time_s, device_state = session.time()
        memory = session.memory()
    except Exception as exc:
        return session.failed(exc)
    return session.record(time_s, memory, device_state)
