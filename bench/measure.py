"""Measure one (case, implementation) in this process: inputs, prepare, check, time, memory, FLOPs.

This runs inside a worker process (bench.worker) that the runner can kill and replace; any exception here
becomes a `failed` record, an output off the oracle an `incorrect` one.
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

from bench import flops as flop_counts
from bench import registry
from bench.calibrate import gpu_identity, peak_for
from bench.case import Case
from bench.env import device_description
from bench.errors import Unavailable
from bench.memory import measure_peak
from bench.memory_model import does_not_fit
from bench.nvml import device_monitor
from bench.patterns import Pattern
from bench.records import Record
from bench.reference import compare, reference_attention, rows_to_check, tolerance_for
from bench.store import utc_now
from bench.timing import TimingPolicy, measure, timer_for

Phase = Callable[[str], None]


@dataclass
class Task:
    """What the runner asks a worker to measure. `case` has its device resolved; `params` are as written."""

    case: dict[str, Any]
    case_id: str
    params: dict[str, Any]
    impl: str
    measure: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"case": self.case, "case_id": self.case_id, "params": self.params, "impl": self.impl,
                "measure": self.measure}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Task:
        return cls(obj["case"], obj["case_id"], obj["params"], obj["impl"], obj["measure"])


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

    def for_case(self, case: Case) -> None:
        key = f"{case.case_id}@{case.device}"
        if key != self.key:
            self.key, self.pattern, self.inputs, self.oracle = key, case.make_pattern(), None, {}


def make_inputs(case: Case, salt: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Seeded q (B, H, q_len, D) and k, v (B, Hkv, N, D): standard normal, drawn in float32 on the device,
    then cast."""
    device = torch.device(case.device)
    gen = torch.Generator(device=device).manual_seed(case.seed * 1_000_003 + salt)
    return tuple(  # type: ignore[return-value]
        torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(case.torch_dtype)
        for shape in (case.q_shape(), case.kv_shape(), case.kv_shape())
    )


def upstream_grad(case: Case) -> Tensor:
    """The seeded gradient of the output that backward starts from."""
    return make_inputs(case, salt=7)[0]


