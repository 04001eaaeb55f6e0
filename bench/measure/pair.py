"""The measurement of one (case, implementation) in this process: the one copy every caller uses.

The worker (`bench.run.worker`), each rank (`bench.measure.rank`), `bench profile`, the pytest-benchmark entry
in benchmarks/, `bench ab`'s blocks and `bench.api` all go through these steps, in this order:

1. `skip_reason`: the implementation cannot run here or this case (a `skipped` record);
2. `CaseCache.for_case`: the case's pattern, its density and FLOPs (shared by the case's implementations);
3. `make_inputs`, then `prepare_call`: the implementation's untimed `prepare` and the first call, with the setup
   phases an implementation marks (`bench.registry.setup_phase`: mask building, compilation) timed apart;
4. `check_against_oracle`: the output (and dq, dk, dv in fwd_bwd) against the float64 oracle;
5. timing (`bench.measure.timing`), in one adaptive run or in short blocks (`PairSession.block`);
6. memory (`bench.measure.memory`);
7. the `Record`.

Any exception of the implementation becomes a `failed` record naming the phase, an output off the oracle an
`incorrect` one; nothing here raises for the implementation's faults.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bench import registry
from bench.errors import Unavailable
from bench.measure import flops as flop_counts
from bench.measure.calibrate import gpu_identity, peak_for
from bench.measure.env import device_description
from bench.measure.memory import measure_peak
from bench.measure.memory_model import does_not_fit
from bench.measure.nvml import device_monitor
from bench.measure.reference import compare, reference_attention, rows_to_check, tolerance_for
from bench.measure.task import Task
from bench.measure.timing import Timer, TimingPolicy, measure, summarize, timer_for
from bench.patterns import Pattern
from bench.registry import SetupClock
from bench.results.records import Record, SetupTimes
from bench.results.store import utc_now
from bench.spec.case import Case

Phase = Callable[[str], None]


def _no_phase(name: str) -> None:
    return None


# --- the steps ---------------------------------------------------------------------------------------------


def skip_reason(impl: registry.Impl, case: Case) -> str | None:
    """Why this (case, impl) is not measured here, or None."""
    reason = impl.unavailable() or impl.unsupported(case)
    if reason is None and case.device == "cuda" and not torch.cuda.is_available():
        reason = "no CUDA device visible"
    return reason


def make_inputs(case: Case, salt: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Seeded q (B, H, q_len, D) and k, v (B, Hkv, N, D): standard normal, drawn in float32 on the device, then
    cast."""
    device = torch.device(case.device)
    gen = torch.Generator(device=device).manual_seed(case.seed * 1_000_003 + salt)
    return tuple(  # type: ignore[return-value]
        torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(case.torch_dtype)
        for shape in (case.q_shape(), case.kv_shape(), case.kv_shape())
    )


def upstream_grad(case: Case) -> Tensor:
    """The seeded gradient of the output that backward starts from."""
    return make_inputs(case, salt=7)[0]


