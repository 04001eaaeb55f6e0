"""The selection views: speed and fidelity together, for data-dependent sparse attention.

- time against recall: end-to-end time per call (selection included) against the mean recall of dense
  attention's mass, each (selector, implementation, inputs, sequence length) a line over its budgets or
  thresholds; the dense peers of the same facet (records without a selector) at recall 1; beside each selector's
  point, hollow, the oracle's recall at the same units and counts (how far right that budget could reach).
- selection share: the selector's median over the end-to-end median, per selector and budget and implementation
  (where the time goes: a selector that costs more than the attention it saves is visible here).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.dashboard.data import Row, format_param, sort_key
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import PALETTE, Colours, Figure, PlotlyJson, axis, base_layout, provenance, row_hover


def _selected(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.measured_ok and r.selection is not None and r.fidelity is not None
            and r.fidelity.recall.mean is not None]


def _recall(row: Row, oracle: bool = False) -> float:
    assert row.fidelity is not None
    return float((row.fidelity.oracle_recall if oracle else row.fidelity.recall).mean or 0.0)


def _amount(row: Row) -> str:
    sel = row.selection
    if sel is None:
        return ""
    return f"k{sel.budget:g}" if sel.budget is not None else (f"t{sel.threshold:g}" if sel.threshold else "fixed")


def _line_key(row: Row) -> tuple[str, str, str, str]:
    inputs = format_param("inputs", row.params.get("inputs", "random"))
    selector = row.selection.selector if row.selection is not None else "?"
    return (selector, row.impl, str(inputs), str(row.params.get("seq_len")))


def _hover(row: Row) -> str:
    sel, fid = row.selection, row.fidelity
    assert sel is not None and fid is not None
    return row_hover(row, plot_text(
        f"{sel.selector} {_amount(row)}: recall {_recall(row):.3f} (p5 {fid.recall.p5 or 0:.3f}, "
        f"oracle {_recall(row, oracle=True):.3f}); end to end {(row.median_s or 0) * 1e3:.3g} ms, selector "
        f"{sel.time_s.median * 1e3:.3g} ms, attention {sel.attention_time_s.median * 1e3:.3g} ms; "
        f"density {sel.density or 0:.3f}; needles found {fid.needles_found}"))


def time_recall_figures(rows: Sequence[Row], colours: Colours) -> list[Figure]:
    """One speed-fidelity figure per sequence length (lengths apart: their times differ by orders)."""
    selected = _selected(rows)
    lengths = sorted({int(r.params["seq_len"]) for r in selected})
    return [f for n in lengths if (f := time_recall_figure([r for r in rows if int(r.params["seq_len"]) == n],
                                                           colours)) is not None]


def time_recall_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    selected = _selected(rows)
    if not selected:
        return None
    lines: dict[tuple[str, str, str, str], list[Row]] = {}
    for row in selected:
        lines.setdefault(_line_key(row), []).append(row)
    traces: list[PlotlyJson] = []
    selectors = sorted({key[0] for key in lines})
    ms = 1e3  # times in milliseconds: a sweep's ms read better than its powers of ten of seconds
    for (selector, impl, inputs, _), members in sorted(lines.items(), key=lambda kv: [sort_key(x) for x in kv[0]]):
        members.sort(key=_recall)
        colour = PALETTE[selectors.index(selector) % len(PALETTE)]  # a colour per selector
        name = f"{selector} · {impl}" + (f" · {inputs}" if inputs != "random" else "")
        traces.append({"type": "scatter", "mode": "lines+markers", "name": plot_text(name),
                       "x": [_recall(r) for r in members],
                       "y": [(r.median_s or 0) * ms for r in members], "marker": {"color": colour, "size": 8},
                       "line": {"color": colour, "dash": "solid" if inputs != "random" else "dot"},
                       "hovertext": [_hover(r) for r in members], "hoverinfo": "text",
                       "legendgroup": plot_text(name)})
        traces.append({"type": "scatter", "mode": "markers", "name": plot_text(f"{name}: oracle at its budgets"),
                       "x": [_recall(r, oracle=True) for r in members],
                       "y": [(r.median_s or 0) * ms for r in members], "showlegend": False,
                       "legendgroup": plot_text(name),
                       "marker": {"color": colour, "size": 8, "symbol": "circle-open"}, "hoverinfo": "skip"})
    facets = {format_param("inputs", r.params.get("inputs", "random")) for r in selected}
    dense = [r for r in rows if r.measured_ok and r.selection is None and r.median_s is not None
             and format_param("inputs", r.params.get("inputs", "random")) in facets]
    for row in dense:
        traces.append({"type": "scatter", "mode": "markers", "name": plot_text(f"{row.impl} dense"),
                       "x": [1.0], "y": [(row.median_s or 0) * ms], "hoverinfo": "text",
                       "hovertext": [row_hover(row, plot_text("dense attention under the base pattern: recall 1"))],
                       "marker": {"color": colours(row.impl), "size": 12, "symbol": "star"}})
    n = selected[0].params.get("seq_len")
    prov = provenance([*selected, *dense])
    layout = base_layout(f"Speed and fidelity at N={n}: end-to-end time against recall", prov, height=520)
    layout["xaxis"] = axis("mean recall of dense attention's mass (hollow: the oracle at the same budget)",
                           range=[0, 1.05])
    layout["yaxis"] = axis("end-to-end time per call [ms], selection included", log=True)
    return Figure("selection", f"Speed and fidelity at N={n}: each selector a line over its budgets (dotted: "
                  "random inputs), dense peers at recall 1, the oracle's recall at the same budget hollow",
                  prov.text(), {"data": traces, "layout": layout})


def selection_share_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    selected = [r for r in _selected(rows) if r.selection is not None and r.selection.share is not None]
    if not selected:
        return None
    by_impl: dict[str, list[Row]] = {}
    for row in selected:
        by_impl.setdefault(row.impl, []).append(row)
    traces: list[PlotlyJson] = []
    for impl, members in sorted(by_impl.items()):
        members.sort(key=lambda r: [sort_key(x) for x in (*_line_key(r), _amount(r))])
        labels = [plot_text(f"{_line_key(r)[0]} {_amount(r)} · {_line_key(r)[2]} · N={_line_key(r)[3]}")
                  for r in members]
        traces.append({"type": "bar", "name": plot_text(impl), "x": labels,
                       "y": [r.selection.share if r.selection else None for r in members],
                       "marker": {"color": colours(impl)},
                       "hovertext": [_hover(r) for r in members], "hoverinfo": "text"})
    prov = provenance(selected)
    layout = base_layout("Selection share of end-to-end time", prov, height=480)
    layout["barmode"] = "group"
    layout["xaxis"] = axis("", type="category", tickangle=-35, automargin=True)
    layout["yaxis"] = axis("selector median / end-to-end median")
    return Figure("selection_share", "Where the time goes: the selector's share of end-to-end time, per selector, "
                  "budget and implementation", prov.text(), {"data": traces, "layout": layout})