def is_out_of_memory(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    return "out of memory" in str(exc).lower()


def describe_failure(phase: str, exc: BaseException) -> tuple[str, str]:
    """(one-line reason, traceback tail) for a failed record."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    kind = "out of memory" if is_out_of_memory(exc) else type(exc).__name__
    reason = f"{kind} during {phase}: {first}" if first else f"{kind} during {phase}"
    details = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-12:])[-4000:]
    return reason, details


def measure_task(task: Task, cache: CaseCache, phase: Phase = lambda p: None) -> Record:
    """Measure one (case, impl); never raises for problems of the implementation.

    After an out-of-memory failure the memory the failed call left behind is released here, once its
    frames are gone, so that the next (case, impl) in this worker starts from a clean device.
    """
    record = _measure_task(task, cache, phase)
    if record.status == "failed" and (record.reason or "").startswith("out of memory"):
        release_memory(str(task.case.get("device", "cpu")))
    return record


def release_memory(device: str, torch_module: Any = None) -> None:
    """Collect reference cycles (tracebacks keep frames, frames keep tensors) and return cached CUDA blocks."""
    gc.collect()
    if device.startswith("cuda"):
        cuda = (torch_module or torch).cuda
        cuda.synchronize()
        cuda.empty_cache()
        cuda.reset_peak_memory_stats()


def _measure_task(task: Task, cache: CaseCache, phase: Phase) -> Record:
    started, t_start = utc_now(), time.perf_counter()
    case = Case(**task.case)
    base: dict[str, Any] = {"case_id": task.case_id, "impl": task.impl, "params": task.params,
                            "started_at": started}

    def finish(**fields: Any) -> Record:
        return Record(**base, **fields, wall_s=time.perf_counter() - t_start)

    impl = registry.get(task.impl)
    reason = impl.unavailable() or impl.unsupported(case)
    if reason is None and case.device == "cuda" and not torch.cuda.is_available():
        reason = "no CUDA device visible"
    if reason:
        return finish(status="skipped", reason=reason)
    base["device"] = device_description(case.device)
    too_big = does_not_fit(impl, case, already_held=cache.input_bytes(case))
    if too_big is not None:
        reason, model = too_big
        return finish(status="skipped", reason=reason, memory={
            "peak_bytes": model.total_bytes, "method": "model", "note": "modelled lower bound; the case was not run"})

    current = "pattern"
    try:
        cache.for_case(case)
        pattern = cache.pattern
        assert pattern is not None
        base["density"] = pattern.density
        base["block_density"] = pattern.block_density(case.block_size)
        base["flops"] = flop_counts.useful_flops(case, pattern.nnz)
        base["flops_dense"] = flop_counts.dense_flops(case)
    except Exception as exc:  # a custom pattern's predicate failing on this case: the record names it
        cache.key = None
        reason, details = describe_failure(current, exc)
        return finish(status="failed", reason=reason, details=details)

    current = "inputs"
    try:
        phase(current)
        if cache.inputs is None:
            cache.inputs = make_inputs(case)
        q, k, v = (t.detach().requires_grad_(case.mode == "fwd_bwd") for t in cache.inputs)
        grad_out = upstream_grad(case) if case.mode == "fwd_bwd" else None

        current = "prepare"
        phase(current)
        t0 = time.perf_counter()
        fn = impl.prepare(case, pattern, q, k, v)
        if case.checkpoint:
            fn = checkpointed(fn)
        current = "first call"
        phase(current)
        out = fn()
        sync_device(case.device)
        setup_s = time.perf_counter() - t0
        base["config"] = impl.record_extras() or None
        base["interpreter"] = bool((base["config"] or {}).get("interpreter", False))
    except Unavailable as exc:
        return finish(status="skipped", reason=exc.reason)
    except Exception as exc:
        reason, details = describe_failure(current, exc)
        return finish(status="failed", reason=reason, details=details)

    expected_shape = case.q_shape()
    if not isinstance(out, Tensor) or tuple(out.shape) != expected_shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        return finish(status="failed", setup_s=setup_s,
                      reason=f"wrong output: got {got}, expected a tensor of shape {expected_shape}")

    try:
        current = "check"
        phase(current)
        error, problem = _check(case, impl, pattern, cache, q, k, v, out, grad_out, full=task.measure["check"])
        del out
        current = "timing"
        phase(current)
        step = _timed_step(fn, q, k, v, grad_out)
        policy = TimingPolicy(warmup=task.measure["warmup"], repeat=task.measure["repeat"],
                              max_time_s=task.measure["max_time_s"])
        monitor = device_monitor(case.device)  # GPU clocks, temperature, throttling around the timing
        if monitor is not None:
            monitor.start()
        time_s = measure(step, policy, timer_for(case.device))
        device_state = monitor.stop() if monitor is not None else None
        current = "memory"
        phase(current)
        q.grad = k.grad = v.grad = None  # freed inside the measured step, they would hide its own memory
        memory = measure_peak(step, case.device)
    except Exception as exc:
        reason, details = describe_failure(current, exc)
        return finish(status="failed", reason=reason, details=details, setup_s=setup_s)

    flops_per_s = base["flops"] / time_s["median"] if time_s["median"] > 0 else None
    peak = peak_for(flops_per_s, case.dtype, case.device, impl.tf32(case), task.measure.get("calibration"),
                    gpu_identity(case.device))
    status = "incorrect" if problem else "ok"
    return finish(status=status, reason=problem, time_s=time_s, setup_s=setup_s, memory=memory,
                  error=error, flops_per_s=flops_per_s, env=device_state, peak=peak)


def sync_device(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that a clock read after it is honest."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def checkpointed(fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """Seed 004's gradient checkpointing: keep no activations, recompute attention in backward."""
    from torch.utils.checkpoint import checkpoint

    return lambda: checkpoint(fn, use_reentrant=False)


def _timed_step(fn: Callable[[], Tensor], q: Tensor, k: Tensor, v: Tensor,
                grad_out: Tensor | None) -> Callable[[], Any]:
    if grad_out is None:
        return fn

    def fwd_bwd() -> None:
        q.grad = k.grad = v.grad = None
        fn().backward(grad_out)

    return fwd_bwd


def _check(case: Case, impl: registry.Impl, pattern: Pattern, cache: CaseCache, q: Tensor, k: Tensor,
           v: Tensor, out: Tensor, grad_out: Tensor | None, full: bool) -> tuple[dict[str, Any], str | None]:
    """Error of the output (and gradients) against the float64 oracle -> (error, problem or None).

    With `check: false` in the suite only NaN/Inf are looked for.
    """
    tol = tolerance_for(case.dtype, impl.tf32(case))
    rows = rows_to_check(case.batch, case.heads, case.seq_len, seed=case.seed, q_len=case.n_queries)
    if not full:
        nonfinite = int((~torch.isfinite(out.detach())).sum())
        error = {"max_abs": None, "rel_l2": None, "tolerance": tol, "rows_checked": 0, "nonfinite": nonfinite}
        return error, (f"output has {nonfinite} NaN/Inf values" if nonfinite else None)

    if "out" not in cache.oracle:
        with torch.no_grad():
            cache.oracle["out"] = reference_attention(q.detach(), k.detach(), v.detach(), pattern, rows)
    stats = compare(out.detach()[:, :, rows.to(out.device)], cache.oracle["out"], tol)
    error: dict[str, Any] = {"max_abs": stats.max_abs, "rel_l2": stats.rel_l2, "tolerance": tol,
                             "rows_checked": stats.rows_checked, "nonfinite": stats.nonfinite}
    problem = None if stats.passed else _problem("output", stats.rel_l2, tol, stats.nonfinite)

    if grad_out is not None:
        # Upstream gradient only on the checked rows: the full problem's dq, dk, dv then equal the oracle's.
        row_mask = torch.zeros(case.n_queries, dtype=torch.bool, device=out.device)
        row_mask[rows.to(out.device)] = True
        g = grad_out * row_mask[:, None].to(grad_out.dtype)
        got = torch.autograd.grad(out, (q, k, v), g, allow_unused=True)
        if "grads" not in cache.oracle:
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = reference_attention(*leaves, pattern, rows)
            cache.oracle["grads"] = torch.autograd.grad(ref, leaves, g[:, :, rows.to(g.device)].double())
        grads = {}
        for name, actual, expected in zip(("dq", "dk", "dv"), got, cache.oracle["grads"], strict=True):
            if actual is None:
                actual = torch.zeros_like(expected)
            s = compare(actual, expected, tol)
            grads[name] = {"max_abs": s.max_abs, "rel_l2": s.rel_l2, "tolerance": tol, "nonfinite": s.nonfinite}
            if problem is None and not s.passed:
                problem = _problem(name, s.rel_l2, tol, s.nonfinite)
        error["grads"] = grads
    return error, problem


def _problem(what: str, rel_l2: float | None, tol: float, nonfinite: int) -> str:
    if nonfinite:
        return f"{what} has {nonfinite} NaN/Inf values"
    return f"{what} off the float64 oracle: rel_l2 {rel_l2:.3g} > tolerance {tol:g}"
