"""Timed calls that can be trusted (bench.measure.cold, bench.measure.timed_check): implementations planted to
game the timing are caught, each by the check that exists for it, and the record says how the calls were made."""

from __future__ import annotations

import pytest
import torch

from bench import registry
from bench.measure.case.case_cache import CaseCache
from bench.measure.cold import CacheSize, CpuEvictor, InputSets, TimedCalls, last_level_cache
from bench.measure.pair import measure_task
from bench.measure.task import Task
from bench.measure.timing import CpuTimer
from bench.spec.case import Case

QUICK = {"warmup": 1, "repeat": 5, "max_time_s": 0.05, "memory": "worker"}


def _attention(q, k, v, pattern):
    mask = pattern.dense_mask()
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


class CachesLastOutput(registry.Impl):
    """Computes on its first call, then returns that output again."""

    name = "planted_cached_output"

    def prepare(self, case, pattern, q, k, v):
        kept = []

        def call():
            if not kept:
                kept.append(_attention(q, k, v, pattern))
            return kept[0]

        return call


class RightOnlyFirst(registry.Impl):
    """Right on its first call; every later call skips the work and returns zeros of the right shape."""

    name = "planted_first_only"

    def prepare(self, case, pattern, q, k, v):
        calls = [0]

        def call():
            calls[0] += 1
            return _attention(q, k, v, pattern) if calls[0] == 1 else torch.zeros_like(q)

        return call


class KeyedOnPointers(registry.Impl):
    """Memoizes its output on the inputs' data pointers, as a cache keyed on an input fingerprint would."""

    name = "planted_pointer_cache"

    def prepare(self, case, pattern, q, k, v):
        memo = {}

        def call():
            key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
            if key not in memo:
                memo[key] = _attention(q, k, v, pattern)
            return memo[key]

        return call


PLANTED = {cls.name: cls() for cls in (CachesLastOutput, RightOnlyFirst, KeyedOnPointers)}


@pytest.fixture
def planted(monkeypatch):
    real_get = registry.get
    monkeypatch.setattr(registry, "get", lambda name: PLANTED.get(name) or real_get(name))


def _measure(impl: str, case: Case | None = None, **measure) -> object:
    case = case or Case(heads=2, head_dim=16, seq_len=64, pattern="causal", device="cpu")
    return measure_task(Task.of(case, impl, {**QUICK, **measure}), CaseCache())


@pytest.mark.parametrize("impl", sorted(PLANTED))
def test_a_planted_implementation_passes_its_first_check_and_is_caught_on_its_timed_calls(planted, impl):
    record = _measure(impl)
    assert record.error is not None and record.error.rel_l2 < 1e-5  # the first call was right
    assert record.status == "incorrect", (impl, record.reason)
    assert record.reason.startswith("a timed call's output differed from the float64 oracle for its own inputs")
    assert record.timing is not None and record.timing.checked_calls == 2 and record.timing.rotated_sets == 2


def test_without_rotation_only_the_cache_keyed_on_the_inputs_escapes(planted):
    """What rotation adds: the same values every call let a memo pass; the check alone still catches the rest."""
    assert _measure("planted_pointer_cache", rotate=False).status == "ok"
    assert _measure("planted_cached_output", rotate=False).status == "ok"
    assert _measure("planted_first_only", rotate=False).status == "incorrect"


def test_honest_implementations_pass_on_every_kind_with_rotated_inputs():
    cases = [Case(heads=2, head_dim=16, seq_len=64, pattern="causal", device="cpu"),
             Case(heads=2, head_dim=16, seq_len=64, pattern="local", window=16, device="cpu", mode="fwd_bwd"),
             Case(heads=4, kv_heads=2, head_dim=16, seq_len=64, q_len=1, pattern="causal", page_size=16,
                  device="cpu"),
             Case(heads=2, head_dim=16, seq_len=128, pattern="causal", selector="moba", budget=2, block_size=32,
                  device="cpu")]
    for case in cases:
        record = _measure("dense" if case.selector is None else "blocked", case)
        assert record.status == "ok", (case.case_id, record.reason)
        assert record.timing.checked_calls >= 2 and record.timing.cache == "cold"


def test_a_warm_timing_is_stated_and_evicts_nothing():
    record = _measure("dense", cache="warm")
    assert record.status == "ok"
    assert record.timing.cache == "warm" and record.timing.evict_bytes is None


def test_the_eviction_buffer_is_twice_the_last_level_cache_read_from_the_machine(tmp_path):
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                                 (2, "Unified", "2048K"), (3, "Unified", "32768K")]):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    llc = last_level_cache.__wrapped__(tmp_path)
    assert llc == CacheSize(32 * 2**20, "sysfs L3")
    assert CpuEvictor(llc).bytes == 64 * 2**20


