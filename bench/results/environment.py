"""What a run was measured on, as typed data: run.json's `env` (git, host, CPU, GPUs, NVML, versions, backend,
calibration) and the fingerprint over the fields that make timings comparable.

Capturing it (reading /proc, NVML, git) is `bench.measure.machine.env`; this module only defines and reads it, so
that every reader - compare, history, export, the dashboards - gets the same fields by the same names. Models
ignore keys they do not know (future fields, or a modelled run's `modelled_hardware`) rather than fail on them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

_OPEN = ConfigDict(extra="allow", frozen=True)


class GitInfo(BaseModel):
    """The checkout a run's code came from: its commit, branch, whether tracked files differ from the commit,
    and then the sha256 of that difference (`git diff HEAD`), so that two dirty trees are told apart."""

    model_config = _OPEN
    commit: str | None = None
    branch: str | None = None
    dirty: bool | None = None
    diff_sha256: str | None = None
    version: str | None = None  # an installed (not a checkout's) bench: its package version, no commit


class HostInfo(BaseModel):
    model_config = _OPEN
    hostname: str | None = None
    os: str | None = None


class CpuInfo(BaseModel):
    model_config = _OPEN
    model: str | None = None
    logical_cores: int | None = None
    usable_cores: int | None = None
    machine: str | None = None
    features: list[str] = Field(default_factory=list)
    torch_threads: int | None = None
    # torch's CPU capability: the vector level its kernels (and blocked's) are built for, DEFAULT, AVX2 or AVX512;
    # lower than the features where ATEN_CPU_CAPABILITY holds it down
    capability: str | None = None


class GpuInfo(BaseModel):
    """One GPU: what torch sees, joined by UUID with what NVML sees (clocks, power, temperature)."""

    model_config = _OPEN
    cuda_index: int | None = None
    name: str | None = None
    memory_bytes: int | None = None
    sm_count: int | None = None
    capability: str | None = None
    l2_cache_bytes: int | None = None
    driver: str | None = None
    uuid: str | None = None
    nvml: bool = False
    power_limit_w: float | None = None


class NvmlStatus(BaseModel):
    model_config = _OPEN
    available: bool = False
    reason: str | None = None
    driver: str | None = None
    cuda_driver: str | None = None


class Versions(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)
    python: str | None = None
    torch: str | None = None
    cuda: str | None = None
    cudnn: int | str | None = None
    nccl: str | None = None
    triton: str | None = None
    numpy: str | None = None
    scipy: str | None = None
    pydantic: str | None = None
    nvidia_ml_py: str | None = Field(default=None, alias="nvidia-ml-py")


class CalibrationTime(BaseModel):
    """How precisely a calibration figure was timed: the median call, its CI half-width, samples, why it stopped."""

    model_config = _OPEN
    median: float
    rel_ci95: float | None = None
    n: int
    stopped_by: str | None = None


class MatmulRate(BaseModel):
    """FLOP/s of a square (n, n) @ (n, n) matmul."""

    model_config = _OPEN
    flops_per_s: float
    n: int | None = None
    time_s: CalibrationTime | None = None


class Bandwidth(BaseModel):
    """Bytes/s moved over a buffer of `bytes` (copy: read and write counted; read: each byte read once)."""

    model_config = _OPEN
    bytes_per_s: float
    bytes: int | None = None
    threads: int | None = None  # read: torch's intra-op threads
    time_s: CalibrationTime | None = None


class Calibration(BaseModel):
    """This machine's matmul rates per dtype, copy and read bandwidths (bench.measure.machine.calibrate), or why it
    failed."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)
    device: str | None = None
    backend: str | None = None
    measured_at: str | None = None
    torch_threads: int | None = None
    matmul: dict[str, MatmulRate] = Field(default_factory=dict)
    copy_: Bandwidth | None = Field(default=None, alias="copy")
    read: dict[str, Bandwidth] | None = None  # all_threads, and one_thread on CPU
    source: str | None = None
    error: str | None = None
    fingerprint: str | None = None  # a stored calibration: the environment it belongs to

    def rate(self, key: str) -> float | None:
        entry = self.matmul.get(key)
        return None if entry is None else entry.flops_per_s

    def read_bandwidth(self) -> float | None:
        """The all-thread read bandwidth (bytes/s), the memory roof of every record on this machine."""
        entry = (self.read or {}).get("all_threads")
        return None if entry is None else entry.bytes_per_s


