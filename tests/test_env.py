"""Environment capture with and without NVML (a fake pynvml), throttling detection, the fingerprint."""

from __future__ import annotations

import json
import re
import sys

import pytest

from bench.cli import main
from bench.measure import pair as measure_module
from bench.measure.machine import env as env_module
from bench.measure.machine.nvml import GpuMonitor, Nvml, UnmonitoredGpu, decode_reasons, device_monitor
from bench.results.environment import Environment
from bench.results.records import DeviceState, GpuIdentity
from bench.spec.case import Case
from tests.fake_nvml import FakeGpu, fake_torch, make_module

H100_UUID = "11111111-2222-3333-4444-555555555555"
A4090_UUID = "99999999-8888-7777-6666-555555555555"


def two_gpus() -> list[FakeGpu]:
    return [FakeGpu(),
            FakeGpu(name="NVIDIA GeForce RTX 4090", uuid=f"GPU-{A4090_UUID}", memory_total=25_757_220_864,
                    power_limit_mw=450_000, temperature=61, reasons=0x4 | 0x1,
                    unsupported={"nvmlDeviceGetViolationStatus"})]


def test_this_machine_without_nvml_records_it_cleanly():
    env = env_module.capture("cpu").model_dump(mode="json", by_alias=True)
    assert env["gpus"] == []
    assert env["nvml"]["available"] is False
    assert "NVML" in env["nvml"]["reason"] and env["nvml"]["driver"] is None
    assert re.fullmatch(r"[0-9a-f]{16}", env["fingerprint"])
    assert env["fingerprint"] == env_module.capture("cpu").computed_fingerprint()  # the hash of its own fields
    assert env["versions"]["torch"] and env["versions"]["nvidia-ml-py"]
    assert env["cpu"]["usable_cores"] >= 1 and env["cpu"]["torch_threads"] >= 1
    json.dumps(env, allow_nan=False)  # storable as is


def test_missing_nvidia_ml_py_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    nvml = Nvml()
    assert not nvml.available and nvml.reason == "nvidia-ml-py (pynvml) is not installed"
    assert env_module.gpus(nvml, fake_torch()) == [] and nvml.count() == 0


def test_library_not_found_is_a_reason():
    nvml = Nvml(make_module([FakeGpu()], library_missing=True))
    assert not nvml.available
    assert nvml.reason == "NVML unavailable: NVML Shared Library Not Found"
    assert env_module.nvml_status(nvml).model_dump() == {"available": False, "reason": nvml.reason, "driver": None,
                                            "cuda_driver": None}


def test_gpus_seen_by_nvml_only_are_listed_with_every_field():
    nvml = Nvml(make_module(two_gpus()))
    env = env_module.capture("cpu", nvml=nvml, torch_module=fake_torch()).model_dump(mode="json", by_alias=True)
    assert env["nvml"] == {"available": True, "reason": None, "driver": "550.54.15", "cuda_driver": "12.4"}
    h100, rtx = env["gpus"]
    assert h100["cuda_index"] is None and h100["nvml_index"] == 0
    assert h100["name"] == "NVIDIA H100 80GB HBM3" and h100["uuid"] == f"GPU-{H100_UUID}"
    assert h100["memory_bytes"] == 85_520_809_984 and h100["driver"] == "550.54.15"
    assert (h100["sm_clock_max_mhz"], h100["mem_clock_max_mhz"], h100["power_limit_w"]) == (1980, 2619, 700.0)
    state = h100["state"]
    assert (state["sm_clock_mhz"], state["mem_clock_mhz"], state["temperature_c"]) == (1980, 2619, 35)
    assert state["power_w"] == 120.0 and state["clock_event_reasons"] == ["gpu_idle"]
    assert state["violation_ns"] == {"power": 0, "thermal": 0}
    assert rtx["power_limit_w"] == 450.0 and rtx["state"]["clock_event_reasons"] == ["gpu_idle", "sw_power_cap"]
    assert rtx["state"]["violation_ns"] == {"power": None, "thermal": None}  # not supported: null, no error