def test_each_timed_call_gets_the_next_set_written_before_the_eviction_and_the_drawn_call_is_on_another_set():
    target = torch.zeros(3)
    sets = InputSets.of([target], [[torch.ones(3)]])
    order: list[str] = []

    class Recorder:
        def __call__(self):
            order.append(f"evict with {int(target[0])}")

    calls = TimedCalls(CpuTimer(), sets, Recorder(), check_from=2, check_to=8)
    seen = []
    for _ in range(8):
        calls.time_call(lambda: seen.append(int(target[0])) or target.clone())
    assert seen == [1, 0, 1, 0, 1, 0, 1, 0]  # the first call after the case's own check gets the other set
    assert order == ["evict with 1", "evict with 0", "evict with 1", "evict with 0", "evict with 1", "evict with 0"]
    checked = calls.to_check()
    assert [c.index for c in checked][-1] == 7 and len(checked) == 2
    assert checked[0].input_set == 1 and 2 <= checked[0].index < 7
    sets.load(0)
    assert target.tolist() == [0.0, 0.0, 0.0]


def test_a_figure_past_a_roof_is_marked_with_its_reason():
    from bench.measure.machine.calibrate import peak_for
    from bench.results.environment import Bandwidth, Calibration, MatmulRate

    calibration = Calibration(matmul={"float32": MatmulRate(flops_per_s=1e11), "bfloat16": MatmulRate(
        flops_per_s=1e10)}, read={"all_threads": Bandwidth(bytes_per_s=2e10)})
    warm = peak_for(1e9, "float32", "cpu", False, calibration, bytes_per_s=3e10, flops=1e6, bytes_moved=2**24,
                    cache="warm")
    assert warm.above_roof and "1.50x the calibrated read bandwidth" in warm.above_roof_reason
    assert "warm" in warm.above_roof_reason and "16 MiB" in warm.above_roof_reason
    cold = peak_for(1e9, "float32", "cpu", False, calibration, bytes_per_s=2.05e10, flops=1e6, bytes_moved=2**24)
    assert cold.above_roof is False  # within 5% of the roof
    # bfloat16 on a CPU without bfloat16 products is held to its float32 rate, not the emulated bfloat16 one
    avx2 = peak_for(4e10, "bfloat16", "cpu", False, calibration, cpu_features=["avx2", "fma"])
    assert avx2.peak_flops == 1e11 and "widened" in avx2.hardware and avx2.above_roof is False
    default = peak_for(4e10, "bfloat16", "cpu", False, calibration, cpu_features=[])  # torch held to DEFAULT
    assert default.peak_flops == 1e11 and "widened" in default.hardware
    native = peak_for(4e10, "bfloat16", "cpu", False, calibration, cpu_features=["avx512f", "avx512_bf16"])
    assert native.peak_flops == 1e10 and native.above_roof and "compute roof" in native.above_roof_reason


def test_the_console_marks_records_above_the_roof_and_fallbacks():
    from bench.results.records import PeakInfo, Record, TimeStats
    from bench.run.console import describe, fallback_lines

    times = TimeStats(median=1e-3, min=1e-3, max=1e-3, mean=1e-3, std=0.0, q1=1e-3, q3=1e-3, n=1, samples=[1e-3])
    above = Record(case_id="c", impl="blocked", params={}, status="ok", time_s=times, peak=PeakInfo(
        above_roof=True, above_roof_reason="1.24x the calibrated read bandwidth: the timing was warm"))
    assert "ABOVE THE ROOF: 1.24x the calibrated read bandwidth" in describe(above)
    fell = above.model_copy(update={"peak": None, "config": {"path": "gather", "fallback": {
        "path": "gather", "reason": "the CPU kernel could not be built"}}})
    assert fallback_lines([fell, above]) == ["blocked FELL BACK in 1 of 2 measured pairs (path gather): the CPU "
                                             "kernel could not be built"]


class RaisesWhileTimed(registry.Impl):
    """Right, until its fourth call raises: the harness had written the other input set into q, k, v for it."""

    name = "planted_raises_while_timed"

    def prepare(self, case, pattern, q, k, v):
        calls = [0]

        def call():
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("planted failure")
            return _attention(q, k, v, pattern)

        return call


def test_a_call_that_raises_while_timed_leaves_the_next_implementation_its_own_inputs(monkeypatch):
    planted = RaisesWhileTimed()
    real_get = registry.get
    monkeypatch.setattr(registry, "get", lambda name: planted if name == planted.name else real_get(name))
    case = Case(heads=2, head_dim=16, seq_len=64, pattern="causal", device="cpu")
    cache = CaseCache()
    failed = measure_task(Task.of(case, planted.name, QUICK), cache)
    assert failed.status == "failed" and "planted failure" in failed.reason
    after = measure_task(Task.of(case, "dense", QUICK), cache)  # the same inputs, shared through the cache
    assert after.status == "ok", after.reason