# The fields of an environment that make timings comparable, in one place: the fingerprint hashes them, and a
# comparison of two environments names the ones that differ. Not the commit, the host name or the time.
FINGERPRINT_FIELDS: dict[str, tuple[str, ...]] = {
    "cpu": ("model", "usable_cores", "machine", "torch_threads"),
    "gpus": ("name", "memory_bytes", "driver", "power_limit_w"),  # per GPU
    "versions": ("torch", "cuda", "triton"),
    "backend": (),
}


class LoadAt(BaseModel):
    """The machine's load at one moment (bench.measure.machine.contention.machine_load)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    load1: float | None = None
    load5: float | None = None
    load15: float | None = None
    usable_cores: int | None = None
    psi_some_avg10: float | None = None  # share of the last 10 s some task waited for a CPU; null without PSI
    at: float | None = None  # unix time


class RunLoad(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    start: LoadAt | None = None
    end: LoadAt | None = None


class Environment(BaseModel):
    """run.json's `env`."""

    model_config = ConfigDict(extra="allow", frozen=True)
    git: GitInfo = Field(default_factory=GitInfo)
    host: HostInfo = Field(default_factory=HostInfo)
    cpu: CpuInfo = Field(default_factory=CpuInfo)
    gpus: list[GpuInfo] = Field(default_factory=list)
    nvml: NvmlStatus | None = None
    versions: Versions = Field(default_factory=Versions)
    backend: str | None = None
    fingerprint: str | None = None
    calibration: Calibration | None = None
    modelled_hardware: dict[str, Any] | None = None  # a modelled run (bench model): the card's datasheet figures
    load: RunLoad | None = None  # a measured run: the machine's load at its start and end
    code: dict[str, str] | None = None  # sha256 per file of measured code git does not describe (plugins, ...)

    @model_serializer(mode="wrap")
    def _without_absent_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """run.json has `calibration`, `modelled_hardware`, `load` and `code` only when the run has them."""
        data = handler(self)
        for optional in ("calibration", "modelled_hardware", "load", "code"):
            if data.get(optional) is None:
                data.pop(optional, None)
        return data

    def fingerprint_key(self) -> dict[str, Any]:
        """FINGERPRINT_FIELDS of this environment: {"cpu": [model, ...], "gpus": [[name, ...] per GPU], ...}."""
        key: dict[str, Any] = {}
        for section, names in FINGERPRINT_FIELDS.items():
            if section == "backend":
                key[section] = self.backend
            elif section == "gpus":
                key[section] = [[getattr(g, n) for n in names] for g in self.gpus]
            else:
                key[section] = [getattr(getattr(self, section), n) for n in names]
        return key

    def computed_fingerprint(self) -> str:
        """Hash of `fingerprint_key`: equal for two runs of different commits on the same machine."""
        return hashlib.sha256(json.dumps(self.fingerprint_key(), sort_keys=True).encode()).hexdigest()[:16]

    def differences(self, other: Environment) -> list[str]:
        """`cpu.model: A -> B` for each fingerprinted field that differs."""
        out = []
        mine, theirs = self.fingerprint_key(), other.fingerprint_key()
        for section, names in FINGERPRINT_FIELDS.items():
            a, b = mine[section], theirs[section]
            if section == "gpus":
                for i, name in enumerate(names):
                    x, y = [g[i] for g in a], [g[i] for g in b]
                    if x != y:
                        out.append(f"gpus.{name}: {x} -> {y}")
            elif not names:
                if a != b:
                    out.append(f"{section}: {a} -> {b}")
            else:
                out.extend(f"{section}.{n}: {x} -> {y}" for n, x, y in zip(names, a, b, strict=True) if x != y)
        return out

    @property
    def fingerprint_or_unknown(self) -> str:
        return self.fingerprint or "unknown"
