"""What happens around every timed call so that its time and its output can be trusted.

A call timed right after another finds what the previous call left in the caches: its inputs, its output, a
packed copy it keeps. A decode over 16 MB of keys then reads the last-level cache, not memory, and reports more
bytes per second than the memory delivers. And a call given the same tensors every time can return what it
computed before (keyed on the input pointers, or simply the last result) and look fast. So, around each timed
call of a pair, outside the timed interval:

1. the call's inputs get the values of the next of several seeded input sets, written in place into the tensors
   the implementation was prepared with (`InputSets`): consecutive calls never see the same values;
2. the caches are evicted (`cache: cold`, the default): on CPU a buffer of twice the last-level cache, whose size
   is read from the machine, is read and written (`CpuEvictor`); CUDA's timer flushes the L2 itself
   (bench.measure.timing.CudaTimer);
3. the output of the last timed call, and of one other chosen at random among the calls on another set than
   the first call's, is kept (`TimedCalls`: a copy, after the clock stops, since an implementation may write every
   call's output into one buffer) and checked against the oracle for the inputs it was given
   (bench.measure.timed_check).

Step 1 comes before step 2, because writing the inputs brings them into the cache. The record's `timing` block
says what was done (`TimingInfo`).
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bench.measure.timing import Timer
from bench.results.records import TimingInfo

_CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
# When neither sysfs nor sysconf tells the last-level cache (some containers, some aarch64 kernels): evict this
# much, which exceeds every CPU's last-level cache we know of, and say that the size was not read.
UNKNOWN_LLC_EVICT_BYTES = 1 << 30
_SIZE_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30}


@dataclass(frozen=True)
class CacheSize:
    bytes: int | None  # None: the machine did not say
    source: str  # where it was read


def _sysfs_size(text: str) -> int | None:
    text = text.strip()
    if not text:
        return None
    if text[-1] in _SIZE_SUFFIX:
        return int(text[:-1]) * _SIZE_SUFFIX[text[-1]]
    return int(text)


@functools.lru_cache(maxsize=1)
def last_level_cache(root: Path = _CPU_CACHES) -> CacheSize:
    """The largest data or unified cache of the first CPU, read from sysfs, else from sysconf."""
    best: tuple[int, int] | None = None  # (level, bytes)
    try:
        for index in sorted(root.glob("index*")):
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = _sysfs_size((index / "size").read_text())
            level = int((index / "level").read_text())
            if size and (best is None or (level, size) > best):
                best = (level, size)
    except (OSError, ValueError):
        best = None
    if best is not None:
        return CacheSize(best[1], f"sysfs L{best[0]}")
    for level, name in ((3, "SC_LEVEL3_CACHE_SIZE"), (2, "SC_LEVEL2_CACHE_SIZE")):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size > 0:
            return CacheSize(size, f"sysconf L{level}")
    return CacheSize(None, "not reported by this machine")


class CpuEvictor:
    """Reads and writes a float32 buffer of twice the last-level cache: every line the last call touched is
    displaced. The buffer is allocated once per process, at the first eviction."""

    def __init__(self, llc: CacheSize | None = None) -> None:
        self.llc = llc or last_level_cache()
        self.bytes = 2 * self.llc.bytes if self.llc.bytes else UNKNOWN_LLC_EVICT_BYTES

    def __call__(self) -> None:
        _eviction_buffer(self.bytes).add_(1.0)


@functools.lru_cache(maxsize=1)
def _eviction_buffer(nbytes: int) -> Tensor:
    return torch.zeros(nbytes // 4, dtype=torch.float32)


def evictor_for(device: str, cache: str) -> CpuEvictor | None:
    """The harness's CPU evictor for a cold timing; None warm or on CUDA (whose timer flushes its L2)."""
    return CpuEvictor() if cache == "cold" and not device.startswith("cuda") else None


@dataclass
class InputSets:
    """The values the timed calls cycle through, written in place into `targets` (the tensors the implementation
    was prepared with). `sets[0]` holds the targets' original values: `load(0)` restores them."""

    targets: tuple[Tensor, ...]
    sets: list[tuple[Tensor, ...]]
    current: int = 0
    after_load: Callable[[], None] | None = None  # the implementation's refresh of its own copies (Prepared.refresh)

    @classmethod
    def of(cls, targets: Sequence[Tensor], others: Sequence[Sequence[Tensor]]) -> InputSets:
        originals = tuple(t.detach().clone() for t in targets)
        return cls(tuple(targets), [originals, *(tuple(s) for s in others)])

    def __len__(self) -> int:
        return len(self.sets)

    def load(self, index: int) -> None:
        if index == self.current:
            return
        with torch.no_grad():
            for target, value in zip(self.targets, self.sets[index], strict=True):
                target.copy_(value)
        self.current = index
        if self.after_load is not None:
            self.after_load()


