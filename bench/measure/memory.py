"""Peak memory of one call, inputs not counted.

CUDA: the caching allocator's peak allocated bytes during the call minus what was allocated before it.
CPU: the worker's resident high-water mark (VmHWM) during the call minus its resident size (VmRSS) before
it. Linux resets the mark when `5` is written to /proc/self/clear_refs.

On CPU the resident mark only follows allocations if freed memory leaves the process and new memory is
touched afresh. glibc's heap keeps freed chunks resident and reuses them, so for the measured call only the
allocator is switched (`mallopt`) to map every allocation of 64 KiB or more directly and to give freed
memory back at once, after `malloc_trim(0)` has released what the heap held. Timing runs with glibc's
usual steady state instead (allocations under 32 MiB reused from the heap, the ceiling glibc's own dynamic
threshold grows to): mapping every allocation afresh makes each call fault its pages in again, which made
calls with many temporaries up to 2x slower than in a user's process.

Switching at the measured call is not enough where the heap already holds large free chunks: glibc serves a
request from a free chunk that fits before it considers mapping, so the call reuses what earlier calls left
and the figure depends on that layout (csr's same call read 13.5 to 23 MB from one process to the next). A
process that only measures memory (`bench.measure.fresh_memory.memory_alone`, in a fresh process) therefore tracks
from its start (`track_allocations`): no large chunk ever lives on its heap, and the figure repeats (13.5 to
13.7 MB over the same processes).

Linux keeps the resident counters per CPU and /proc reads them without summing the per-CPU parts, so each
figure is off by up to a few hundred KiB (a 2.1 MiB call read 2.09 to 2.36 MB over eight runs on a 2-CPU
machine): figures of a few MB are coarse, those of tens of MB and more are not.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.patterns.heap import LIBC
from bench.results.records import MemoryInfo

# glibc mallopt parameters (malloc.h) and the values used while timing and while measuring memory.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TIMING_MMAP_THRESHOLD = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc: the dynamic ceiling
TIMING_TRIM_THRESHOLD = 2 * TIMING_MMAP_THRESHOLD  # glibc keeps trim at twice the dynamic mmap threshold
TRACKING_MMAP_THRESHOLD = 64 * 2**10
TRACKING_TRIM_THRESHOLD = 0

# Environment for worker processes: glibc's steady state from the first task on, so that no measurement
# depends on which tasks ran before it in the same worker (fixing the thresholds ends glibc's adaptation).
# One arena for all threads: malloc_trim cannot release the top of a thread's own arena, so memory that
# implementations running steps on threads (csr, blocked) freed while timing would stay resident until
# the measured call freed it again, hiding that much of its peak (a third of it, measured).
WORKER_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(TIMING_MMAP_THRESHOLD),
                     "MALLOC_TRIM_THRESHOLD_": str(TIMING_TRIM_THRESHOLD),
                     "MALLOC_ARENA_MAX": "1"}

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


_LIBC = LIBC


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc's mmap and trim thresholds (bytes); False where the C library is not glibc."""
    if _LIBC is None:
        return False
    ok = _LIBC.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold))
    return bool(ok and _LIBC.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold)))


def track_allocations() -> bool:
    """From now on, map every allocation of 64 KiB or more and give freed memory back at once (for a process
    that measures memory only); False where the C library is not glibc."""
    return set_malloc_thresholds(TRACKING_MMAP_THRESHOLD, TRACKING_TRIM_THRESHOLD)


@contextlib.contextmanager
def tracking_allocator() -> Iterator[bool]:
    """Inside: every allocation of 64 KiB or more is mapped afresh, freed memory leaves the process, and the
    cyclic garbage collector does not run.

    Yields whether the switch was possible; on leaving, the timing thresholds are restored.
    """
    switched = set_malloc_thresholds(TRACKING_MMAP_THRESHOLD, TRACKING_TRIM_THRESHOLD)
    collecting = gc.isenabled()
    try:
        # The young generations hold what the timed calls left in cycles; the oldest is not walked (after a
        # torch.compile it held 300k objects: a full collection took 150 ms a pair, a third of the smoke
        # suite). What it may hold stays allocated through the call (the collector is off), so the call
        # cannot reuse it unseen: it is in the resident size before the call and not in the difference.
        gc.collect(1)
        gc.disable()
        if switched:
            _LIBC.malloc_trim(ctypes.c_size_t(0))  # release the resident free chunks timing left behind
        yield switched
    finally:
        if collecting:
            gc.enable()
        if switched:
            set_malloc_thresholds(TIMING_MMAP_THRESHOLD, TIMING_TRIM_THRESHOLD)


def measure_cpu_peak(fn: Callable[[], Any]) -> MemoryInfo:
    """Resident high-water mark of one call of fn minus the resident size before it."""
    why_not = cpu_peak_available()
    if why_not:
        return MemoryInfo(peak_bytes=None, method="rss_hwm", note=why_not)
    with tracking_allocator() as switched:
        before = rss_bytes()
        reset_hwm()
        result = fn()
        peak = hwm_bytes()
        del result
    assert before is not None and peak is not None
    note = None if switched else "C library is not glibc: freed heap memory may be reused unseen (a lower bound)"
    return MemoryInfo(peak_bytes=max(0, peak - before), method="rss_hwm", note=note)


def measure_cuda_peak(fn: Callable[[], Any], torch_module: Any = None) -> MemoryInfo:
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
    return MemoryInfo(peak_bytes=max(0, peak - before), method="cuda_max_memory_allocated")


def measure_peak(fn: Callable[[], Any], device: str) -> MemoryInfo:
    return measure_cuda_peak(fn) if device.startswith("cuda") else measure_cpu_peak(fn)
