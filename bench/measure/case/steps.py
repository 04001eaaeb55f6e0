"""The steps of measuring one (case, implementation), shared by every caller (bench.measure.pair has the order):
what is skipped, the seeded inputs, prepare and the first call with its setup phases, the timed step, and how
failures are described.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bench import inputs, registry
from bench.inputs import CaseInputs
from bench.measure.timing import TimingPolicy
from bench.models.spec import weights_unavailable
from bench.patterns import Pattern
from bench.registry import SetupClock
from bench.results.records import FailureKind, SetupTimes
from bench.selection import get_selector
from bench.spec.case import Case

Phase = Callable[[str], None]


def no_phase(name: str) -> None:
    return None


# --- the steps ---------------------------------------------------------------------------------------------


def skip_reason(impl: registry.Impl, case: Case) -> str | None:
    """Why this (case, impl) is not measured here, or None."""
    reason = impl.unavailable() or impl.unsupported(case)
    if reason is None and case.device == "cuda" and not torch.cuda.is_available():
        reason = "no CUDA device visible"
    if reason is None and case.selector is not None and case.page_size is not None:
        reason = "a selection over a paged cache is not built (selections read contiguous K/V)"
    if reason is None and case.selector is not None:
        info = get_selector(case.selector)
        reason = impl.unsupported_selection(case, info.q_unit, info.kv_unit, info.shared)
    if reason is None and case.model is not None:
        reason = weights_unavailable(case.model)
    return reason


def make_inputs(case: Case) -> CaseInputs:
    """The case's q (B, H, q_len, D) and k, v (B, Hkv, N, D) in its dtype on its device, as its `inputs` field
    says (bench.inputs: seeded Gaussians, the structured generator, or a captured file), with their provenance."""
    return inputs.make(case.inputs, case.inputs_shape(), case.seed, case.torch_dtype, case.device)


def upstream_grad(case: Case) -> Tensor:
    """The seeded gradient of the output that backward starts from (Gaussian, whatever the inputs)."""
    return inputs.random_tensors(case.inputs_shape(), case.seed, case.torch_dtype, case.device, salt=7)[0]


def call_inputs(case: Case, made: CaseInputs | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(q, k, v, grad_out) for one pair: the case's inputs (`made`, shared by a case's pairs, or made here) as
    leaves of their own, requiring grad in fwd_bwd, and the upstream gradient there (None in fwd)."""
    backward = case.mode == "fwd_bwd"
    q, k, v = (t.detach().requires_grad_(backward) for t in (made or make_inputs(case)).tensors)
    return q, k, v, upstream_grad(case) if backward else None


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

    @property
    def refresh(self) -> Callable[[], None] | None:
        """The call's `refresh_inputs`, where it has one: an implementation that copied its inputs into a layout
        of its own in prepare (the FlashInfer-Bench adapter) makes those copies again from the case's tensors,
        which the harness calls, untimed, after writing each input set into them (bench.measure.cold)."""
        return getattr(self.fn, "refresh_inputs", None)


def set_up_plain(impl: registry.Impl, case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor,
                 phase: Phase = no_phase) -> Prepared:
    """`impl.prepare` (untimed setup) and the first call; the implementation's marked phases timed apart.

    The implementation gets a fresh copy of the pattern, so building its views counts as its own mask time
    (the harness's copy, shared by the case's implementations, has them cached). Raises what they raise.
    """

    def make() -> Callable[[], Any]:
        fn = impl.prepare(case, pattern.fresh(), q, k, v)
        return with_refresh(checkpointed(fn), fn) if case.checkpoint else fn

    return set_up(make, impl, case, phase)


def with_refresh(wrapper: Callable[[], Any], fn: Callable[[], Any]) -> Callable[[], Any]:
    """`wrapper` around the implementation's call `fn`, keeping fn's `refresh_inputs` (Prepared.refresh)."""
    refresh = getattr(fn, "refresh_inputs", None)
    if refresh is not None:
        wrapper.refresh_inputs = refresh  # type: ignore[attr-defined]
    return wrapper


def set_up(make: Callable[[], Callable[[], Any]], impl: registry.Impl, case: Case, phase: Phase = no_phase
           ) -> Prepared:
    """The Prepared of the call `make()` returns (its untimed setup), after the call's first run: the setup
    phases the implementation marks (`setup_phase`) timed apart. Raises what they raise."""
    clock = SetupClock()
    t0 = time.perf_counter()
    with clock:
        phase("prepare")
        fn = make()
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
    """What is timed: the call, or in fwd_bwd the call and its backward from `grad_out` (returning the output).

    `upstream(result)` picks the part of grad_out matching what the call returned (a rank's shard).
    """
    if grad_out is None:
        return fn

    def fwd_bwd() -> Tensor:
        q.grad = k.grad = v.grad = None
        result = fn()
        result.backward(grad_out if upstream is None else upstream(result))
        return result.detach()  # the output, for the check of timed calls

    return fwd_bwd


def policy_of(measure_settings: Any) -> TimingPolicy:
    """The suite's warm-up, repeat and time budget as a TimingPolicy."""
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


def failure_kind(exc: BaseException) -> FailureKind:
    """The failed record's kind for an exception the implementation raised: out_of_memory or error."""
    return "out_of_memory" if is_out_of_memory(exc) else "error"


def release_memory(device: str, torch_module: Any = None) -> None:
    """Collect reference cycles (tracebacks keep frames, frames keep tensors) and return cached CUDA blocks."""
    gc.collect()
    if device.startswith("cuda"):
        cuda = (torch_module or torch).cuda
        cuda.synchronize()
        cuda.empty_cache()
        cuda.reset_peak_memory_stats()