def test_cuda_devices_join_nvml_by_uuid_not_by_index():
    # CUDA numbers the 4090 first (CUDA_DEVICE_ORDER=FASTEST_FIRST), NVML numbers it second
    torch = fake_torch([("NVIDIA GeForce RTX 4090", A4090_UUID, 25_757_220_864),
                        ("NVIDIA H100 80GB HBM3", H100_UUID, 85_520_809_984)])
    gpus = env_module.gpus(Nvml(make_module(two_gpus())), torch)
    assert [(g["cuda_index"], g["nvml_index"], g["name"]) for g in gpus] == [
        (0, 1, "NVIDIA GeForce RTX 4090"), (1, 0, "NVIDIA H100 80GB HBM3")]
    assert gpus[0]["power_limit_w"] == 450.0 and gpus[0]["sm_count"] == 132 and gpus[0]["nvml"] is True


def test_torch_gpus_without_nvml_keep_what_torch_knows():
    torch = fake_torch([("NVIDIA H200", H100_UUID, 150_000_000_000)])
    (gpu,) = env_module.gpus(Nvml(make_module([], library_missing=True)), torch)
    assert gpu["name"] == "NVIDIA H200" and gpu["memory_bytes"] == 150_000_000_000 and gpu["nvml"] is False
    assert gpu["driver"] is None and "power_limit_w" not in gpu


@pytest.mark.parametrize(("mask", "names"), [
    (0, []), (0x1, ["gpu_idle"]), (0x24, ["sw_power_cap", "sw_thermal_slowdown"]),
    (0x40 | 0x80, ["hw_thermal_slowdown", "hw_power_brake_slowdown"]), (0x1000, ["unknown_0x1000"]),
    (None, None)])
def test_clock_event_reasons_decode(mask, names):
    assert decode_reasons(mask) == names


def monitor_of(gpu: FakeGpu) -> GpuMonitor:
    nvml = Nvml(make_module([gpu]))
    return GpuMonitor(nvml, nvml.handle(index=0), GpuIdentity(cuda_index=0, uuid=gpu.uuid, name=gpu.name))


def test_a_thermal_slowdown_seen_after_the_timing_marks_the_record_throttled():
    gpu = FakeGpu(reasons=0x0)
    monitor = monitor_of(gpu)
    monitor.start()
    gpu.reasons, gpu.sm_clock, gpu.temperature = 0x20, 1410, 87
    summary = monitor.stop()
    assert summary.throttled is True and summary.throttle_reasons == ["sw_thermal_slowdown"]
    assert (summary.before.sm_clock_mhz, summary.after.sm_clock_mhz) == (1980, 1410)
    assert summary.after.temperature_c == 87


def test_throttling_between_the_samples_is_caught_by_the_violation_counters():
    gpu = FakeGpu(reasons=0x0)
    monitor = monitor_of(gpu)
    monitor.start()
    gpu.violation_ns[0] += 250_000_000  # 0.25 s power-capped, over by the time we look again
    summary = monitor.stop()
    assert summary.throttled is True and summary.throttle_reasons == []
    assert summary.violation_s == {"power": 0.25, "thermal": 0.0}


def test_idle_and_power_cap_reasons_differ():
    gpu = FakeGpu(reasons=0x1)  # idle before the timing is not throttling
    monitor = monitor_of(gpu)
    monitor.start()
    gpu.reasons = 0x0
    assert monitor.stop().throttled is False


def test_unknown_throttling_is_null_not_false():
    gpu = FakeGpu(unsupported={"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetViolationStatus"})
    monitor = monitor_of(gpu)
    monitor.start()
    assert monitor.stop().throttled is None


def test_device_monitor_matches_the_cuda_device_by_uuid():
    nvml = Nvml(make_module(two_gpus()))
    assert device_monitor("cpu", nvml=nvml) is None
    torch = fake_torch([("NVIDIA H100 80GB HBM3", H100_UUID, 1), ("NVIDIA GeForce RTX 4090", A4090_UUID, 1)],
                       current=1)
    monitor = device_monitor("cuda", nvml=nvml, torch_module=torch)
    assert isinstance(monitor, GpuMonitor)
    assert monitor.gpu == GpuIdentity(cuda_index=1, uuid=f"GPU-{A4090_UUID}", name="NVIDIA GeForce RTX 4090")
    monitor.start()
    assert monitor.stop().throttled is True  # the 4090 sits at its power cap (0x4)


