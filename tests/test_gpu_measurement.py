"""On a CUDA machine: device timing, NVML, calibration, the memory model and out-of-memory recovery for real.

Everything here has a CPU counterpart driven by fakes (test_timing, test_env, test_calibrate,
test_memory_model); these check the same paths against the driver. Run with `pytest -m gpu`.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench import registry
from bench.measure.machine.calibrate import QUICK, calibrate
from bench.measure.machine.env import capture
from bench.measure.machine.hardware import match_gpu
from bench.measure.machine.nvml import GpuMonitor, device_monitor
from bench.measure.memory_model import does_not_fit
from bench.measure.pair import CaseCache, Task, measure_task
from bench.measure.timing import CudaTimer, TimingPolicy, measure
from bench.spec.case import Case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_l2_flush_is_not_in_the_timed_region():
    timer = CudaTimer()
    props = torch.cuda.get_device_properties(timer.device)
    assert timer.flush_bytes >= 2 * props.L2_cache_size
    tiny = torch.ones(16, device="cuda")
    kernel = measure(lambda: tiny.add_(1), TimingPolicy(warmup=3, repeat=50, max_time_s=0.5), timer)
    flush = measure(timer.flush_l2, TimingPolicy(warmup=3, repeat=50, max_time_s=0.5), timer)
    # reading 2x L2 from device memory takes far longer than a 16-element add; if the flush were timed,
    # the add would take at least as long as the flush
    assert kernel.median < flush.median / 2


def test_nvml_sees_the_device_and_the_monitor_reports_throttling():
    env = capture("cuda")
    assert env.nvml is not None and env.nvml.available, env.nvml
    gpu = env.gpus[0]
    assert gpu.uuid is not None and gpu.uuid.startswith(("GPU-", "MIG-")) and gpu.nvml is True
    assert gpu.driver and getattr(gpu, "sm_clock_max_mhz", None) and (gpu.memory_bytes or 0) > 2**30
    monitor = device_monitor("cuda")
    assert isinstance(monitor, GpuMonitor)
    monitor.start()
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(10):
        x = x @ x.T / 4096
    torch.cuda.synchronize()
    summary = monitor.stop()
    assert summary.throttled in (True, False) and summary.after is not None and summary.after.sm_clock_mhz > 0
    json.dumps(summary.model_dump(mode="json"), allow_nan=False)


def test_calibrated_rates_are_below_the_datasheet():
    result = calibrate("cuda", ["bfloat16", "float32"], QUICK)
    spec = match_gpu(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
    assert result.copy_ is not None and result.copy_.bytes_per_s > 1e11
    assert set(result.matmul) == {"bfloat16", "float32", "tf32"}
    if spec is not None:
        assert 0.2 * spec.bf16_flops < result.matmul["bfloat16"].flops_per_s < 1.1 * spec.bf16_flops
        assert result.copy_.bytes_per_s < 1.1 * spec.memory_bandwidth


def test_the_memory_model_uses_the_devices_free_memory():
    case = Case(heads=64, head_dim=64, seq_len=131072, dtype="bfloat16", device="cuda")
    reason, model = does_not_fit(registry.get("dense"), case)
    assert "free of" in reason and "on the GPU" in reason and model.total_bytes > 2**40


class Holder:
    """A reference cycle, as exception tracebacks make: freed only by a garbage collection."""


def test_after_an_out_of_memory_error_memory_is_released_and_the_next_pair_runs(monkeypatch):
    class Greedy(registry.Impl):
        name = "greedy"

        def prepare(self, case, pattern, q, k, v):
            def call():
                free, _ = torch.cuda.mem_get_info()
                holder = Holder()
                holder.cycle, holder.half = holder, torch.empty(free // 2, dtype=torch.uint8, device="cuda")
                return torch.empty(free, dtype=torch.uint8, device="cuda")  # more than is left: OOM

            return call

    greedy, real_get = Greedy(), registry.get
    monkeypatch.setattr(registry, "get", lambda name: greedy if name == "greedy" else real_get(name))
    case = Case(heads=2, head_dim=32, seq_len=256, device="cuda")
    measure_json = {"warmup": 1, "repeat": 5, "max_time_s": 0.1, "check": True}
    cache = CaseCache()
    failed = measure_task(Task.of(case, "greedy", measure_json), cache)
    assert failed.status == "failed" and failed.reason.startswith("out of memory during first call"), failed.reason
    free, total = torch.cuda.mem_get_info()
    assert free > total / 3  # the half-of-free block held in a cycle was collected and returned
    ok = measure_task(Task.of(case, "dense", measure_json), cache)
    assert ok.status == "ok" and ok.env is not None
    known = match_gpu(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
    assert (ok.peak is not None and ok.peak.source == "datasheet") == (known is not None)
