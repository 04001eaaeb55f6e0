"""NVML through nvidia-ml-py: what each GPU is, what state it is in, and whether it throttled while measured.

Every query is optional: a GPU that does not support one (power on some boards, violation counters on
GeForce) gives null for that field, and a machine without the NVML library or without a GPU gives
`available: false` with the reason, never an exception. Tests pass a fake module with the same functions.
"""

from __future__ import annotations

import time
from typing import Any

from bench.results.records import DeviceState, GpuIdentity, GpuState

# Clock event ("throttle") reason bits, nvml.h `nvmlClocksEventReason*` (NVML API reference, Device Queries).
REASON_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that hold clocks below what the work asks for. Idle, a user clock setting, sync boost and the
# display clock do not slow a measurement down on their own.
THROTTLING = frozenset({"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                        "hw_power_brake_slowdown"})
# nvml.h nvmlPerfPolicyType_t: cumulative time (ns) the GPU spent held back by each policy.
VIOLATION_POLICIES = {"power": 0, "thermal": 1}
NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2  # nvmlClockType_t
NVML_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t


def decode_reasons(mask: int | None) -> list[str] | None:
    """Bit mask -> reason names, e.g. 0x24 -> ['sw_power_cap', 'sw_thermal_slowdown']."""
    if mask is None:
        return None
    names = [name for bit, name in REASON_BITS.items() if mask & bit]
    unknown = mask & ~sum(REASON_BITS)
    if unknown:
        names.append(f"unknown_0x{unknown:x}")
    return names


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """A session with NVML, or the reason there is none. `module` is pynvml or a test fake."""

    def __init__(self, module: Any = None) -> None:
        self.reason: str | None = None
        self._nv: Any = None
        if module is None:
            try:
                import pynvml

                module = pynvml
            except ImportError:
                self.reason = "nvidia-ml-py (pynvml) is not installed"
                return
        try:
            module.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: a CPU machine
            self.reason = f"NVML unavailable: {_text(exc) or type(exc).__name__}"
            return
        self._nv = module

    @property
    def available(self) -> bool:
        return self._nv is not None

    def _try(self, name: str, *args: Any) -> Any:
        """Result of module.name(*args), or None where the GPU or driver does not support it."""
        try:
            return getattr(self._nv, name)(*args)
        except Exception:  # NVMLError_NotSupported, _NoPermission, an older library without the function
            return None

    def driver(self) -> dict[str, Any]:
        """Driver version and the CUDA version the driver supports ('12.4'), or nulls."""
        if not self.available:
            return {"driver": None, "cuda_driver": None}
        cuda = self._try("nvmlSystemGetCudaDriverVersion_v2") or self._try("nvmlSystemGetCudaDriverVersion")
        driver = self._try("nvmlSystemGetDriverVersion")
        return {"driver": _text(driver) if driver is not None else None,
                "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None}

    def count(self) -> int:
        return (self._try("nvmlDeviceGetCount") or 0) if self.available else 0

    def handle(self, index: int | None = None, uuid: str | None = None) -> Any:
        """Handle by NVML index or by UUID (with or without the 'GPU-' prefix torch leaves off)."""
        if uuid is not None:
            for candidate in (uuid, f"GPU-{uuid}", f"MIG-{uuid}"):
                found = self._try("nvmlDeviceGetHandleByUUID", candidate)
                if found is not None:
                    return found
            return None
        return self._try("nvmlDeviceGetHandleByIndex", index)

    def describe(self, handle: Any) -> dict[str, Any]:
        """What does not change while we measure: name, UUID, memory, max clocks, power limit."""
        memory = self._try("nvmlDeviceGetMemoryInfo", handle)
        power_limit = self._try("nvmlDeviceGetEnforcedPowerLimit", handle)  # mW
        name, uuid = self._try("nvmlDeviceGetName", handle), self._try("nvmlDeviceGetUUID", handle)
        return {
            "name": _text(name) if name is not None else None,
            "uuid": _text(uuid) if uuid is not None else None,
            "memory_bytes": int(memory.total) if memory is not None else None,
            "sm_clock_max_mhz": self._try("nvmlDeviceGetMaxClockInfo", handle, NVML_CLOCK_SM),
            "mem_clock_max_mhz": self._try("nvmlDeviceGetMaxClockInfo", handle, NVML_CLOCK_MEM),
            "power_limit_w": power_limit / 1000 if power_limit is not None else None,
        }

    def state(self, handle: Any) -> GpuState:
        """What can change while we measure: clocks, temperature, power, memory used, throttle reasons."""
        reasons = self._try("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if reasons is None:
            reasons = self._try("nvmlDeviceGetCurrentClocksThrottleReasons", handle)  # drivers before 535
        power = self._try("nvmlDeviceGetPowerUsage", handle)  # mW
        memory = self._try("nvmlDeviceGetMemoryInfo", handle)
        violations = {}
        for policy, code in VIOLATION_POLICIES.items():
            status = self._try("nvmlDeviceGetViolationStatus", handle, code)
            violations[policy] = int(status.violationTime) if status is not None else None
        return GpuState(time=time.time(), sm_clock_mhz=self._try("nvmlDeviceGetClockInfo", handle, NVML_CLOCK_SM),
                        mem_clock_mhz=self._try("nvmlDeviceGetClockInfo", handle, NVML_CLOCK_MEM),
                        temperature_c=self._try("nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU),
                        power_w=power / 1000 if power is not None else None,
                        memory_used_bytes=int(memory.used) if memory is not None else None,
                        clock_event_reasons=decode_reasons(reasons), violation_ns=violations)

    def all_gpus(self) -> list[dict[str, Any]]:
        """describe() + state() of every GPU NVML sees, with its NVML index."""
        out = []
        for index in range(self.count()):
            handle = self.handle(index=index)
            if handle is not None:
                out.append({"nvml_index": index, **self.describe(handle),
                            "state": self.state(handle).model_dump()})
        return out


_SHARED: Nvml | None = None


def shared() -> Nvml:
    """One NVML session per process (nvmlInit is reference-counted; process exit releases it)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Nvml()
    return _SHARED


def throttle_summary(gpu: GpuIdentity, before: GpuState, after: GpuState) -> DeviceState:
    """The record's `env`: device state before and after the measurement and whether it was throttled.

    Throttled when a slowing reason is active at either sample, or when NVML's cumulative power/thermal
    violation time grew in between (which catches throttling that started and ended between samples).
    """
    reasons: set[str] = set()
    for sample in (before, after):
        reasons |= set(sample.clock_event_reasons or []) & THROTTLING
    violation_s: dict[str, float | None] = {}
    for policy in VIOLATION_POLICIES:
        b, a = before.violation_ns.get(policy), after.violation_ns.get(policy)
        violation_s[policy] = (a - b) / 1e9 if a is not None and b is not None else None
    grew = any(v is not None and v > 0 for v in violation_s.values())
    known = before.clock_event_reasons is not None or any(v is not None for v in violation_s.values())
    return DeviceState(gpu=gpu, before=before, after=after, throttle_reasons=sorted(reasons),
                       violation_s=violation_s, throttled=(bool(reasons) or grew) if known else None)


class GpuMonitor:
    """Samples one GPU's state around a measurement. `gpu` identifies it (index, uuid, name) in records."""

    def __init__(self, nvml: Nvml, handle: Any, gpu: GpuIdentity) -> None:
        self.nvml, self.handle, self.gpu = nvml, handle, gpu
        self._before: GpuState | None = None

    def start(self) -> None:
        self._before = self.nvml.state(self.handle)

    def stop(self) -> DeviceState:
        assert self._before is not None, "start() first"
        return throttle_summary(self.gpu, self._before, self.nvml.state(self.handle))


class UnmonitoredGpu:
    """Stands in for a GpuMonitor where NVML cannot see the device; the record says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def start(self) -> None:
        pass

    def stop(self) -> DeviceState:
        return DeviceState(reason=self.reason)


def torch_uuid(props: Any) -> str | None:
    """The UUID torch reports for a device (without NVML's 'GPU-' prefix), or None on old torch."""
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else None


def device_monitor(device: str, nvml: Nvml | None = None, torch_module: Any = None
                   ) -> GpuMonitor | UnmonitoredGpu | None:
    """A monitor of the GPU a measurement on `device` runs on; None on CPU.

    The CUDA device is matched to its NVML handle by UUID, since CUDA and NVML may number GPUs differently
    (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER).
    """
    if not device.startswith("cuda"):
        return None
    if torch_module is None:
        import torch as torch_module
    nvml = nvml if nvml is not None else shared()
    if not nvml.available:
        return UnmonitoredGpu(nvml.reason or "NVML unavailable")
    index = torch_module.cuda.current_device()
    props = torch_module.cuda.get_device_properties(index)
    uuid = torch_uuid(props)
    handle = nvml.handle(uuid=uuid) if uuid else None
    if handle is None:
        return UnmonitoredGpu(f"no NVML GPU matches cuda:{index} (uuid {uuid})")
    described = nvml.describe(handle)
    return GpuMonitor(nvml, handle, GpuIdentity(cuda_index=index, uuid=described["uuid"], name=described["name"]))