def sync_device(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that a clock read after it is honest."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def checkpointed(fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """Seed 004's gradient checkpointing: keep no activations, recompute attention in backward."""
    from torch.utils.checkpoint import checkpoint

    return lambda: checkpoint(fn, use_reentrant=False)


@dataclass
class Prepared:
    """An implementation's timed call for one case, after its first call."""

    fn: Callable[[], Any]
    first_output: Any
    setup_s: float  # prepare + the first call
    setup: SetupTimes
    config: dict[str, Any] | None


def prepare_call(impl: registry.Impl, case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor,
                 phase: Phase = _no_phase) -> Prepared:
    """`impl.prepare` (untimed setup) and the first call; the implementation's marked phases timed apart.

    The implementation gets a fresh copy of the pattern, so building its views counts as its own mask time
    (the harness's copy, shared by the case's implementations, has them cached). Raises what they raise.
    """
    clock = SetupClock()
    t0 = time.perf_counter()
    with clock:
        phase("prepare")
        fn = impl.prepare(case, pattern.fresh(), q, k, v)
        if case.checkpoint:
            fn = checkpointed(fn)
        phase("first call")
        first_start = time.perf_counter()
        marked_before = clock.marked_s()
        out = fn()
        sync_device(case.device)
        first_s = time.perf_counter() - first_start - (clock.marked_s() - marked_before)
    setup = SetupTimes(mask_s=clock.total("mask"), compile_s=clock.total("compile"), first_call_s=first_s)
    return Prepared(fn, out, time.perf_counter() - t0, setup, impl.record_extras() or None)


def timed_step(fn: Callable[[], Tensor], q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor | None,
               upstream: Callable[[Tensor], Tensor] | None = None) -> Callable[[], Any]:
    """What is timed: the call, or in fwd_bwd the call and its backward from `grad_out`.

    `upstream(result)` picks the part of grad_out matching what the call returned (a rank's shard).
    """
    if grad_out is None:
        return fn

    def fwd_bwd() -> None:
        q.grad = k.grad = v.grad = None
        result = fn()
        result.backward(grad_out if upstream is None else upstream(result))

    return fwd_bwd


def policy_of(measure_settings: Any) -> TimingPolicy:
    return TimingPolicy(warmup=measure_settings.warmup, repeat=measure_settings.repeat,
                        max_time_s=measure_settings.max_time_s)


def describe_failure(phase: str, exc: BaseException) -> tuple[str, str]:
    """(one-line reason, traceback tail) for a failed record."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    kind = "out of memory" if is_out_of_memory(exc) else type(exc).__name__
    reason = f"{kind} during {phase}: {first}" if first else f"{kind} during {phase}"
    details = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-12:])[-4000:]
    return reason, details


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the plain RuntimeError torch's CPU allocator raises."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def release_memory(device: str, torch_module: Any = None) -> None:
    """Collect reference cycles (tracebacks keep frames, frames keep tensors) and return cached CUDA blocks."""
    gc.collect()
    if device.startswith("cuda"):
        cuda = (torch_module or torch).cuda
        cuda.synchronize()
        cuda.empty_cache()
        cuda.reset_peak_memory_stats()


# --- correctness -------------------------------------------------------------------------------------------


def _problem(what: str, rel_l2: float | None, tol: float, nonfinite: int) -> str:
    if nonfinite:
        return f"{what} has {nonfinite} NaN/Inf values"
    return f"{what} off the float64 oracle: rel_l2 {rel_l2:.3g} > tolerance {tol:g}"


def checked_rows(case: Case) -> Tensor:
    return rows_to_check(case.batch, case.heads, case.seq_len, seed=case.seed, q_len=case.n_queries)


def rows_only(case: Case, grad_out: Tensor, rows: Tensor) -> Tensor:
    """The upstream gradient on the checked rows only: the full problem's dq, dk, dv then equal the oracle's."""
    row_mask = torch.zeros(case.n_queries, dtype=torch.bool, device=grad_out.device)
    row_mask[rows.to(grad_out.device)] = True
    return grad_out * row_mask[:, None].to(grad_out.dtype)


def nonfinite_only(out: Tensor, tol: float) -> tuple[dict[str, Any], str | None]:
    """With `check: false`: only NaN and Inf are looked for."""
    nonfinite = int((~torch.isfinite(out.detach())).sum())
    error = {"max_abs": None, "rel_l2": None, "tolerance": tol, "rows_checked": 0, "nonfinite": nonfinite}
    return error, (f"output has {nonfinite} NaN/Inf values" if nonfinite else None)


def oracle_errors(case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor, out: Tensor, tol: float,
                  grads: tuple[Tensor | None, ...] | None = None, g: Tensor | None = None,
                  oracle: dict[str, Any] | None = None) -> tuple[dict[str, Any], str | None]:
    """(error, problem or None) of the full output `out` (and of `grads` = dq, dk, dv for upstream gradient g on
    the checked rows) against the float64 oracle. `oracle` caches its results for the case's next impls."""
    oracle = {} if oracle is None else oracle
    rows = checked_rows(case)
    if "out" not in oracle:
        with torch.no_grad():
            oracle["out"] = reference_attention(q.detach(), k.detach(), v.detach(), pattern, rows)
    stats = compare(out.detach()[:, :, rows.to(out.device)], oracle["out"], tol)
    error: dict[str, Any] = {"max_abs": stats.max_abs, "rel_l2": stats.rel_l2, "tolerance": tol,
                             "rows_checked": stats.rows_checked, "nonfinite": stats.nonfinite}
    problem = None if stats.passed else _problem("output", stats.rel_l2, tol, stats.nonfinite)
    if grads is not None and g is not None:
        if "grads" not in oracle:
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = reference_attention(*leaves, pattern, rows)
            oracle["grads"] = torch.autograd.grad(ref, leaves, g[:, :, rows.to(g.device)].double())
        error["grads"] = {}
        for name, actual, expected in zip(("dq", "dk", "dv"), grads, oracle["grads"], strict=True):
            s = compare(torch.zeros_like(expected) if actual is None else actual, expected, tol)
            error["grads"][name] = {"max_abs": s.max_abs, "rel_l2": s.rel_l2, "tolerance": tol,
                                    "nonfinite": s.nonfinite}
            if problem is None and not s.passed:
                problem = _problem(name, s.rel_l2, tol, s.nonfinite)
    return error, problem


def check_against_oracle(case: Case, impl: registry.Impl, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor,
                         out: Tensor, grad_out: Tensor | None, full: bool, oracle: dict[str, Any] | None = None
                         ) -> tuple[dict[str, Any], str | None]:
    """(error, problem or None) of one process's output (and gradients) against the float64 oracle."""
    tol = tolerance_for(case.dtype, impl.tf32(case))
    if not full:
        return nonfinite_only(out, tol)
    grads, g = None, None
    if grad_out is not None:
        g = rows_only(case, grad_out, checked_rows(case))
        grads = torch.autograd.grad(out, (q, k, v), g, allow_unused=True)
    return oracle_errors(case, pattern, q, k, v, out, tol, grads, g, oracle)


# --- one pair in this process --------------------------------------------------------------------------------


@dataclass
class CaseCache:
    """Pattern, inputs and oracle of the case measured last, shared by its implementations."""

    key: str | None = None
    pattern: Pattern | None = None
    inputs: tuple[Tensor, Tensor, Tensor] | None = None
    oracle: dict[str, Any] = field(default_factory=dict)

    def input_bytes(self, case: Case) -> int:
        """Bytes of this case's inputs already allocated (0 when another case's are cached)."""
        if self.key != f"{case.case_id}@{case.device}" or self.inputs is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.inputs)

    def for_case(self, case: Case) -> Pattern:
        key = f"{case.case_id}@{case.device}"
        if key != self.key or self.pattern is None:
            self.key, self.pattern, self.inputs, self.oracle = None, None, None, {}
            self.pattern = case.make_pattern()
            self.key = key
        return self.pattern