@dataclass
class KeptCall:
    """A timed call whose output is checked: its index among the step's calls, the input set it was given."""

    index: int
    input_set: int
    output: Any


@dataclass
class TimedCalls:
    """bench.measure.timing's Timer for one step: before each call the next input set and the eviction (untimed),
    after it the output kept where it is to be checked. Warm-up calls go through it too (they count and rotate).

    `check_from`: the first timed call's index (the calls before it are the warm-up, whose caches are not
    evicted); `check_to`: one past the last index that surely happens. The one checked call besides the last is
    drawn from [check_from, check_to - 1), which excludes the earliest possible last call, among the calls on
    another input set than the first call's."""

    timer: Timer
    sets: InputSets | None = None
    evict: Callable[[], None] | None = None
    check_from: int = 0
    check_to: int = 1
    calls: int = 0
    prep_s: float = 0.0  # seconds spent writing inputs and evicting before the timed calls
    timed: int = 0  # calls past the warm-up
    kept: list[KeptCall] = field(default_factory=list)
    last: KeptCall | None = None
    drawn: int | None = None  # the call checked besides the last (drawn at construction)

    def __post_init__(self) -> None:
        candidates = [i for i in range(self.check_from, self.check_to - 1)
                      if self.input_set(i) != 0 or self.sets is None or len(self.sets) == 1]
        # not seeded: an implementation must not be able to tell which call is looked at
        self.drawn = random.SystemRandom().choice(candidates) if candidates else None

    def input_set(self, index: int) -> int:
        """The set call `index` gets: the next after the first call's (set 0), then in turn."""
        return 0 if self.sets is None else (index + 1) % len(self.sets)

    def before_call(self) -> int:
        """The next call's input set written and, past the warm-up, the caches evicted; its index."""
        index = self.calls
        started = time.perf_counter()
        if self.sets is not None:
            self.sets.load(self.input_set(index))
        if index >= self.check_from:
            if self.evict is not None:
                self.evict()
            self.prep_s += time.perf_counter() - started
            self.timed += 1
        self.calls += 1
        return index

    def time_call(self, fn: Callable[[], Any]) -> float:
        index = self.before_call()
        seconds, result = self.timer.run(fn)
        # a copy: an implementation may write every call's output into one buffer (destination-passing style)
        self.last = KeptCall(index, self.input_set(index), _snapshot(result))
        if index == self.drawn:
            self.kept.append(self.last)
        return seconds

    def clock(self) -> float:
        return self.timer.clock()

    def run(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        seconds = self.time_call(fn)
        return seconds, self.last.output if self.last is not None else None

    def to_check(self) -> list[KeptCall]:
        """The drawn call and the last one (once each); their outputs are released by the caller after checking."""
        out = list(self.kept)
        if self.last is not None and all(k.index != self.last.index for k in out):
            out.append(self.last)
        return out

    def release(self) -> None:
        self.kept.clear()
        self.last = None


def _snapshot(result: Any) -> Any:
    """The call's output as it is now (tensors copied), whatever later calls write into its buffers."""
    if isinstance(result, Tensor):
        return result.detach().clone()
    if isinstance(result, tuple):
        return tuple(_snapshot(r) for r in result)
    return result


def timing_info(cache: str, device: str, sets: InputSets | None, checked: int, calls: Sequence[TimedCalls],
                checked_rel_l2: float | None = None) -> TimingInfo:
    """The record's `timing` block for a pair whose steps were timed through `calls`."""
    llc, evict_bytes = _eviction_of(cache, device)
    n = sum(c.timed for c in calls)
    return TimingInfo(cache="cold" if cache == "cold" else "warm", rotated_sets=len(sets) if sets else 1,
                      checked_calls=checked, llc_bytes=llc.bytes, llc_source=llc.source, evict_bytes=evict_bytes,
                      prep_s=sum(c.prep_s for c in calls) / n if n else None, checked_rel_l2=checked_rel_l2)


def _eviction_of(cache: str, device: str) -> tuple[CacheSize, int | None]:
    if device.startswith("cuda"):
        from bench.measure.timing import cuda_l2_bytes

        l2 = cuda_l2_bytes()
        return CacheSize(l2, "CUDA device properties (L2)"), (2 * l2 if cache == "cold" else None)
    evictor = CpuEvictor()
    return evictor.llc, (evictor.bytes if cache == "cold" else None)
