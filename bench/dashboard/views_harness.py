"""The harness's own cost: each (case, implementation)'s wall time split by phase (the record's phases_s), the
timed calls beside the pattern, the selection, the setup, the oracle check, fidelity and the memory probe.

What a long case costs to measure, and which phase grows fastest with N, is the question ([R4 4/6] item 5):
one horizontal bar per record, stacked by phase, in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.dashboard.data import Row
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import PALETTE, Figure, PlotlyJson, axis, base_layout, provenance, row_hover
from bench.dashboard.views_correctness import case_labels, impl_name

# Phases in the order a pair goes through them (bench.measure.pair); any other a later harness adds goes after.
PHASE_ORDER = ("start", "pattern", "inputs", "attention statistics", "selection", "paging", "prepare", "first call",
               "check", "fidelity", "warm-up", "timing", "waiting", "memory", "quality", "training")
TIMED = "timing"  # the phase of the timed calls: the rest is the harness's own cost (or, `waiting`, idle)
MAX_BARS = 40  # records drawn per figure (the longest walls): a bar chart of hundreds says nothing


def harness_rows(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.phases_s and r.wall_s is not None]


def phase_names(rows: Sequence[Row]) -> list[str]:
    seen = {name for r in rows for name in r.phases_s}
    return [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER))


def harness_share(row: Row) -> float | None:
    """The share of the record's wall time outside the timed calls."""
    if not row.wall_s:
        return None
    return 1.0 - row.phases_s.get(TIMED, 0.0) / row.wall_s


def harness_figure(rows: Sequence[Row]) -> Figure | None:
    measured = harness_rows(rows)
    if not measured:
        return None
    shown = sorted(measured, key=lambda r: -(r.wall_s or 0.0))[:MAX_BARS]
    labels = dict(case_labels(shown))
    shown.sort(key=lambda r: (list(labels).index(r.case_id), impl_name(r)))
    names = [plot_text(f"{labels[r.case_id]} · {impl_name(r)}") for r in shown]
    phases = phase_names(shown)
    traces: list[PlotlyJson] = []
    for i, phase in enumerate(phases):
        seconds = [r.phases_s.get(phase, 0.0) for r in shown]
        hovers = [row_hover(r, plot_text(
            f"{phase}: {r.phases_s.get(phase, 0.0):.3g} s of {r.wall_s:.3g} s wall "
            f"({100 * r.phases_s.get(phase, 0.0) / (r.wall_s or 1.0):.0f}%); outside the timed calls "
            f"{100 * (harness_share(r) or 0.0):.0f}%")) for r in shown]
        traces.append({"type": "bar", "orientation": "h", "name": plot_text(phase), "y": names, "x": seconds,
                       "marker": {"color": PALETTE[i % len(PALETTE)],
                                  "pattern": {"shape": "" if phase == TIMED else "/"}},
                       "hovertext": hovers, "hoverinfo": "text"})
    prov = provenance(shown)
    layout = base_layout("The harness's own cost: each record's wall time by phase", prov,
                         height=max(320, 120 + 26 * len(shown)))
    layout["barmode"] = "stack"
    layout["xaxis"] = axis("seconds of wall time (plain: the timed calls; hatched: the harness's own phases)")
    layout["yaxis"] = axis("", automargin=True, autorange="reversed")
    left_out = len(measured) - len(shown)
    notes = [f"the {len(shown)} longest of {len(measured)} records; {left_out} shorter ones left out"] if left_out \
        else []
    return Figure("harness", "The harness's own cost: each record's wall time split by phase (pattern, selection, "
                  "setup, oracle check, fidelity, timed calls, memory probe)", prov.text(),
                  {"data": traces, "layout": layout}, notes)
