"""What the measurements were taken on: git state, host, CPU, GPUs, library versions, and a fingerprint.

The fingerprint hashes only the fields that make timings comparable (hardware, driver, library versions),
not the commit or the time, so two runs of different commits on the same machine share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str, cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info(cwd: Path | None = None) -> dict[str, Any]:
    """Commit, branch and dirty flag of the repository holding this code (or cwd's), or nulls."""
    for where in ([cwd] if cwd else []) + [PROJECT_ROOT, Path.cwd()]:
        commit = _git("rev-parse", "HEAD", cwd=where)
        if commit:
            branch = _git("rev-parse", "--abbrev-ref", "HEAD", cwd=where)
            status = _git("status", "--porcelain", "--untracked-files=no", cwd=where)
            return {"commit": commit, "branch": branch, "dirty": bool(status)}
    return {"commit": None, "branch": None, "dirty": None}


def cpu_info() -> dict[str, Any]:
    model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"model": model, "logical_cores": os.cpu_count(), "usable_cores": usable,
            "machine": platform.machine()}


def versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "triton": None}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # a broken triton install must not stop the run
        pass
    for name in ("numpy", "scipy"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def gpus() -> list[dict[str, Any]]:
    """One entry per visible CUDA device; empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        out.append({"index": index, "name": props.name, "memory_bytes": props.total_memory,
                    "sm_count": props.multi_processor_count,
                    "capability": f"{props.major}.{props.minor}",
                    "l2_cache_bytes": getattr(props, "L2_cache_size", None)})
    return out


def fingerprint(env: dict[str, Any]) -> str:
    """Hash of what makes timings comparable: CPU, GPUs, driver, library versions and the backend."""
    key = {
        "cpu": [env.get("cpu", {}).get(k) for k in ("model", "usable_cores", "machine")],
        "gpus": [[g.get(k) for k in ("name", "memory_bytes", "driver")] for g in env.get("gpus", [])],
        "versions": [env.get("versions", {}).get(k) for k in ("torch", "cuda", "triton")],
        "backend": env.get("backend"),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def capture(backend: str) -> dict[str, Any]:
    """The `env` of run.json. `backend` is the device kind the run measures on: cpu or cuda."""
    env: dict[str, Any] = {
        "git": git_info(),
        "host": {"hostname": socket.gethostname(), "os": platform.platform()},
        "cpu": cpu_info(),
        "gpus": gpus(),
        "versions": versions(),
        "backend": backend,
    }
    env["fingerprint"] = fingerprint(env)
    return env


def device_description(device: str) -> str:
    """Human-readable name of the device a record was measured on."""
    if device.startswith("cuda"):
        import torch

        index = torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    return f"cpu: {cpu_info()['model']}"
