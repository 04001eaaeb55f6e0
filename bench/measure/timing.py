"""Timing: warm-up, then adaptive sampling until the median is known to the target precision.

One policy for every device: warm-up calls are run and thrown away; then at least `repeat` timed samples;
then sampling goes on until the 95% confidence interval of the median (distribution-free, from binomial
order statistics) has a half-width under `target_rel_ci` of the median, or `max_time_s` is spent. The
achieved precision is recorded with the raw samples. First-call, compile and autotune time is not here:
bench.measure.pair times prepare + the first call as `setup_s` before this module sees the callable.

On CUDA each sample is bracketed by device events and the L2 cache is flushed before each call, outside the
events, so no call finds the previous call's data warm in L2 (unless the suite asks for `cache: warm`). On CPU the
host clock brackets the call; the CPU caches' eviction and the fresh inputs between calls are bench.measure.cold's,
around this timer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from scipy import stats as scipy_stats

from bench.results.records import StoppedBy, TimeStats

# When the device reports no L2 size: 72 MiB, the largest L2 of the cards in bench.measure.machine.hardware
# (RTX 4090's); flushing more than needed only costs time outside the timed region.
DEFAULT_L2_BYTES = 72 * 2**20
# The CI is re-evaluated when the sample count has grown by this factor, so checking costs O(log n) sorts
# instead of one sort per sample (which would dominate for microsecond calls).
CHECK_GROWTH = 1.05


@dataclass(frozen=True)
class TimingPolicy:
    warmup: int = 2  # calls run and discarded before sampling
    repeat: int = 10  # at least this many timed samples, whatever the budget
    max_time_s: float = 2.0  # wall-clock budget for sampling, counted from the first timed sample
    target_rel_ci: float = 0.01  # stop when the median's 95% CI half-width / median is below this
    max_samples: int = 100_000


class Timer(Protocol):
    """Times one call of fn, in seconds (`run` also gives what it returned). `clock()` is the wall clock used for
    the sampling budget."""

    def time_call(self, fn: Callable[[], Any]) -> float: ...

    def run(self, fn: Callable[[], Any]) -> tuple[float, Any]: ...

    def clock(self) -> float: ...


class CpuTimer:
    """Host clock around the call (CPU work is synchronous).

    The call's result is handed back after the second clock reading, so freeing its output is not timed (as
    on CUDA, where the caching allocator frees asynchronously).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock

    def run(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        start = self._clock()
        result = fn()
        return self._clock() - start, result

    def time_call(self, fn: Callable[[], Any]) -> float:
        return self.run(fn)[0]

    def clock(self) -> float:
        return self._clock()


def cuda_l2_bytes(torch_module: Any = None, device: Any = None) -> int:
    """The current CUDA device's L2 size (DEFAULT_L2_BYTES where it reports none)."""
    if torch_module is None:
        import torch as torch_module
    cuda = torch_module.cuda
    device = torch_module.device("cuda", cuda.current_device()) if device is None else device
    return int(getattr(cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


class CudaTimer:
    """CUDA events around each call; an L2 flush before it, outside the events.

    The flush reads a buffer twice the size of the device's L2 cache, which evicts whatever the previous
    call left there (Triton's do_bench and nvbench do the same with a write; a read is enough to evict).
    The flush kernel is enqueued before the start event on the same stream, so the events cannot see it.
    `flush=False` is a warm timing (`measure: {cache: warm}`). `torch_module` is for tests (a fake with the same
    `cuda` surface).
    """

    def __init__(self, device: Any = None, torch_module: Any = None, clock: Callable[[], float] = time.perf_counter,
                 flush: bool = True) -> None:
        if torch_module is None:
            import torch as torch_module
        self._torch = torch_module
        cuda = torch_module.cuda
        self.device = torch_module.device("cuda", cuda.current_device()) if device is None else device
        self.flush = flush
        self.flush_bytes = 2 * cuda_l2_bytes(torch_module, self.device)
        self._flush_buffer = torch_module.ones(self.flush_bytes // 4, dtype=torch_module.float32, device=self.device)
        self._sink = torch_module.empty((), dtype=torch_module.float32, device=self.device)
        self._clock = clock

    def flush_l2(self) -> None:
        self._torch.sum(self._flush_buffer, dim=0, out=self._sink)

    def run(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        cuda = self._torch.cuda
        if self.flush:
            self.flush_l2()
        start = cuda.Event(enable_timing=True)
        end = cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, result  # ms -> s

    def time_call(self, fn: Callable[[], Any]) -> float:
        return self.run(fn)[0]

    def clock(self) -> float:
        return self._clock()


def timer_for(device: str, cache: str = "cold") -> Timer:
    """The device's timer; on CUDA it flushes the L2 before each call unless `cache` is warm (the CPU's eviction
    is bench.measure.cold's, around the timer)."""
    return CudaTimer(flush=cache == "cold") if device.startswith("cuda") else CpuTimer()


def median_ci_ranks(n: int) -> tuple[int, int] | None:
    """1-based ranks (l, n - l + 1) of the order statistics bounding the median's 95% CI; None for n < 6.

    l is the largest rank with P(Bin(n, 1/2) <= l - 1) <= 0.025, so the coverage 1 - 2 P(Bin <= l - 1) is
    at least 95%. `binom.ppf(0.025)` is the smallest k with P(Bin <= k) >= 0.025, hence l = k.
    """
    lower = int(scipy_stats.binom.ppf(0.025, n, 0.5)) if n > 0 else 0
    if lower < 1:
        return None
    return lower, n - lower + 1


def median_ci95(samples: list[float] | np.ndarray) -> tuple[float, float] | None:
    """Distribution-free 95% CI of the median: order statistics x_(l), x_(n-l+1); None for n < 6."""
    x = np.sort(np.asarray(samples, dtype=float))
    ranks = median_ci_ranks(len(x))
    if ranks is None:
        return None
    return float(x[ranks[0] - 1]), float(x[ranks[1] - 1])


def rel_ci_halfwidth(samples: list[float] | np.ndarray) -> float:
    """Half-width of the median's 95% CI over the median; inf when too few samples to say."""
    ci = median_ci95(samples)
    med = float(np.median(samples)) if len(samples) else 0.0
    if ci is None or med <= 0:
        return math.inf
    return (ci[1] - ci[0]) / 2 / med


def summarize(samples: list[float], stopped_by: StoppedBy | None = None) -> TimeStats:
    """The record's `time_s`: order statistics, moments, the median's CI and every raw sample."""
    x = np.asarray(samples, dtype=float)
    ci = median_ci95(x)
    rel = rel_ci_halfwidth(x)
    return TimeStats(median=float(np.median(x)), min=float(x.min()), max=float(x.max()), mean=float(x.mean()),
                     std=float(x.std(ddof=1)) if len(x) > 1 else 0.0, q1=float(np.percentile(x, 25)),
                     q3=float(np.percentile(x, 75)), n=len(x), samples=[float(s) for s in x],
                     ci95=list(ci) if ci else None, rel_ci95=None if math.isinf(rel) else rel,
                     stopped_by=stopped_by)


def measure(fn: Callable[[], Any], policy: TimingPolicy, timer: Timer) -> TimeStats:
    """Warm up (discarded), then sample per `policy`; returns `summarize()` of the timed samples only.

    stopped_by: "precision" (target CI reached), "max_time" (budget spent) or "max_samples".
    """
    for _ in range(policy.warmup):
        timer.time_call(fn)
    samples: list[float] = []
    next_check = policy.repeat
    stopped_by: StoppedBy
    start = timer.clock()
    while True:
        samples.append(timer.time_call(fn))
        n = len(samples)
        if n < policy.repeat:
            continue
        out_of_time = timer.clock() - start >= policy.max_time_s
        if n >= next_check or out_of_time:
            if rel_ci_halfwidth(samples) <= policy.target_rel_ci:
                stopped_by = "precision"
                break
            next_check = max(n + 1, math.ceil(n * CHECK_GROWTH))
        if out_of_time:
            stopped_by = "max_time"
            break
        if n >= policy.max_samples:
            stopped_by = "max_samples"
            break
    return summarize(samples, stopped_by)
