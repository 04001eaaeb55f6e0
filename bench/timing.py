"""Timing: warm-up, then adaptive sampling until the median is known to the target precision.

One policy for every device: at least `repeat` timed samples; then keep sampling until the 95% confidence
interval of the median (distribution-free, from binomial order statistics) has a half-width under
`target_rel_ci` of the median, or `max_time_s` is spent. The achieved precision is recorded with the raw
samples. On CUDA each sample is bracketed by device events and the L2 cache is flushed before each call,
outside the events, so no call finds the previous call's data warm in L2.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from scipy import stats as scipy_stats


@dataclass(frozen=True)
class TimingPolicy:
    warmup: int = 2
    repeat: int = 10  # at least this many timed samples
    max_time_s: float = 2.0  # sampling budget once `repeat` samples are in
    target_rel_ci: float = 0.01  # stop when the median's 95% CI half-width / median is below this
    max_samples: int = 100_000


class Timer(Protocol):
    """Times one call of fn, in seconds. `clock()` is the wall clock used for the sampling budget."""

    def time_call(self, fn: Callable[[], Any]) -> float: ...

    def clock(self) -> float: ...


class CpuTimer:
    """Host wall clock around the call (CPU work is synchronous)."""

    def time_call(self, fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def clock(self) -> float:
        return time.perf_counter()


class CudaTimer:
    """CUDA events around each call; an L2 flush before it, outside the events.

    The flush reads a buffer twice the size of the device's L2 cache, which evicts whatever the previous
    call left there (Triton's do_bench and nvbench do the same with a write; a read is enough to evict).
    """

    def __init__(self, device: Any = None) -> None:
        import torch

        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        props = torch.cuda.get_device_properties(self.device)
        l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)  # 50 MiB: H100's L2, a safe floor
        self.flush_bytes = 2 * l2_bytes
        self._flush_buffer = torch.empty(self.flush_bytes // 4, dtype=torch.float32, device=self.device)
        self._flush_buffer.fill_(1.0)
        self._sink = torch.empty((), dtype=torch.float32, device=self.device)

    def flush_l2(self) -> None:
        self._torch.sum(self._flush_buffer, dim=0, out=self._sink)

    def time_call(self, fn: Callable[[], Any]) -> float:
        torch = self._torch
        self.flush_l2()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # ms -> s

    def clock(self) -> float:
        return time.perf_counter()


def timer_for(device: str) -> Timer:
    return CudaTimer() if device.startswith("cuda") else CpuTimer()


def median_ci95(samples: list[float] | np.ndarray) -> tuple[float, float] | None:
    """Distribution-free 95% CI of the median: order statistics x_(l), x_(n-l+1); None for n < 6."""
    x = np.sort(np.asarray(samples, dtype=float))
    n = len(x)
    lower_rank = int(scipy_stats.binom.ppf(0.025, n, 0.5))  # coverage 1 - 2*P(Bin(n, 1/2) <= l - 1)
    if lower_rank < 1:
        return None
    return float(x[lower_rank - 1]), float(x[n - lower_rank])


def rel_ci_halfwidth(samples: list[float] | np.ndarray) -> float:
    """Half-width of the median's 95% CI over the median; inf when too few samples to say."""
    ci = median_ci95(samples)
    med = float(np.median(samples)) if len(samples) else 0.0
    if ci is None or med <= 0:
        return math.inf
    return (ci[1] - ci[0]) / 2 / med


def summarize(samples: list[float], stopped_by: str | None = None) -> dict[str, Any]:
    """The record's `time_s`: order statistics, moments, the median's CI and every raw sample."""
    x = np.asarray(samples, dtype=float)
    ci = median_ci95(x)
    rel = rel_ci_halfwidth(x)
    return {
        "median": float(np.median(x)),
        "min": float(x.min()),
        "max": float(x.max()),
        "mean": float(x.mean()),
        "std": float(x.std(ddof=1)) if len(x) > 1 else 0.0,
        "q1": float(np.percentile(x, 25)),
        "q3": float(np.percentile(x, 75)),
        "n": len(x),
        "samples": [float(s) for s in x],
        "ci95": list(ci) if ci else None,
        "rel_ci95": None if math.isinf(rel) else rel,
        "stopped_by": stopped_by,
    }


def measure(fn: Callable[[], Any], policy: TimingPolicy, timer: Timer) -> dict[str, Any]:
    """Warm up, then sample per `policy`; returns `summarize()` of the timed samples."""
    for _ in range(policy.warmup):
        timer.time_call(fn)
    samples: list[float] = []
    start = timer.clock()
    while True:
        samples.append(timer.time_call(fn))
        if len(samples) < policy.repeat:
            continue
        if rel_ci_halfwidth(samples) <= policy.target_rel_ci:
            stopped_by = "precision"
            break
        if timer.clock() - start >= policy.max_time_s:
            stopped_by = "max_time"
            break
        if len(samples) >= policy.max_samples:
            stopped_by = "max_samples"
            break
    return summarize(samples, stopped_by)
