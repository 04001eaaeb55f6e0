"""The deterministic figures of a record and how two sides' figures compare: exactly for statuses, counts, bytes and
strings, within a tolerance for floats (`bench compare`, and `bench ab`'s figure changes)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bench.results.records import Record

BAD_STATUSES = ("failed", "incorrect")
STATUS_RANK = {"ok": 0, "skipped": 1, "incorrect": 2, "failed": 3}  # worst wins when pooled runs disagree


@dataclass(frozen=True)
class Change:
    """A deterministic figure that differs. `kind`: regression | improvement | change, or worse | better for a
    ratio to the same-dtype reference (said in the report, not failing the job)."""

    figure: str
    base: Any
    new: Any
    kind: str


def pooled_status(records: list[Record]) -> str:
    return max((r.status for r in records), key=STATUS_RANK.__getitem__)


def figures(record: Record) -> dict[str, Any]:
    """The deterministic figures of one record, flattened to `a.b.c` names. Unmeasured ones are absent."""
    out: dict[str, Any] = {"flops": record.flops, "density": record.density,
                           "block_density": record.block_density}
    if record.error is not None:
        e = record.error
        out.update({"error.rel_l2": e.rel_l2, "error.max_abs": e.max_abs, "error.tolerance": e.tolerance,
                    "error.rows_checked": e.rows_checked, "error.nonfinite": e.nonfinite,
                    "error.numerics": e.numerics, "error.ratio": e.ratio, "error.lse_ratio": e.lse_ratio})
        for name, g in (e.grads or {}).items():
            out.update({f"error.grads.{name}.rel_l2": g.rel_l2, f"error.grads.{name}.nonfinite": g.nonfinite,
                        f"error.grads.{name}.ratio": g.ratio})
    if record.comm is not None:
        c = record.comm
        out.update({"comm.backend": c.backend, "comm.bytes_total": c.bytes_total,
                    "comm.bytes_max_rank": c.bytes_max_rank, "comm.expected_bytes": c.expected_bytes,
                    "comm.bytes_per_rank": c.bytes_per_rank})
        for op, stats in c.by_op.items():
            out.update({f"comm.by_op.{op}.calls": stats.calls, f"comm.by_op.{op}.bytes_total": stats.bytes_total,
                        f"comm.by_op.{op}.bytes_max_rank": stats.bytes_max_rank})
    # Peak allocated CUDA memory is a property of the code; a CPU resident-set high-water mark is noise.
    if record.memory is not None and record.memory.method == "cuda_max_memory_allocated":
        out["memory.peak_bytes"] = record.memory.peak_bytes
    return {k: v for k, v in out.items() if v is not None}


def _is_bytes(figure: str) -> bool:
    return figure.startswith("comm.") and (figure.endswith(("bytes_total", "bytes_max_rank")))


def figure_changes(base: list[Record], new: list[Record]) -> list[Change]:
    """Every deterministic difference between the pooled records of one pair (status always compared)."""
    b_status, n_status = pooled_status(base), pooled_status(new)
    changes = []
    if b_status != n_status:
        if n_status in BAD_STATUSES and b_status not in BAD_STATUSES:
            kind = "regression"
        elif b_status in BAD_STATUSES and n_status == "ok":
            kind = "improvement"
        else:
            kind = "change"
        changes.append(Change("status", b_status, n_status, kind))
    b_fig, n_fig = figures(representative(base)), figures(representative(new))
    for name in [k for k in b_fig if k in n_fig]:  # figures measured on both sides only
        if same_figure(name, b_fig[name], n_fig[name]):
            continue
        kind = "change"
        if _is_bytes(name) and isinstance(b_fig[name], int) and isinstance(n_fig[name], int):
            kind = "regression" if n_fig[name] > b_fig[name] else "improvement"
        elif name == "error.numerics":  # worse than the same-dtype reference, or back within it
            kind = "regression" if n_fig[name] == "worse_than_reference" else "improvement"
        elif _is_ratio(name):
            kind = _ratio_change(float(b_fig[name]), float(n_fig[name]))
        changes.append(Change(name, b_fig[name], n_fig[name], kind))
    return changes


# Relative tolerance of float figures. A measured error (rel_l2, max_abs, ratios to the reference) moves with the
# order of a reduction between BLAS builds and CPUs: differences within a tenth are rounding, not a change. Counts,
# bytes and statuses are compared exactly; FLOPs and densities are computed, so only float noise is forgiven.
FIGURE_TOLERANCE = {"error.": 0.1}
EXACT_FLOAT_TOLERANCE = 1e-9


def same_figure(name: str, base: Any, new: Any) -> bool:
    """Whether two values of a figure are the same within its tolerance (exact for everything but floats)."""
    if base == new:
        return True
    if isinstance(base, bool) or isinstance(new, bool) or not isinstance(base, float | int) \
            or not isinstance(new, float | int) or (isinstance(base, int) and isinstance(new, int)):
        return False
    rel = next((tol for prefix, tol in FIGURE_TOLERANCE.items() if name.startswith(prefix)), EXACT_FLOAT_TOLERANCE)
    if name == "error.tolerance":  # a threshold, not a measurement
        rel = EXACT_FLOAT_TOLERANCE
    return math.isclose(float(base), float(new), rel_tol=rel, abs_tol=0.0)


RATIO_WORSE = 1.25  # a ratio to the same-dtype reference growing by a quarter is a kernel rounding worse


def _is_ratio(figure: str) -> bool:
    return figure.startswith("error.") and figure.endswith("ratio")


def _ratio_change(base: float, new: float) -> str:
    """`worse` when the error against the same-dtype reference grew by RATIO_WORSE (said, not failing the job:
    the verdict's flip past 2 is the regression), `better` when it shrank as much, else a change."""
    if new > base * RATIO_WORSE:
        return "worse"
    return "better" if new * RATIO_WORSE < base else "change"


def representative(records: list[Record]) -> Record:
    """The record whose figures stand for the side: the worst status, first run among equals."""
    return max(records, key=lambda r: STATUS_RANK[r.status])


def disagreements(label: str, records: list[Record]) -> list[str]:
    notes = []
    statuses = sorted({r.status for r in records})
    if len(statuses) > 1:
        notes.append(f"{label} runs disagree on status ({', '.join(statuses)}); the worst counts")
    figs = [figures(r) for r in records if r.status == "ok"]
    if any(f != figs[0] for f in figs[1:]):
        notes.append(f"{label} runs disagree on deterministic figures; the first run's are compared")
    return notes
