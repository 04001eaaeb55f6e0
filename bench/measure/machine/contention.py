"""Contention: was the machine busy while a pair was timed? Each record's `contention` says, with its evidence.

Three readings over the timed calls only (warm-up, check and memory excluded):

- cpu_pressure: the share of wall time in which some task waited for a CPU, the growth of the `some` total of
  Linux PSI (/proc/pressure/cpu, microseconds) over the interval; null where the kernel has no PSI;
- load: the 1-minute load average over the usable cores, read at the end (a lagging figure: it takes about a
  minute to follow a change, so it decides only where there is no PSI);
- cpu_over_wall: the process's CPU time over wall time across the timed calls (CPU pairs).

The verdict is `busy` when the pressure is at least PRESSURE_BUSY (or, without PSI, the load at least LOAD_BUSY),
when a CPU pair's process got less than CPU_OVER_WALL_BUSY of a core per second, or when the GPU throttled.
The thresholds come from scripts/contention_probe.py's measurements in docs/contention/ (docs/DESIGN.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bench.results.environment import LoadAt
from bench.results.records import ContentionInfo, DeviceState

PSI_CPU = Path("/proc/pressure/cpu")
# PSI counts a stall only while a runnable task waits, so a pair whose threads fit the usable cores reads near 0
# on an otherwise idle machine: docs/contention/ measured 1% alone and 50% beside a single busy process (the call
# 2.6x slower), 92-100% beside 2 and 4; 20% lies between with a margin both ways (docs/DESIGN.md, "Contention").
PRESSURE_BUSY = 0.20
# Without PSI: the pair's own threads make about 1 per core, one more busy process per core 2. A rule of thumb,
# not a measured boundary: the 1-minute average lags a few seconds' probe (docs/contention/: 0.1-1.4 per core
# whatever ran beside it), so it only catches load that lasted a minute.
LOAD_BUSY = 1.5
# A timing loop runs at least one thread flat out; below half a core per second it waited for the CPU.
CPU_OVER_WALL_BUSY = 0.5

Verdict = Literal["quiet", "busy"]


def _psi_some(path: Path = PSI_CPU) -> dict[str, str] | None:
    """The fields of /proc/pressure/cpu's `some` line (avg10, avg60, avg300, total), or None without PSI."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                return dict(part.split("=", 1) for part in line.split()[1:])
    except (OSError, ValueError):
        return None
    return None


def psi_some_us(path: Path = PSI_CPU) -> int | None:
    """The cumulative `some` stall time (microseconds) of /proc/pressure/cpu, or None without PSI."""
    fields = _psi_some(path)
    try:
        return None if fields is None else int(fields["total"])
    except (KeyError, ValueError):
        return None


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def load_per_core() -> float | None:
    """The 1-minute load average over the cores this process may use."""
    try:
        return os.getloadavg()[0] / usable_cores()
    except OSError:
        return None


@dataclass(frozen=True)
class Readings:
    """Where the meter reads from; tests inject fixed ones."""

    pressure_us: Callable[[], int | None] = psi_some_us
    load: Callable[[], float | None] = load_per_core
    wall: Callable[[], float] = time.perf_counter
    cpu: Callable[[], float] = time.process_time


# The GPU holding its own power limit under the pair's load: the clocks it sustains for this kernel, not another
# tenant. Seen on the first H200 run: every heavy call (block densities from 20%, sdpa's dense calls) reached it,
# light ones did not; calling those busy made every heavy kernel's change NOISY. Thermal slowdowns (heat left by
# what ran before) and the hardware's own slowdowns still make a pair busy; gpu_throttle keeps every reason.
OWN_POWER_LIMIT = frozenset({"sw_power_cap", "power violation counters grew"})


def verdict(cpu_pressure: float | None, load: float | None, cpu_over_wall: float | None,
            gpu_throttle: list[str] | None = None) -> tuple[Verdict, str | None]:
    """(quiet | busy, the reason when busy): one rule for every reading."""
    if cpu_pressure is not None and cpu_pressure >= PRESSURE_BUSY:
        return "busy", f"CPU pressure {cpu_pressure:.0%} (>= {PRESSURE_BUSY:.0%})"
    if cpu_pressure is None and load is not None and load >= LOAD_BUSY:
        return "busy", f"load {load:.2f} per core (>= {LOAD_BUSY})"
    if cpu_over_wall is not None and cpu_over_wall < CPU_OVER_WALL_BUSY:
        return "busy", f"{cpu_over_wall:.2f} CPU seconds per second (< {CPU_OVER_WALL_BUSY})"
    slowed = [reason for reason in gpu_throttle or [] if reason not in OWN_POWER_LIMIT]
    if slowed:
        return "busy", f"GPU throttled: {', '.join(slowed)}"
    return "quiet", None


