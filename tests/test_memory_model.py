"""The memory model (skip what cannot fit, with the modelled bytes) and out-of-memory failures that the
sweep survives."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

from bench import registry
from bench.measure import memory_model
from bench.measure import pair as measure_module
from bench.measure.memory_model import does_not_fit, io_bytes, modelled_bytes
from bench.measure.pair import CaseCache, Task, measure_task, release_memory
from bench.run.worker import WorkerProcess
from bench.spec.case import Case
from tests.conftest import only_run_dir, read_jsonl, run_bench, write_suite


def task_for(case: Case, impl: str, check: bool = True) -> Task:
    return Task.of(case, impl,
                {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "check": check})


def test_bytes_follow_the_shapes_exactly():
    case = Case(batch=2, heads=3, seq_len=5, head_dim=7, dtype="bfloat16", pattern="dense")
    assert io_bytes(case) == 4 * (2 * 3 * 5 * 7 * 2)  # q, k, v, out
    assert io_bytes(Case(**{**case.params(), "mode": "fwd_bwd"})) == 8 * (2 * 3 * 5 * 7 * 2)
    assert case.score_bytes() == 2 * 3 * 5 * 5 * 4
    n2, s4 = 25, 2 * 3 * 25 * 4
    copies = 4 * 7 * (2 * 3 * 5 + 2 * 3 * 5)  # float32 q and k: low-precision scores are computed in float32
    assert registry.get("dense").memory_bytes(case) == n2 + s4 + copies
    fp32 = Case(batch=2, heads=3, seq_len=5, head_dim=7, pattern="dense")
    assert registry.get("dense").memory_bytes(fp32) == n2 + s4
    assert registry.get("dense").memory_bytes(Case(**{**fp32.params(), "mode": "fwd_bwd"})) == n2 + 2 * s4
    assert registry.get("naive_loop").memory_bytes(fp32) == 2 * s4
    assert registry.get("sdpa").memory_bytes(fp32) == n2
    model = modelled_bytes(registry.get("dense"), fp32)
    assert model.total_bytes == io_bytes(fp32) + n2 + s4 and model.impl_bytes == n2 + s4


def test_a_case_that_cannot_fit_is_skipped_with_the_modelled_bytes(monkeypatch):
    gpu = (10 * 2**20, "free of 24 GiB on the GPU")
    monkeypatch.setattr(memory_model, "device_available_bytes", lambda device: gpu)
    case = Case(heads=4, head_dim=16, seq_len=2048, device="cpu")
    record = measure_task(task_for(case, "dense"), CaseCache())
    expected = modelled_bytes(registry.get("dense"), case).total_bytes
    assert record.status == "skipped" and record.time_s is None
    assert record.reason.startswith("memory model: dense needs at least 0.0")
    assert "0.00977 GiB free of 24 GiB on the GPU" in record.reason
    assert (record.memory.peak_bytes, record.memory.method) == (expected, "model")
    assert expected == 4 * 4 * 2048 * 16 * 4 + 2048**2 + 4 * 2048**2 * 4
    small = Case(heads=1, head_dim=8, seq_len=64, device="cpu")
    assert measure_task(task_for(small, "dense"), CaseCache()).status == "ok"  # 10 MiB is enough for it


def test_inputs_already_held_count_as_available():
    impl = registry.get("dense")
    case = Case(heads=1, head_dim=8, seq_len=256)
    need = modelled_bytes(impl, case).total_bytes
    assert does_not_fit(impl, case, already_held=0, available=(need - 1, "x")) is not None
    assert does_not_fit(impl, case, already_held=1, available=(need - 1, "x")) is None
    assert does_not_fit(impl, case, available=(None, "unknown")) is None  # no figure: run it


def test_an_implementation_without_a_model_is_never_skipped():
    class NoModel(registry.Impl):
        name = "no_model"

    case = Case(seq_len=2**20, heads=64)
    assert NoModel().memory_bytes(case) is None
    assert does_not_fit(NoModel(), case, available=(0, "nothing")) is None


def test_a_sweep_skips_dense_cases_beyond_host_memory(tmp_path):
    suite = write_suite(tmp_path, {
        "name": "huge", "impls": ["dense", "sdpa", "naive_loop"],
        "defaults": {"heads": 1, "head_dim": 8, "window": 16, "device": "cpu"},
        "sweep": {"seq_len": [64, 262144]}, "measure": {"warmup": 0, "repeat": 3, "max_time_s": 0.01}})
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    by_n = {(r["params"]["seq_len"], r["impl"]): r for r in records}
    for impl in ("dense", "sdpa", "naive_loop"):
        assert by_n[(64, impl)]["status"] == "ok"
        big = by_n[(262144, impl)]
        assert big["status"] == "skipped", big
        assert big["reason"].startswith(f"memory model: {impl} needs at least ")
        assert "available host memory (MemAvailable)" in big["reason"]
        assert big["memory"]["method"] == "model" and big["memory"]["peak_bytes"] >= 262144**2


def test_the_model_is_a_lower_bound_of_what_a_call_uses():
    # In a worker, whose allocator maps large blocks directly so that the resident mark follows them.
    # naive_loop's backward is O(N^3) (a (B, H, N, N) gradient per query row), so it is checked forward only.
    pairs = [("dense", "fwd"), ("dense", "fwd_bwd"), ("naive_loop", "fwd")]
    worker = WorkerProcess([])
    try:
        for impl_name, mode in pairs:
            case = Case(heads=4, head_dim=16, seq_len=1024, window=64, mode=mode, device="cpu")
            outcome = worker.run(task_for(case, impl_name, check=False), timeout_s=300)
            r = outcome.record
            assert r is not None and r["status"] == "ok", outcome
            impl = registry.get(impl_name)
            mask = case.seq_len**2 if impl_name == "dense" else 0  # built in prepare, before the measured call
            # The resident-size method is exact to a few hundred KiB (Linux's per-CPU resident counters; the
            # interpreter frees some pages during the call): 5% of these 16 MiB and more is well above that.
            assert r["memory"]["peak_bytes"] >= 0.95 * (impl.memory_bytes(case) - mask), r
    finally:
        worker.close()


class Holder:
    """A reference cycle holding a tensor, as an exception's traceback frames can."""


