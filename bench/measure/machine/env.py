"""Capturing what the measurements were taken on: git state, host, CPU, GPUs, NVML, library versions.

The result is `bench.results.environment.Environment` (run.json's `env`), whose fingerprint hashes only the
fields that make timings comparable (hardware, driver, library versions), not the commit or the time, so two
runs of different commits on the same machine share it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.measure.machine.nvml import Nvml, shared, torch_uuid
from bench.results.environment import CpuInfo, Environment, GitInfo, NvmlStatus, Versions

PROJECT_ROOT = Path(__file__).resolve().parents[3]  # the checkout holding bench/measure/machine/


def _git(*args: str, cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info(cwd: Path | None = None) -> GitInfo:
    """Commit, branch and dirty flag of the checkout holding this code (or of `cwd`), with the hash of the
    uncommitted changes to tracked files when dirty (untracked files do not count, nor changes under results/ and
    dashboards/, which runs write); an installed bench's version where this code is not a checkout's."""
    stated = stated_git()
    if stated is not None:
        return stated
    if cwd is None and not (PROJECT_ROOT / ".git").exists():
        # an installed bench (not a checkout's): its version, never the commit of whatever directory it runs in
        return GitInfo(version=_installed_version())
    where = cwd or PROJECT_ROOT
    commit = _git("rev-parse", "HEAD", cwd=where)
    if not commit:
        return GitInfo(version=_installed_version())
    code_only = ["--", ".", *(f":(exclude){name}" for name in NOT_CODE)]
    branch = _git("rev-parse", "--abbrev-ref", "HEAD", cwd=where)
    status = _git("status", "--porcelain", "--untracked-files=no", *code_only, cwd=where)
    diff = _git_bytes("diff", "HEAD", "--binary", *code_only, cwd=where) if status else None
    return GitInfo(commit=commit, branch=branch, dirty=bool(status),
                   diff_sha256=hashlib.sha256(diff).hexdigest() if diff is not None else None)


def _installed_version() -> str | None:
    try:
        return importlib.metadata.version("sparse-attention-bench")
    except importlib.metadata.PackageNotFoundError:
        return None


# Changes under these do not make a tree dirty: they are what runs write (results, rendered dashboards), not code.
NOT_CODE = ("results", "dashboards")


def measured_code(plugins: list[str], base_dir: Path | None) -> dict[str, str]:
    """sha256 of each file of measured code that git does not describe: the plugin files (and modules) a suite
    imports, the FlashInfer-Bench solutions registered from a dataset, and untracked files under impls/. Keyed by
    path (relative to the working directory where it lies below it)."""
    files: list[Path] = []
    for spec in plugins:
        if spec.endswith(".py"):
            files.append(((base_dir or Path.cwd()) / spec).resolve())
            continue
        module = sys.modules.get(spec)
        origin = getattr(module, "__file__", None)
        if origin and Path(origin).name == "__init__.py":
            files += sorted(Path(origin).parent.rglob("*.py"))
        elif origin:
            files.append(Path(origin))
    for root in filter(None, os.environ.get("BENCH_FLASHINFER_SOLUTIONS", "").split(os.pathsep)):
        files += sorted((Path(root) / "solutions").rglob("*.json"))
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", "impls", cwd=PROJECT_ROOT)
    files += [PROJECT_ROOT / line for line in (untracked or "").splitlines() if line.strip()]
    out: dict[str, str] = {}
    for path in files:
        if path.is_file() and not path.is_relative_to(PROJECT_ROOT / "bench"):
            out[_shown(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def stated_git() -> GitInfo | None:
    """The commit whoever copied this tree says it is: BENCH_GIT_COMMIT (and BENCH_GIT_DIRTY=1 when the tree
    differs from it), for a tree copied without its .git or beside a .git that is not its own (a container image,
    a tree sent to a GPU machine with a stale repository: seen there, a months-old commit and a dirty flag).
    The copier knows which commit it sent; this code cannot tell. None when unset."""
    commit = os.environ.get("BENCH_GIT_COMMIT", "").strip()
    if not commit:
        return None
    return GitInfo(commit=commit, dirty=os.environ.get("BENCH_GIT_DIRTY", "0").strip() not in ("", "0"))


def _git_bytes(*args: str, cwd: Path) -> bytes | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


# Instruction-set features that change CPU matmul and attention speed (bf16 and AMX paths in oneDNN).
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu_info() -> CpuInfo:
    """CPU model, cores (all and usable by this process), the ISA features that matter, torch's threads."""
    import torch

    model: str | None = None
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's lines suffice
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or None
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return CpuInfo(model=model, logical_cores=os.cpu_count(), usable_cores=usable, machine=platform.machine(),
                   features=[f for f in CPU_FEATURES if f in flags], torch_threads=torch.get_num_threads(),
                   capability=torch.backends.cpu.get_cpu_capability())


