"""The measurement of one (case, implementation) in this process: the one copy every caller uses.

The worker (`bench.run.worker`), `bench ab`'s blocks and `bench.api.run` measure through `PairSession`; each rank
(`bench.measure.ranks.rank`), `bench profile`, the pytest-benchmark entry in benchmarks/ and `bench.api.attention`
prepare through the same `bench.measure.case.prepare`. `_measure`, at the end, names the steps in their order, each a
call to its module. Any exception of the implementation becomes a `failed` record naming the phase, an output off
the oracle an `incorrect` one; nothing here raises for the implementation's faults.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch import Tensor

from bench import registry
from bench.errors import Unavailable
from bench.measure.case import flops as flop_counts
from bench.measure.case.case_cache import CaseCache, case_attention_stats
from bench.measure.case.prepare import PreparedCase, StagedCase, prepare_case, stage_case
from bench.measure.case.steps import (
    Phase,
    call_inputs,
    describe_failure,
    failure_kind,
    make_inputs,
    no_phase,
    policy_of,
    release_memory,
    skip_reason,
)
from bench.measure.cold import TimedCalls
from bench.measure.fresh_memory import FreshMemory, pair_memory
from bench.measure.machine.calibrate import gpu_identity, peak_for
from bench.measure.machine.contention import ContentionMeter, wait_for_quiet
from bench.measure.machine.env import cpu_features, device_description
from bench.measure.machine.nvml import device_monitor
from bench.measure.memory_model import does_not_fit
from bench.measure.oracle.grad_fidelity import case_fidelity
from bench.measure.oracle.numerics import strict_problem
from bench.measure.record_draft import RecordDraft
from bench.measure.step_timing import phase_medians, selected_times
from bench.measure.task import Task
from bench.measure.timed_check import StepKind, TimedSteps, input_sets
from bench.measure.timing import Timer, TimingPolicy, measure, summarize, timer_for
from bench.results.records import (
    DeviceState,
    MemoryInfo,
    Record,
    TimeStats,
)
from bench.results.store import utc_now
from bench.selection import SelectionError
from bench.spec.case import Case


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
        self.draft = RecordDraft()
        self.timer = timer
        self.current = "start"
        self.phases_s: dict[str, float] = {}  # wall seconds per phase, the harness's own cost beside the timing
        self._phase_t0 = self._t0
        self.staged: StagedCase | None = None  # the case as the implementation reads it (stage)
        self.prepared: PreparedCase | None = None
        self.problem: str | None = None
        self.samples: list[float] = []
        self.contention = ContentionMeter()  # over the timed calls only
        self.timed: TimedSteps | None = None  # the timed calls' inputs, caches and checks (bench.measure.cold)
        self.block_calls: TimedCalls | None = None  # bench ab's blocks: one run of calls across the blocks

    def _finish(self, **fields: Any) -> Record:
        if fields.get("status") == "failed":
            fields.setdefault("failure", "error")
        self._close_phase()
        return Record(case_id=self.task.case_id, impl=self.task.impl, params=self.task.params,
                      started_at=self.started, **{**dict(self.draft), **fields},
                      wall_s=time.perf_counter() - self._t0, phases_s=dict(self.phases_s))

    def failed(self, exc: BaseException) -> Record:
        """The failed record of an exception in the current phase (an out-of-memory one says so). The case's inputs
        get their own values back: a call that raised while timed may leave another set in them."""
        if self.timed is not None and self.timed.sets is not None:
            self.timed.sets.load(0)
        reason, details = describe_failure(self.current, exc)
        return self._finish(status="failed", reason=reason, details=details, failure=failure_kind(exc))

    def _phase(self, name: str) -> None:
        self._enter(name)
        self.phase(name)

    def _enter(self, name: str) -> None:
        """`name` is the current phase from now; the time since the last change goes to the phase it ends."""
        self._close_phase()
        self.current = name

    def _close_phase(self) -> None:
        now = time.perf_counter()
        self.phases_s[self.current] = self.phases_s.get(self.current, 0.0) + (now - self._phase_t0)
        self._phase_t0 = now

    # The steps before timing as `_measure` names them: each returns the final record if it ends the pair.
    EARLY_STEPS = ("skip", "inputs", "stage", "prepare", "check", "fidelity", "arm_timing")

    def open(self) -> Record | None:
        """Everything before timing (bench ab's sides time in blocks after it): a final Record when the pair
        cannot go on, else None."""
        for name in self.EARLY_STEPS:
            ended = getattr(self, name)()
            if ended is not None:
                return ended
        return None

    def skip(self) -> Record | None:
        """Skipped where the implementation cannot run here or this case, or the memory model says it cannot fit."""
        case, impl = self.case, self.impl
        reason = skip_reason(impl, case)
        if reason:
            return self._finish(status="skipped", reason=reason)
        self.draft.device = device_description(case.device)
        too_big = does_not_fit(impl, case, already_held=self.cache.input_bytes(case))
        if too_big is not None:
            reason, model = too_big
            memory = MemoryInfo(peak_bytes=model.total_bytes, method="model",
                                note="modelled lower bound; the case was not run")
            return self._finish(status="skipped", reason=reason, memory=memory)
        return None

    def inputs(self) -> Record | None:
        """The case's pattern and its figures, the seeded inputs, the attention statistics where asked."""
        return self._guarded(self._inputs)

    def _inputs(self) -> None:
        case, cache, draft = self.case, self.cache, self.draft
        self._phase("pattern")
        pattern = cache.for_case(case)
        draft.density, draft.block_density = pattern.density, pattern.block_density(case.block_size)
        draft.flops, draft.flops_dense = flop_counts.useful_flops(case, pattern.nnz), flop_counts.dense_flops(case)
        draft.bytes = flop_counts.min_bytes(case, flop_counts.pattern_kv_rows(case, pattern))
        self._phase("inputs")
        if cache.inputs is None:
            cache.inputs = make_inputs(case)
        draft.inputs = cache.inputs.info()
        if self.task.measure.attention_stats:
            self._enter("attention statistics")
            draft.attention_stats = case_attention_stats(case, pattern, cache)

    def stage(self) -> Record | None:
        """The case's kind staged (bench.measure.case.prepare.stage_case): a selection, a paged pool, plain inputs."""
        return self._guarded(self._stage)

    def _stage(self) -> None:
        q, k, v, grad_out = call_inputs(self.case, self.cache.inputs)
        self.staged = stage_case(self.case, self.cache.for_case(self.case), q, k, v, grad_out, self.cache,
                                 self._phase)
        self.draft.bytes = self.staged.bytes

    def prepare(self) -> Record | None:
        """The implementation's untimed setup and its first call (bench.measure.case.prepare.prepare_case)."""
        return self._guarded(self._prepare)

    def _prepare(self) -> None:
        assert self.staged is not None
        self._enter("prepare")
        self.prepared = prepare_case(self.impl, self.staged, self._phase)
        call = self.prepared.call
        self.draft.setup_s, self.draft.setup, self.draft.config = call.setup_s, call.setup, call.config
        self.draft.interpreter = bool((call.config or {}).get("interpreter", False))

    def _guarded(self, step: Callable[[], None]) -> Record | None:
        """Run a step that builds the case: an implementation's Unavailable is a skip, a selector's bad output and
        any other exception a failure naming the phase."""
        try:
            step()
        except Unavailable as exc:
            return self._finish(status="skipped", reason=exc.reason)
        except SelectionError as exc:
            return self._finish(status="failed", reason=f"invalid selection from selector {self.case.selector}: {exc}")
        except Exception as exc:
            if self.current == "pattern":
                self.cache.forget()  # a pattern that failed half-way is not kept for the next impl
            return self.failed(exc)
        return None

    def check(self) -> Record | None:
        """The first output's shape, then the output (and gradients) against the float64 oracle; an output off it
        makes the record `incorrect` but is still timed."""
        assert self.prepared is not None
        out, expected = self.prepared.output, self.case.q_shape()
        if not isinstance(out, Tensor) or tuple(out.shape) != expected:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            return self._finish(status="failed", reason=f"wrong output: got {got}, expected a tensor of shape "
                                                        f"{expected}")
        try:
            self._phase("check")
            started = time.perf_counter()
            self.draft.error, self.problem = self.prepared.check(self.task.measure.check, self.cache.oracle)
            self.problem = self.problem or strict_problem(self.draft.error, self.task.measure.numerics)
            self.draft.check_s = time.perf_counter() - started
        except Exception as exc:
            return self.failed(exc)
        return None

    def fidelity(self) -> Record | None:
        """A selection's fidelity to dense attention under the base pattern (bench.measure.oracle.grad_fidelity)."""
        staged = self.staged
        assert staged is not None
        if staged.selection is None or staged.selector is None:
            return None
        try:
            self._phase("fidelity")
            self.draft.fidelity = case_fidelity(staged, self.cache)
        except Exception as exc:
            return self.failed(exc)
        return None

    def arm_timing(self) -> Record | None:
        """The timer and the timed calls' input sets, caches and checks (bench.measure.timed_check)."""
        assert self.prepared is not None
        self.prepared.call.first_output = None  # checked: its memory goes back before timing
        if self.timer is None:
            self.timer = timer_for(self.case.device, self.task.measure.cache)
        try:
            sets = input_sets(self.prepared.staged, self.cache, self.task.measure.rotate)
        except Exception as exc:
            return self.failed(exc)
        if sets is not None:
            sets.after_load = self.prepared.call.refresh
        self.timed = TimedSteps(self.timer, sets, self.case.device, self.task.measure.cache)
        return None

    @property
    def step(self) -> Callable[[], Any]:
        assert self.prepared is not None
        return self.prepared.step

    def time(self) -> tuple[TimeStats, DeviceState | None]:
        """Adaptive timing per the suite's policy: (time_s, device state around it). Raises what the call raises."""
        assert self.timer is not None
        self._phase("timing")
        monitor = device_monitor(self.case.device)  # GPU clocks, temperature, throttling around the timing
        if monitor is not None:
            monitor.start()
        policy = policy_of(self.task.measure)
        if self.task.measure.wait_for_quiet_s > 0:
            self.contention.waited_s = wait_for_quiet(self.task.measure.wait_for_quiet_s)
        self.contention.start()
        selected = self.prepared is not None and self.prepared.steps is not None
        time_s = self._time_selected(policy) if selected else measure(self.step, policy, self.calls("call", policy))
        if self.case.mode == "fwd_bwd":
            self._time_phases(policy)
        self.contention.stop()
        self.check_timed()
        return time_s, monitor.stop() if monitor is not None else None

    def calls(self, step: StepKind | None, policy: TimingPolicy) -> TimedCalls:
        """A run of timed calls of one step (bench.measure.timed_check.TimedSteps)."""
        assert self.timed is not None
        return self.timed.calls(step, policy)

    def check_timed(self) -> None:
        """The kept outputs of the timed calls against the oracle for their own inputs; the record's `timing`."""
        assert self.prepared is not None and self.timed is not None
        self._phase("timed check")
        self.draft.timing, problem = self.timed.check(self.prepared, self.cache, self.task.measure.check)
        self.problem = self.problem or problem

    def _time_phases(self, policy: TimingPolicy) -> None:
        assert self.prepared is not None
        self.draft.time_fwd_s, self.draft.time_bwd_s = phase_medians(self.prepared, policy, self.calls)
        self.draft.flops_bwd = flop_counts.backward_flops(self.case, self.cache.for_case(self.case).nnz)

    def _time_selected(self, policy: TimingPolicy) -> TimeStats:
        assert self.prepared is not None
        density = self.draft.fidelity.density if self.draft.fidelity is not None else None
        end_to_end, self.draft.selection = selected_times(self.prepared, self.calls, policy, self.case,
                                                          self.cache, density)
        return end_to_end

    def warm_up(self, calls: int) -> None:
        if self.block_calls is None:  # the drawn call to check is one of the first blocks' (after the warm-up)
            self.block_calls = self.calls("call", TimingPolicy(warmup=calls, repeat=3))
        self._enter("warm-up")
        for _ in range(calls):
            self.block_calls.time_call(self.step)
        self.waiting()

    def waiting(self) -> None:
        """From now until the next phase the pair waits: the other side's turn in `bench ab`, or the runner."""
        self._enter("waiting")

    def block(self, calls: int, min_s: float = 0.0) -> list[float]:
        """`calls` timed calls (more until `min_s` has passed), for interleaved A/B rounds; kept for the record."""
        assert self.timer is not None
        self._enter("timing")
        if self.block_calls is None:
            self.block_calls = self.calls("call", TimingPolicy(warmup=0, repeat=3))
        samples: list[float] = []
        self.contention.start()
        start = self.timer.clock()
        while len(samples) < calls or self.timer.clock() - start < min_s:
            samples.append(self.block_calls.time_call(self.step))
        self.contention.stop()
        self.samples += samples
        self.waiting()
        return samples

    def close_blocks(self) -> Record:
        """The record of a pair timed in blocks (`bench ab`): every block's samples, the timed calls' check, then
        memory."""
        try:
            self.check_timed()
            memory = self.memory()
        except Exception as exc:
            return self.failed(exc)
        return self.record(summarize(self.samples, "blocks"), memory)

    def memory(self) -> MemoryInfo:
        assert self.prepared is not None
        self._phase("memory")
        staged = self.prepared.staged
        staged.q.grad = staged.k.grad = staged.v.grad = None  # freed inside the measured step, they'd hide its own
        started = time.perf_counter()
        try:
            return pair_memory(self.prepared, self.task, self.fresh)
        finally:
            self.draft.memory_s = time.perf_counter() - started


    def quality(self) -> None:
        """A model case: the model scored (and trained) with this implementation's attention and with the
        reference; a step that fails says why in its block and keeps the kernel's measurement."""
        if self.case.model is None:
            return
        from bench.measure.quality.model_step import score_model  # imports transformers

        self.draft.quality, self.draft.training = score_model(self.case, self.impl.name, self._phase)

    def record(self, time_s: TimeStats, memory: MemoryInfo | None, device_state: DeviceState | None = None
               ) -> Record:
        draft = self.draft
        flops_per_s = draft.flops / time_s.median if draft.flops is not None and time_s.median > 0 else None
        bytes_per_s = draft.bytes / time_s.median if draft.bytes is not None and time_s.median > 0 else None
        peak = peak_for(flops_per_s, self.case.dtype, self.case.device, self.impl.tf32(self.case),
                        self.task.measure.calibration, gpu_identity(self.case.device), bytes_per_s, draft.flops,
                        draft.bytes, self.task.measure.cache, cpu_features())
        return self._finish(status="incorrect" if self.problem else "ok", reason=self.problem, time_s=time_s,
                            memory=memory, flops_per_s=flops_per_s, env=device_state, peak=peak,
                            contention=self.contention.result(self.case.device, device_state))


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
    """One pair's measurement, top to bottom. Each step is a call to its module through the session, which keeps
    the record's draft and the time of each phase; a step that ends the pair returns its final record."""
    for step in (
        session.skip,  # unavailable here, an unsupported case, too big for the memory model: skipped
        session.inputs,  # the pattern and its figures, the seeded inputs (bench.measure.case.case_cache, bench.inputs)
        session.stage,  # a selection, a paged pool or plain inputs, as the case's kind says (prepare.stage_case)
        session.prepare,  # the implementation's setup and first call, untimed (prepare.prepare_case)
        session.check,  # the first output against the float64 oracle (prepare.PreparedCase.check)
        session.fidelity,  # a selection against dense attention (grad_fidelity)
        session.arm_timing,  # fresh input sets, cold caches, the timed calls to check (timed_check, cold)
    ):
        ended = step()
        if ended is not None:
            return ended
    try:
        time_s, device_state = session.time()  # the timed calls, then their kept outputs checked (timing)
        memory = session.memory()  # peak memory, in a fresh process on CPU where it can (fresh_memory)
        session.quality()  # a model case: the model with this attention against the reference (quality/)
    except Exception as exc:
        return session.failed(exc)
    return session.record(time_s, memory, device_state)  # the roof, contention, status: the Record
