"""Peak memory of one call, inputs not counted.

CUDA: the caching allocator's peak allocated bytes during the call minus what was allocated before it.
CPU: the worker's resident high-water mark (VmHWM) during the call minus its resident size (VmRSS) before
it. Linux resets the mark when `5` is written to /proc/self/clear_refs. The worker is started with
glibc's mmap threshold fixed low (MALLOC_MMAP_THRESHOLD_), so large tensors are mapped and unmapped
directly and the mark follows them instead of reused heap pages.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Environment for worker processes so that the resident mark follows large allocations (see above).
# Setting the threshold also disables glibc's dynamic threshold, which would otherwise grow past it.
WORKER_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def hwm_bytes() -> int | None:
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_hwm() -> bool:
    """Reset the resident high-water mark to the current resident size; False where Linux does not allow."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def cpu_peak_available() -> str | None:
    """None when the CPU method works here, else why not."""
    if rss_bytes() is None:
        return "no /proc/self/status (not Linux)"
    if not reset_hwm():
        return "cannot write /proc/self/clear_refs"
    return None


def measure_cpu_peak(fn: Callable[[], Any]) -> dict[str, Any]:
    """Resident high-water mark of one call of fn minus the resident size before it."""
    why_not = cpu_peak_available()
    if why_not:
        return {"peak_bytes": None, "method": "rss_hwm", "note": why_not}
    gc.collect()
    before = rss_bytes()
    reset_hwm()
    result = fn()
    peak = hwm_bytes()
    del result
    assert before is not None and peak is not None
    return {"peak_bytes": max(0, peak - before), "method": "rss_hwm", "note": None}


def measure_cuda_peak(fn: Callable[[], Any], torch_module: Any = None) -> dict[str, Any]:
    """Peak bytes allocated by the caching allocator during one call, minus what was allocated before."""
    if torch_module is None:
        import torch as torch_module
    cuda = torch_module.cuda
    cuda.synchronize()
    before = cuda.memory_allocated()
    cuda.reset_peak_memory_stats()
    result = fn()
    cuda.synchronize()
    peak = cuda.max_memory_allocated()
    del result
    return {"peak_bytes": max(0, peak - before), "method": "cuda_max_memory_allocated", "note": None}


def measure_peak(fn: Callable[[], Any], device: str) -> dict[str, Any]:
    return measure_cuda_peak(fn) if device.startswith("cuda") else measure_cpu_peak(fn)