def test_device_monitor_without_nvml_says_why():
    monitor = device_monitor("cuda", nvml=Nvml(make_module([], library_missing=True)), torch_module=fake_torch())
    assert isinstance(monitor, UnmonitoredGpu)
    monitor.start()
    assert monitor.stop() == DeviceState(reason="NVML unavailable: NVML Shared Library Not Found")
    torch = fake_torch([("Some GPU", "00000000-0000-0000-0000-000000000000", 1)])
    unmatched = device_monitor("cuda", nvml=Nvml(make_module(two_gpus())), torch_module=torch)
    assert isinstance(unmatched, UnmonitoredGpu) and "no NVML GPU matches cuda:0" in unmatched.reason


def test_fingerprint_follows_hardware_driver_and_versions_only():
    base = env_module.capture("cpu", nvml=Nvml(make_module(two_gpus())), torch_module=fake_torch()).model_dump(
        mode="json", by_alias=True)

    def fp(env: dict) -> str:
        return Environment.model_validate(env).computed_fingerprint()

    def changed(path: list, value) -> str:
        copy = json.loads(json.dumps(base))
        target = copy
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return fp(copy)

    assert fp(base) == base["fingerprint"]
    for same in (["host", "hostname"], ["git", "commit"]):
        assert changed(same, "other") == fp(base)
    assert changed(["gpus", 0, "state", "temperature_c"], 90) == fp(base)
    for different, value in ((["gpus", 0, "driver"], "535.1"), (["gpus", 1, "power_limit_w"], 300.0),
                             (["gpus", 0, "name"], "NVIDIA H200"), (["versions", "torch"], "2.0"),
                             (["backend"], "cuda"), (["cpu", "torch_threads"], 64)):
        assert changed(different, value) != fp(base), different


def test_measure_records_the_device_state_around_the_timing(monkeypatch):
    gpu = FakeGpu(reasons=0x0)
    monitor = monitor_of(gpu)
    original = monitor.stop

    def stop_after_heating():
        gpu.reasons = 0x40  # the GPU hit its hardware thermal limit while being timed
        return original()

    monitor.stop = stop_after_heating
    monkeypatch.setattr(measure_module, "device_monitor", lambda device: monitor)
    case = Case(heads=1, head_dim=8, seq_len=32, window=8, device="cpu")
    task = measure_module.Task.of(case, "dense",
                               {"warmup": 1, "repeat": 3, "max_time_s": 0.01, "check": True})
    record = measure_module.measure_task(task, measure_module.CaseCache())
    assert record.status == "ok"
    assert record.env is not None and record.env.throttled is True
    assert record.env.throttle_reasons == ["hw_thermal_slowdown"] and record.env.gpu is not None
    assert record.env.gpu.name == "NVIDIA H100 80GB HBM3"


def test_cpu_records_have_no_device_state():
    case = Case(heads=1, head_dim=8, seq_len=32, window=8, device="cpu")
    task = measure_module.Task.of(case, "dense",
                               {"warmup": 1, "repeat": 3, "max_time_s": 0.01, "check": False})
    assert measure_module.measure_task(task, measure_module.CaseCache()).env is None


def test_bench_env_prints_json(capsys):
    assert main(["env"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert set(env) == {"git", "host", "cpu", "gpus", "nvml", "versions", "backend", "fingerprint"}


def test_a_copied_tree_takes_its_commit_from_whoever_copied_it(tmp_path, monkeypatch):
    from bench.measure.machine import env

    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    own = env.git_info()
    assert own.commit is not None and len(own.commit) == 40  # this checkout's own repository
    monkeypatch.setenv("BENCH_GIT_COMMIT", "0123abc")  # stated: wins over the repository beside the tree
    info = env.git_info()
    assert (info.commit, info.dirty, info.branch) == ("0123abc", False, None)
    monkeypatch.setenv("BENCH_GIT_DIRTY", "1")
    assert env.git_info().dirty is True
    monkeypatch.delenv("BENCH_GIT_COMMIT")
    monkeypatch.setattr(env, "PROJECT_ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)  # no repository above a fresh temporary directory, nothing stated
    assert env.git_info().commit is None