@functools.lru_cache(maxsize=1)
def cpu_features() -> list[str]:
    """This CPU's instruction-set features among CPU_FEATURES that this process's torch uses (read once per process):
    where ATEN_CPU_CAPABILITY holds torch below the CPU (AVX2 on an AVX512 machine), the levels above it are left
    out, as a CPU of that level would not have them."""
    info = cpu_info()
    above = {"DEFAULT": ("avx", "fma", "amx"), "AVX2": ("avx512", "amx")}.get(info.capability or "", ())
    return [f for f in info.features if not f.startswith(above)]


def versions() -> Versions:
    """Python, torch (and the CUDA, cuDNN and NCCL it was built with), triton and the numeric libraries."""
    import torch

    out: dict[str, str | int | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                        "cuda": torch.version.cuda, "cudnn": None, "nccl": None}
    if torch.cuda.is_available():
        out["cudnn"] = torch.backends.cudnn.version()
        with contextlib.suppress(Exception):  # torch built without NCCL
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    # Installed versions from the package metadata: importing triton here would fix its interpreter-or-compiled
    # mode for the whole process before the Triton implementation could choose it.
    for name in ("triton", "numpy", "scipy", "pydantic", "nvidia-ml-py"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return Versions.model_validate(out)


def gpus(nvml: Nvml | None = None, torch_module: Any = None) -> list[dict[str, Any]]:
    """One entry per GPU: what torch sees (index, SMs, capability, L2) joined by UUID with what NVML sees
    (UUID, driver, memory, clocks current and max, power limit and draw, temperature, clock event reasons).

    A GPU that NVML sees but torch does not (a CPU-only torch build) is listed with `cuda_index: null`.
    """
    if torch_module is None:
        import torch as torch_module
    nvml = nvml if nvml is not None else shared()
    by_uuid = {g["uuid"]: g for g in nvml.all_gpus()}
    driver = nvml.driver()["driver"]
    out = []
    if torch_module.cuda.is_available():
        for index in range(torch_module.cuda.device_count()):
            props = torch_module.cuda.get_device_properties(index)
            uuid = torch_uuid(props)
            seen = by_uuid.pop(f"GPU-{uuid}", None) or by_uuid.pop(f"MIG-{uuid}", None) or by_uuid.pop(uuid, None)
            entry = {"cuda_index": index, "name": props.name, "memory_bytes": int(props.total_memory),
                     "sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
                     "l2_cache_bytes": getattr(props, "L2_cache_size", None), "driver": driver,
                     "uuid": f"GPU-{uuid}" if uuid else None, "nvml": seen is not None}
            if seen is not None:
                entry.update({k: v for k, v in seen.items() if k not in ("name", "memory_bytes")})
            out.append(entry)
    for seen in by_uuid.values():  # visible to NVML only
        out.append({"cuda_index": None, "driver": driver, "nvml": True, **seen})
    return out


def nvml_status(nvml: Nvml | None = None) -> NvmlStatus:
    """Whether NVML answered, why not, and the driver and driver-CUDA versions."""
    nvml = nvml if nvml is not None else shared()
    return NvmlStatus(available=nvml.available, reason=nvml.reason, **nvml.driver())


def capture(backend: str, nvml: Nvml | None = None, torch_module: Any = None) -> Environment:
    """The `env` of run.json. `backend` is the device kind the run measures on: cpu or cuda."""
    nvml = nvml if nvml is not None else shared()
    env = Environment.model_validate({
        "git": git_info().model_dump(),
        "host": {"hostname": socket.gethostname(), "os": platform.platform()},
        "cpu": cpu_info().model_dump(),
        "gpus": gpus(nvml, torch_module),
        "nvml": nvml_status(nvml).model_dump(),
        "versions": versions().model_dump(by_alias=True),
        "backend": backend,
    })
    return env.model_copy(update={"fingerprint": env.computed_fingerprint()})


def device_description(device: str) -> str:
    """Human-readable name of the device a record was measured on."""
    if device.startswith("cuda"):
        import torch

        index = torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    info = cpu_info()
    return f"cpu: {info.model} ({info.capability})" if info.capability else f"cpu: {info.model}"