@dataclass
class ContentionMeter:
    """Sums the readings over one or more timed intervals (one adaptive timing, or every A/B block)."""

    readings: Readings = field(default_factory=Readings)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    pressure_us: int | None = 0  # None once any interval had no PSI
    load: float | None = None  # the largest end-of-interval reading
    waited_s: float | None = None  # measure.wait_for_quiet_s: how long the pair waited for quiet first
    _start: tuple[float, float, int | None] | None = None

    def start(self) -> None:
        r = self.readings
        self._start = (r.wall(), r.cpu(), r.pressure_us())

    def stop(self) -> None:
        if self._start is None:
            return
        r = self.readings
        wall, cpu, pressure = r.wall(), r.cpu(), r.pressure_us()
        wall0, cpu0, pressure0 = self._start
        self._start = None
        self.wall_s += max(0.0, wall - wall0)
        self.cpu_s += max(0.0, cpu - cpu0)
        if pressure is None or pressure0 is None or self.pressure_us is None:
            self.pressure_us = None
        else:
            self.pressure_us += max(0, pressure - pressure0)
        load = r.load()
        if load is not None:
            self.load = load if self.load is None else max(self.load, load)

    def result(self, device: str, device_state: DeviceState | None = None) -> ContentionInfo | None:
        """The record's `contention`; None when nothing was timed."""
        if self.wall_s <= 0:
            return None
        pressure = None if self.pressure_us is None else min(1.0, self.pressure_us / 1e6 / self.wall_s)
        # on CUDA the host waits on events: its CPU time says nothing about contention
        over_wall = self.cpu_s / self.wall_s if device == "cpu" else None
        throttle = gpu_throttle(device_state)
        decided, reason = verdict(pressure, self.load, over_wall, throttle)
        return ContentionInfo(cpu_pressure=pressure, load=self.load, cpu_over_wall=self.cpu_s / self.wall_s,
                              gpu_throttle=throttle, verdict=decided, reason=reason, waited_s=self.waited_s)


def wait_for_quiet(max_s: float, readings: Readings | None = None, window_s: float = 0.5,
                   sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait, in windows of `window_s`, until a window's CPU pressure is under PRESSURE_BUSY or `max_s` has passed;
    the seconds waited. Without PSI it does not wait (the load average lags by a minute: it cannot say "now")."""
    r = readings or Readings()
    start = r.wall()
    while r.wall() - start < max_s:
        before, t0 = r.pressure_us(), r.wall()
        sleep(window_s)
        after, t1 = r.pressure_us(), r.wall()
        if before is None or after is None or (after - before) / 1e6 / max(t1 - t0, 1e-9) < PRESSURE_BUSY:
            break
    return r.wall() - start


def gpu_throttle(device_state: DeviceState | None) -> list[str] | None:
    """The slowing NVML reasons seen around the timing (bench.measure.machine.nvml.throttle_summary); None off CUDA."""
    if device_state is None or device_state.throttled is None:
        return None
    reasons = list(device_state.throttle_reasons)
    if device_state.throttled and not reasons:  # throttled between the samples: the counters say which policy
        grew = [policy for policy, seconds in (device_state.violation_s or {}).items() if seconds]
        reasons = [f"{policy} violation counters grew" for policy in sorted(grew)] or ["violation counters grew"]
    return reasons


def machine_load() -> LoadAt:
    """run.json's load at the start and the end of a run."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        one = five = fifteen = float("nan")
    return LoadAt(load1=one, load5=five, load15=fifteen, usable_cores=usable_cores(), psi_some_avg10=_psi_avg10(),
                  at=time.time())


def _psi_avg10() -> float | None:
    fields = _psi_some()
    try:
        return None if fields is None else float(fields["avg10"]) / 100
    except (KeyError, ValueError):
        return None
