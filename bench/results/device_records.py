"""What a record says of the device around its timing: the GPU's state and throttling (bench.measure.machine.nvml), and
whether the machine was busy (bench.measure.machine.contention)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

_STRICT = ConfigDict(extra="forbid", frozen=True)


class GpuState(BaseModel):
    """What can change on a GPU while it is measured (bench.measure.machine.nvml), sampled before and after."""

    model_config = _STRICT
    time: float
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    memory_used_bytes: int | None = None
    clock_event_reasons: list[str] | None = None  # None: the driver does not say
    violation_ns: dict[str, int | None] = {}  # NVML's cumulative power/thermal violation time


class GpuIdentity(BaseModel):
    model_config = _STRICT
    cuda_index: int
    uuid: str | None = None
    name: str | None = None


class DeviceState(BaseModel):
    """The record's `env`: the GPU's state around the timing and whether it was throttled (None: unknown), or why
    it was not monitored (`reason`)."""

    model_config = _STRICT
    gpu: GpuIdentity | None = None
    before: GpuState | None = None
    after: GpuState | None = None
    throttle_reasons: list[str] = []
    violation_s: dict[str, float | None] = {}
    throttled: bool | None = None
    reason: str | None = None  # not monitored: why


class ContentionInfo(BaseModel):
    """Was the machine busy while the pair was timed (bench.measure.machine.contention): the readings and the
    verdict."""

    model_config = _STRICT
    cpu_pressure: float | None = None  # share of the timed wall time some task waited for a CPU (PSI); null: no PSI
    load: float | None = None  # 1-minute load average over usable cores
    cpu_over_wall: float | None = None  # the process's CPU seconds per wall second over the timed calls
    gpu_throttle: list[str] | None = None  # NVML slowing reasons seen (CUDA only)
    verdict: Literal["quiet", "busy"]
    reason: str | None = None  # the reading that made it busy
    waited_s: float | None = None  # measure.wait_for_quiet_s: seconds waited for quiet before the timing
