"""Timing statistics on synthetic callables of known duration and noise, driven by a fake clock.

No test here reads the wall clock for an assertion: durations are virtual, so the statistics are exact.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from bench import registry
from bench.measure import pair as measure_module
from bench.measure import timing
from bench.measure.case import steps as measure_steps
from bench.measure.timing import CpuTimer, CudaTimer, TimingPolicy, measure, median_ci95, median_ci_ranks


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SyntheticKernel:
    """A callable that 'takes' durations drawn from a known distribution: it advances the fake clock."""

    def __init__(self, clock: FakeClock, median_s: float, sigma: float, seed: int = 0,
                 first_calls: tuple[float, ...] = ()) -> None:
        self.clock, self.median_s, self.sigma = clock, median_s, sigma
        self.rng = np.random.default_rng(seed)
        self.first_calls = list(first_calls)
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.first_calls:
            self.clock.now += self.first_calls.pop(0)
        else:  # log-normal noise: the true median is exactly median_s
            self.clock.now += self.median_s * float(np.exp(self.sigma * self.rng.standard_normal()))


def run(kernel: SyntheticKernel, clock: FakeClock, **policy) -> dict:
    return measure(kernel, TimingPolicy(**policy), CpuTimer(clock=clock))


def test_quiet_callable_stops_when_the_median_is_known_to_1_percent():
    clock = FakeClock()
    kernel = SyntheticKernel(clock, 1e-3, sigma=0.005)
    stats = run(kernel, clock, warmup=2, repeat=10, max_time_s=10.0)
    assert stats.stopped_by == "precision"
    assert stats.rel_ci95 <= 0.01
    assert abs(stats.median - 1e-3) / 1e-3 < 0.01
    assert stats.ci95[0] <= 1e-3 <= stats.ci95[1]
    assert 10 <= stats.n == len(stats.samples) < 100
    assert kernel.calls == 2 + stats.n


def test_noisy_callable_spends_the_budget_and_records_the_precision_reached():
    clock = FakeClock()
    kernel = SyntheticKernel(clock, 1e-3, sigma=0.8, seed=1)
    stats = run(kernel, clock, warmup=0, repeat=5, max_time_s=0.05)
    assert stats.stopped_by == "max_time"
    assert stats.rel_ci95 > 0.01  # honest: the target was not reached
    assert 0.05 <= sum(stats.samples) < 0.05 + max(stats.samples) + 1e-12
    assert stats.ci95[0] <= 1e-3 <= stats.ci95[1]


def test_warmup_and_first_calls_are_never_in_the_samples():
    clock = FakeClock()
    # two warm-up calls that compile/autotune (seconds), then a steady 2 ms kernel
    kernel = SyntheticKernel(clock, 2e-3, sigma=0.0, first_calls=(5.0, 3.0))
    stats = run(kernel, clock, warmup=2, repeat=8, max_time_s=1.0)
    assert stats.samples == pytest.approx([2e-3] * stats.n, rel=1e-9)
    assert stats.max == pytest.approx(2e-3)


def test_repeat_is_a_minimum_and_six_samples_are_needed_for_a_ci():
    clock = FakeClock()
    stats = run(SyntheticKernel(clock, 1e-3, sigma=0.0), clock, warmup=0, repeat=20, max_time_s=10.0)
    assert (stats.n, stats.stopped_by) == (20, "precision")
    assert stats.rel_ci95 == pytest.approx(0.0, abs=1e-12)
    clock = FakeClock()
    stats = run(SyntheticKernel(clock, 1e-3, sigma=0.0), clock, warmup=0, repeat=3, max_time_s=10.0)
    assert (stats.n, stats.stopped_by) == (6, "precision")  # n < 6 has no 95% CI of the median


def test_max_samples_bounds_a_callable_that_takes_no_time():
    clock = FakeClock()
    stats = run(SyntheticKernel(clock, 0.0, sigma=0.0), clock, warmup=0, repeat=5, max_samples=50)
    assert (stats.n, stats.stopped_by, stats.rel_ci95) == (50, "max_samples", None)


def test_the_ci_is_checked_o_log_n_times(monkeypatch):
    checks = []
    real = timing.rel_ci_halfwidth
    monkeypatch.setattr(timing, "rel_ci_halfwidth", lambda s: checks.append(len(s)) or real(s))
    clock = FakeClock()
    stats = run(SyntheticKernel(clock, 1e-3, sigma=1.0, seed=3), clock, warmup=0, repeat=10, max_time_s=5.0)
    assert stats.stopped_by == "max_time" and stats.n > 2000
    assert len(checks) < 250
    assert checks[-1] == stats.n  # the last sample is always checked before giving up


@pytest.mark.parametrize(("n", "ranks"), [(5, None), (6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (100, (40, 61))])
def test_median_ci_ranks_match_the_binomial_table(n, ranks):
    assert median_ci_ranks(n) == ranks


def test_median_ci_covers_the_true_median_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    trials, covered = 600, 0
    for _ in range(trials):
        x = np.exp(rng.standard_normal(30))  # true median 1
        lo, hi = median_ci95(x)
        covered += lo <= 1.0 <= hi
    # exact coverage for n = 30 is 1 - 2 P(Bin(30, 1/2) <= 9) = 0.957
    assert 0.93 <= covered / trials <= 0.985


def test_cpu_timer_does_not_time_freeing_the_output():
    clock = FakeClock()

    class SlowToFree:
        def __del__(self) -> None:
            clock.now += 1.0

    def call() -> SlowToFree:
        clock.now += 0.25
        return SlowToFree()

    assert CpuTimer(clock=clock).time_call(call) == pytest.approx(0.25)
    assert clock.now == pytest.approx(1.25)  # it was freed, after the reading


# --- CUDA timing with a fake torch: the flush is outside the events -------------------------------------


def fake_torch(log: list, gpu: FakeClock, l2_bytes: int) -> types.SimpleNamespace:
    """The slice of torch that CudaTimer uses; the 'GPU' advances `gpu` and logs every operation."""

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.t: float | None = None

        def record(self) -> None:
            self.t = gpu.now
            log.append(("record", self))

        def synchronize(self) -> None:
            log.append(("synchronize", self))

        def elapsed_time(self, end: Event) -> float:
            return (end.t - self.t) * 1e3  # milliseconds, as torch

    class Buffer:
        def __init__(self, numel: int) -> None:
            self.numel = numel

    def fake_sum(buf: Buffer, dim: int, out: Buffer) -> None:
        log.append(("flush", buf.numel * 4))
        gpu.now += 5e-3  # reading 2x L2 from HBM takes time that must not be counted

    cuda = types.SimpleNamespace(current_device=lambda: 0, Event=Event,
                                 get_device_properties=lambda d: types.SimpleNamespace(L2_cache_size=l2_bytes))
    return types.SimpleNamespace(cuda=cuda, float32="float32", device=lambda kind, i: f"{kind}:{i}",
                                 ones=lambda n, dtype, device: Buffer(n),
                                 empty=lambda shape, dtype, device: Buffer(1), sum=fake_sum)


def test_cuda_timer_flushes_l2_before_the_start_event():
    log: list = []
    gpu = FakeClock()
    timer = CudaTimer(torch_module=fake_torch(log, gpu, l2_bytes=40 * 2**20))
    assert timer.flush_bytes == 80 * 2**20

    def kernel() -> None:
        log.append(("call", None))
        gpu.now += 1e-3

    elapsed = timer.time_call(kernel)
    assert elapsed == pytest.approx(1e-3)  # the 5 ms flush is not in it
    kinds = [k for k, _ in log]
    assert kinds == ["flush", "record", "call", "record", "synchronize"]
    assert log[0][1] >= 2 * 40 * 2**20  # the flush read at least twice the L2
    start, end = log[1][1], log[3][1]
    assert start is not end and log[4][1] is end


def test_cuda_measure_flushes_before_every_call_and_times_none_of_them():
    log: list = []
    gpu = FakeClock()
    timer = CudaTimer(torch_module=fake_torch(log, gpu, l2_bytes=50 * 2**20), clock=gpu)
    kernel = SyntheticKernel(gpu, 1e-3, sigma=0.0)
    stats = measure(kernel, TimingPolicy(warmup=3, repeat=10, max_time_s=1.0), timer)
    assert stats.samples == pytest.approx([1e-3] * stats.n)
    assert sum(k == "flush" for k, _ in log) == kernel.calls == 3 + stats.n


def test_cuda_timer_falls_back_to_a_safe_l2_size():
    timer = CudaTimer(torch_module=fake_torch([], FakeClock(), l2_bytes=0))
    assert timer.flush_bytes == 2 * timing.DEFAULT_L2_BYTES


def test_real_cpu_timer_measures_at_least_the_sleep():
    import time

    stats = measure(lambda: time.sleep(0.002), TimingPolicy(warmup=1, repeat=6, max_time_s=0.05), CpuTimer())
    assert stats.min >= 0.002  # a lower bound only: the machine may be loaded
    assert stats.n >= 6


# --- bench.measure.pair: setup_s holds prepare + first call, time_s never does -------------------------------


def test_setup_s_holds_prepare_and_first_call_and_time_s_holds_neither(monkeypatch):
    clock = FakeClock()
    dense = registry.get("dense")

    class CompilesThenRuns(registry.Impl):
        name = "compiles_then_runs"

        def prepare(self, case, pattern, q, k, v):
            clock.now += 2.0  # compilation
            inner = dense.prepare(case, pattern, q, k, v)
            calls = []

            def call():
                calls.append(1)
                clock.now += 1.0 if len(calls) == 1 else 1e-3  # autotuning on the first call
                return inner()

            return call

    impl = CompilesThenRuns()
    fake_time = types.SimpleNamespace(perf_counter=clock)
    # setup is timed where the pair's steps run and where phases are marked; patch every clock it reads
    for module in (measure_module, measure_steps, registry):
        monkeypatch.setattr(module, "time", fake_time)
    monkeypatch.setattr(measure_module, "timer_for", lambda device, cache="cold": CpuTimer(clock=clock))
    monkeypatch.setattr(registry, "get", lambda name: impl if name == impl.name else dense)
    from bench.spec.case import Case

    case = Case(heads=1, head_dim=8, seq_len=32, window=8, device="cpu")
    task = measure_module.Task.of(case, impl.name,
                               {"warmup": 2, "repeat": 7, "max_time_s": 1.0, "check": True})
    record = measure_module.measure_task(task, measure_module.CaseCache())
    assert record.status == "ok", record.reason
    assert record.setup_s == pytest.approx(3.0)
    assert record.time_s.samples == pytest.approx([1e-3] * record.time_s.n)
    assert record.time_s.n >= 7
