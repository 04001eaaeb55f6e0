"""A fake `pynvml` module: the functions bench.measure.machine.nvml calls, over GPUs whose state a test can change.

Values follow NVML's units: memory in bytes, clocks in MHz, power in milliwatts, temperature in C,
violation time in nanoseconds; names and UUIDs come back as str, as nvidia-ml-py returns them.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    def __str__(self) -> str:
        return "NVML Shared Library Not Found"


class NVMLError_NotSupported(NVMLError):
    def __str__(self) -> str:
        return "Not Supported"


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-11111111-2222-3333-4444-555555555555"
    memory_total: int = 85_520_809_984
    memory_used: int = 600 * 2**20
    sm_clock: int = 1980
    mem_clock: int = 2619
    sm_clock_max: int = 1980
    mem_clock_max: int = 2619
    power_limit_mw: int = 700_000
    power_mw: int = 120_000
    temperature: int = 35
    reasons: int = 0x1  # idle
    violation_ns: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})
    unsupported: set[str] = field(default_factory=set)  # function names that raise NotSupported


def make_module(gpus: list[FakeGpu], driver: str = "550.54.15", cuda: int = 12040,
                library_missing: bool = False) -> types.SimpleNamespace:
    calls: list[str] = []

    def api(name, fn):
        def wrapped(*args):
            calls.append(name)
            if library_missing:
                raise NVMLError_LibraryNotFound()
            gpu = args[0] if args and isinstance(args[0], FakeGpu) else None
            if gpu is not None and name in gpu.unsupported:
                raise NVMLError_NotSupported()
            return fn(*args)

        return wrapped

    def by_uuid(uuid):
        for gpu in gpus:
            if gpu.uuid == uuid:
                return gpu
        raise NVMLError("Not Found")

    def by_index(index):
        if not 0 <= index < len(gpus):
            raise NVMLError("Invalid Argument")
        return gpus[index]

    def clock(gpu, kind):
        return {1: gpu.sm_clock, 2: gpu.mem_clock}[kind]

    def max_clock(gpu, kind):
        return {1: gpu.sm_clock_max, 2: gpu.mem_clock_max}[kind]

    def violation(gpu, policy):
        return types.SimpleNamespace(referenceTime=0, violationTime=gpu.violation_ns[policy])

    functions = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlSystemGetDriverVersion": lambda: driver,
        "nvmlSystemGetCudaDriverVersion_v2": lambda: cuda,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": by_index,
        "nvmlDeviceGetHandleByUUID": by_uuid,
        "nvmlDeviceGetName": lambda g: g.name,
        "nvmlDeviceGetUUID": lambda g: g.uuid,
        "nvmlDeviceGetMemoryInfo": lambda g: types.SimpleNamespace(total=g.memory_total, used=g.memory_used,
                                                                   free=g.memory_total - g.memory_used),
        "nvmlDeviceGetEnforcedPowerLimit": lambda g: g.power_limit_mw,
        "nvmlDeviceGetPowerUsage": lambda g: g.power_mw,
        "nvmlDeviceGetClockInfo": clock,
        "nvmlDeviceGetMaxClockInfo": max_clock,
        "nvmlDeviceGetTemperature": lambda g, sensor: g.temperature,
        "nvmlDeviceGetCurrentClocksEventReasons": lambda g: g.reasons,
        "nvmlDeviceGetViolationStatus": violation,
    }
    module = types.SimpleNamespace(**{name: api(name, fn) for name, fn in functions.items()})
    module.NVMLError = NVMLError
    module.calls = calls
    return module


def fake_torch(cuda_devices: list[tuple[str, str, int]] | None = None, current: int = 0) -> types.SimpleNamespace:
    """The slice of torch that bench.env/bench.measure.machine.nvml use; devices are (name, uuid without 'GPU-',
    bytes)."""
    devices = cuda_devices or []

    def props(index):
        name, uuid, memory = devices[index]
        return types.SimpleNamespace(name=name, uuid=uuid, total_memory=memory, multi_processor_count=132,
                                     major=9, minor=0, L2_cache_size=50 * 2**20)

    cuda = types.SimpleNamespace(is_available=lambda: bool(devices), device_count=lambda: len(devices),
                                 get_device_properties=props, current_device=lambda: current)
    return types.SimpleNamespace(cuda=cuda)