class PairSession:
    """One (case, impl) measured in this process: `open()`, then `time()` or `block()`s, `memory()`, `record()`.

    `open()` returns the final record when the pair ends before timing (skipped, failed, incorrect outputs are
    still timed: only a failure ends it early).
    """

    def __init__(self, task: Task, cache: CaseCache, phase: Phase = _no_phase, timer: Timer | None = None) -> None:
        self.task, self.cache, self.phase = task, cache, phase
        self.case = Case(**task.case)
        self.impl = registry.get(task.impl)
        self.started, self._t0 = utc_now(), time.perf_counter()
        self.base: dict[str, Any] = {"case_id": task.case_id, "impl": task.impl, "params": task.params,
                                     "started_at": self.started}
        self.timer = timer
        self.current = "start"
        self.step: Callable[[], Any] | None = None
        self.q = self.k = self.v = None
        self.samples: list[float] = []

    def _finish(self, **fields: Any) -> Record:
        if fields.get("status") == "failed":
            fields.setdefault("failure", "error")
        return Record(**{**self.base, **fields, "wall_s": time.perf_counter() - self._t0})

    def failed(self, exc: BaseException) -> Record:
        """The failed record of an exception in the current phase (an out-of-memory one says so)."""
        reason, details = describe_failure(self.current, exc)
        return self._finish(status="failed", reason=reason, details=details,
                            failure="out_of_memory" if is_out_of_memory(exc) else "error")

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
                             flops_dense=flop_counts.dense_flops(case))
            self.current = "inputs"
            self.phase(self.current)
            if cache.inputs is None:
                cache.inputs = make_inputs(case)
            q, k, v = (t.detach().requires_grad_(case.mode == "fwd_bwd") for t in cache.inputs)
            grad_out = upstream_grad(case) if case.mode == "fwd_bwd" else None
            self.current = "prepare"
            prepared = prepare_call(impl, case, pattern, q, k, v, self._phase)
        except Unavailable as exc:
            return self._finish(status="skipped", reason=exc.reason)
        except Exception as exc:
            if self.current == "pattern":
                cache.key = None  # a pattern that failed half-way is not kept for the next impl
            return self.failed(exc)
        self.base.update(setup_s=prepared.setup_s, setup=prepared.setup, config=prepared.config,
                         interpreter=bool((prepared.config or {}).get("interpreter", False)))
        out = prepared.first_output
        expected = case.q_shape()
        if not isinstance(out, Tensor) or tuple(out.shape) != expected:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            return self._finish(status="failed", reason=f"wrong output: got {got}, expected a tensor of shape "
                                                        f"{expected}")
        try:
            self.current = "check"
            self.phase(self.current)
            self.error, self.problem = check_against_oracle(case, impl, pattern, q, k, v, out, grad_out,
                                                            full=self.task.measure.check, oracle=cache.oracle)
        except Exception as exc:
            return self.failed(exc)
        del out, prepared.first_output
        self.q, self.k, self.v = q, k, v
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
        time_s = measure(self.step, policy_of(self.task.measure), self.timer)
        return time_s, monitor.stop() if monitor is not None else None

    def warm_up(self, calls: int) -> None:
        assert self.step is not None and self.timer is not None
        for _ in range(calls):
            self.timer.time_call(self.step)

    def block(self, calls: int, min_s: float = 0.0) -> list[float]:
        """`calls` timed calls (more until `min_s` has passed), for interleaved A/B rounds; kept for the record."""
        assert self.step is not None and self.timer is not None
        self.current = "timing"
        samples: list[float] = []
        start = self.timer.clock()
        while len(samples) < calls or self.timer.clock() - start < min_s:
            samples.append(self.timer.time_call(self.step))
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
        assert self.step is not None and self.q is not None
        self.current = "memory"
        self.phase(self.current)
        self.q.grad = self.k.grad = self.v.grad = None  # freed inside the measured step, they would hide its own
        return measure_peak(self.step, self.case.device)

    def record(self, time_s: dict[str, Any], memory: dict[str, Any] | None,
               device_state: dict[str, Any] | None = None) -> Record:
        flops_per_s = self.base["flops"] / time_s["median"] if time_s["median"] > 0 else None
        peak = peak_for(flops_per_s, self.case.dtype, self.case.device, self.impl.tf32(self.case),
                        self.task.measure.calibration, gpu_identity(self.case.device))
        status = "incorrect" if self.problem else "ok"
        return self._finish(status=status, reason=self.problem, time_s=time_s, memory=memory, error=self.error,
                            flops_per_s=flops_per_s, env=device_state, peak=peak)


def measure_task(task: Task, cache: CaseCache, phase: Phase = _no_phase) -> Record:
    """Measure one (case, impl) as `bench run` does; never raises for problems of the implementation.

    After an out-of-memory failure the memory the failed call left behind is released here, once its frames
    are gone, so that the next (case, impl) in this worker starts from a clean device.
    """
    session = PairSession(task, cache, phase)
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
