"""History over commits: each (case, impl) series of bench.analysis.history with its fitted levels and detected steps.

Series come from `bench.history.build_history` (measured records only: models never enter a history); this
module assigns each to the facet of its records and draws it with the commits on a categorical axis in the
order they were first measured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from bench.analysis.history import Series, build_history
from bench.console.format import format_seconds
from bench.dashboard.data import Facet, Row, SeriesKey, params_label, varying_keys
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import Colours, Figure, PlotlyJson, axis, base_layout, hover, provenance
from bench.results.store import Run

STEP_STYLE = {"slower": ("#d62728", "triangle-up"), "faster": ("#2ca02c", "triangle-down")}
MAX_SHOWN = 12  # with more series than this, those without a step start hidden (one click in the legend)


@dataclass(frozen=True)
class HistorySeries:
    series: Series
    row: Row  # the latest record of this (fingerprint, case, impl): its facet and parameters

    @property
    def facet(self) -> Facet:
        """(pattern, dtype, mode, device, workload) of its latest record: the section it is drawn in."""
        return self.row.facet()


def commit_label(commit: str) -> str:
    return commit if commit.startswith("(") else commit[:8]


def history_series(runs: Iterable[Run], rows: Sequence[Row], suite: str) -> tuple[list[HistorySeries], list[str]]:
    """(every series of `suite` with its latest record, the suite's commits in first-measured order)."""
    runs = list(runs)
    latest: dict[tuple[str, str, str], Row] = {}
    for row in rows:  # rows are oldest first (a run's pair once): the latest run's record is the series' current
        if row.suite == suite and row.source == "measured":
            latest[(row.fingerprint, row.case_id, row.impl)] = row
    out = []
    commits: list[str] = []
    for series in build_history(runs, suite):
        current = latest.get((series.fingerprint, series.case_id, series.impl))
        if current is None:
            continue
        out.append(HistorySeries(series, current))
        commits.extend(p.commit for p in series.points)
    first_seen: dict[str, str] = {}
    for item in out:
        for p in item.series.points:
            first_seen[p.commit] = min(first_seen.get(p.commit, p.started_at), p.started_at)
    return out, sorted(dict.fromkeys(commits), key=lambda c: first_seen[c])


def _series_traces(it: HistorySeries, colours: Colours, label_keys: list[str], many: bool) -> list[PlotlyJson]:
    """One series' traces: its medians with their 95% CIs, the fitted levels, and the detected steps."""
    s, row = it.series, it.row
    key = SeriesKey(row.impl, "measured", row.interpreter, params_label(row, label_keys))
    name = plot_text(key.name())
    colour = colours(row.impl)
    x = [plot_text(commit_label(p.commit)) for p in s.points]
    plus = [(p.ci95[1] - p.median) if p.ci95 else 0.0 for p in s.points]
    minus = [(p.median - p.ci95[0]) if p.ci95 else 0.0 for p in s.points]
    texts = [hover([f"<b>{name}</b>", plot_text(s.case_id), f"commit {plot_text(p.commit[:12])}"
                    + (" (dirty tree)" if p.dirty else ""),
                    f"median {format_seconds(p.median)}"
                    + (f" [{format_seconds(p.ci95[0])}, {format_seconds(p.ci95[1])}]" if p.ci95 else "")
                    + f", {len(p.samples)} samples", plot_text("runs " + ", ".join(p.run_ids))])
             for p in s.points]
    visible = True if not many or s.steps else "legendonly"
    traces: list[PlotlyJson] = [{
        "type": "scatter", "mode": "lines+markers", "name": name, "legendgroup": name, "x": x,
        "y": [p.median for p in s.points], "hovertext": texts, "hoverinfo": "text", "visible": visible,
        "error_y": {"type": "data", "symmetric": False, "array": plus, "arrayminus": minus, "color": colour,
                    "thickness": 1},
        "line": {"color": colour, "width": 1}, "marker": {"color": colour, "size": 6}}]
    level_x: list[str | None] = []
    level_y: list[float | None] = []
    for seg in s.levels:
        level_x += [x[seg.start], x[seg.stop - 1], None]
        level_y += [seg.value, seg.value, None]
    traces.append({"type": "scatter", "mode": "lines", "name": f"{name} fitted levels", "legendgroup": name,
                   "showlegend": False, "x": level_x, "y": level_y, "visible": visible, "hoverinfo": "skip",
                   "line": {"color": colour, "dash": "dot", "width": 2}})
    if s.steps:
        traces.append({
            "type": "scatter", "mode": "markers", "name": f"{name} steps", "legendgroup": name,
            "showlegend": False, "visible": visible,
            "x": [x[st.index] for st in s.steps], "y": [s.points[st.index].median for st in s.steps],
            "marker": {"size": 15, "color": [STEP_STYLE[st.direction][0] for st in s.steps],
                       "symbol": [STEP_STYLE[st.direction][1] for st in s.steps],
                       "line": {"color": "#000000", "width": 1}},
            "hovertext": [hover([f"<b>step: x{st.ratio:.3g} {st.direction}</b>", f"<b>{name}</b>",
                                 f"between commits {plot_text(st.commit_range)}",
                                 f"{format_seconds(st.median_before)} -> {format_seconds(st.median_after)}"])
                          for st in s.steps],
            "hoverinfo": "text"})
    return traces


def history_figure(items: Sequence[HistorySeries], commits: Sequence[str], colours: Colours) -> Figure | None:
    """The series of one facet over the suite's commits; None when the facet has fewer than two commits."""
    in_facet = {p.commit for it in items for p in it.series.points}
    if len(in_facet) < 2:
        return None
    raw_order = [commit_label(c) for c in commits if c in in_facet]
    order = [plot_text(c) for c in raw_order]
    label_keys = varying_keys([it.row for it in items])
    many = len(items) > MAX_SHOWN
    traces: list[PlotlyJson] = []
    for it in items:
        traces += _series_traces(it, colours, label_keys, many)
    prov = provenance(it.row for it in items)
    prov = replace(prov, commits=tuple(raw_order))
    layout = base_layout("Time per call over commits", prov, height=460)
    layout["xaxis"] = axis("commit (first measured first)", type="category", categoryorder="array",
                           categoryarray=order)
    layout["yaxis"] = axis("time per call [s] (median, bars: 95% CI)", log=True, exponentformat="SI")
    steps = sum(len(it.series.steps) for it in items)
    notes = [f"{len(items)} series; those without a step start hidden (click the legend to show them)"] if many else []
    return Figure("history", f"History over {len(order)} commits with the detected steps ({steps}; ▲ slower, "
                  "▼ faster; dotted: fitted levels)", prov.text(), {"data": traces, "layout": layout}, notes=notes)