def test_memory_left_by_an_out_of_memory_failure_is_released(monkeypatch):
    held: list[weakref.ref] = []

    class RunsOutOfMemory(registry.Impl):
        name = "runs_out_of_memory"

        def prepare(self, case, pattern, q, k, v):
            def call():
                holder = Holder()
                holder.cycle, holder.big = holder, torch.empty(2**20)
                held.append(weakref.ref(holder))
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

            return call

    impl = RunsOutOfMemory()
    monkeypatch.setattr(registry, "get", lambda name: impl)
    released = []
    monkeypatch.setattr(measure_module, "release_memory", lambda device: (released.append(device), gc.collect()))
    case = Case(heads=1, head_dim=8, seq_len=32, device="cpu")
    gc.disable()  # only an explicit collection may free the cycle
    try:
        record = measure_task(task_for(case, impl.name), CaseCache())
        assert released == ["cpu"]
        assert held and held[0]() is None
    finally:
        gc.enable()
    assert record.status == "failed"
    assert record.reason == "out of memory during first call: CUDA out of memory. Tried to allocate 80.00 GiB"


def test_release_memory_empties_the_cuda_cache():
    calls = []
    cuda = types.SimpleNamespace(**{name: (lambda name=name: calls.append(name))
                                    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats")})
    release_memory("cuda", torch_module=types.SimpleNamespace(cuda=cuda))
    assert calls == ["synchronize", "empty_cache", "reset_peak_memory_stats"]
    calls.clear()
    release_memory("cpu", torch_module=types.SimpleNamespace(cuda=cuda))
    assert calls == []


def test_an_out_of_memory_failure_does_not_stop_the_sweep(tmp_path, faulty_plugin):
    suite = write_suite(tmp_path, {
        "name": "oom", "impls": ["fault_oom", "dense"], "plugins": ["faulty.py"],
        "defaults": {"heads": 1, "head_dim": 8, "device": "cpu"}, "sweep": {"seq_len": [32, 64]},
        "measure": {"warmup": 0, "repeat": 3, "max_time_s": 0.01}})
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"))
    assert proc.returncode == 1
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    assert [(r["impl"], r["status"]) for r in records] == [("fault_oom", "failed"), ("dense", "ok")] * 2
    assert records[0]["reason"] == ("out of memory during first call: CUDA out of memory. Tried to allocate "
                                    "64.00 GiB (planted)")


@pytest.mark.parametrize("device", ["cpu"])
def test_available_memory_is_known_here(device):
    free, where = memory_model.device_available_bytes(device)
    assert free is not None and free > 2**20 and "MemAvailable" in where
