"""One way to print times, bytes and rates: the console, the compare report and the dashboards all call these,
so a value reads the same wherever it is shown."""

from __future__ import annotations

import math


def format_seconds(seconds: float | None) -> str:
    """`21.3 ms`, `1 s`, `850 us`; `-` for a missing or non-finite value."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        # compare after rounding to 3 digits, so 0.9996 ms reads "1 ms", not "1e+03 us"
        if abs(float(f"{seconds / scale:.3g}")) >= 1:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def format_duration(seconds: float | None) -> str:
    """A run's length: `95 s`, `9 min 54 s`; `-` for a missing or non-finite value."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


def format_bytes(value: float | None) -> str:
    """`13 MiB`, `512 B` (binary units); `-` for a missing or non-finite value."""
    if value is None or not math.isfinite(value):
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(float(f"{value / scale:.3g}")) >= 1:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def format_gib(value: float) -> str:
    """Bytes as GiB with 3 digits (memory-model messages compare with device sizes given in GiB)."""
    return f"{value / 2**30:.3g} GiB"


def format_rate(flops_per_s: float | None) -> str:
    """`103 GFLOP/s`, `1.2 TFLOP/s`; `-` for a missing value."""
    if flops_per_s is None or not math.isfinite(flops_per_s):
        return "-"
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if abs(flops_per_s) >= scale:
            return f"{flops_per_s / scale:.3g} {unit}"
    return f"{flops_per_s:.3g} FLOP/s"


def format_ratio(ratio: float | None) -> str:
    """`1.38x`, `0.73x`: a speed ratio, never cut; `-` for a missing value."""
    if ratio is None or not math.isfinite(ratio):
        return "-"
    return f"{ratio:.3g}x"


def format_p(p: float | None) -> str:
    """A p- or q-value in a table: two significant digits, scientific below 0.001 (`bench compare`, `bench ab`)."""
    if p is None or not math.isfinite(p):
        return "-"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"
