"""The speed-quality front ([R4 2/6]): what a sparse attention costs a model, beside what it saves.

One figure per model, task and length: x = the attention's end-to-end time as a share of dense attention's (the
same implementation under the causal base on the same shape, else sdpa's, in the same run), y = the model's
accuracy with the case's attention (its 95% interval); a menu switches y to recall (the selection's share of dense
attention's mass) or to the KL of the next-token distributions. Each (selector or static pattern, implementation)
is a line over its budgets; the oracles (`oracle_topk`, `oracle_topk_rows`) are drawn at their attention's time
(their selector computes dense attention: the frontier is what a selector choosing as they do could reach), and
dense attention sits at (1, its accuracy). Where the store holds the same selector, budget and implementation
measured without a model at a larger shape (the selection suite at 16K, say), a second front takes its x from
there and says which run and shape. The table beside gives, per selector and implementation, the smallest budget
whose loss is not significant at 5% (the paired sign test), with the samples it rests on and the smallest loss
those samples could detect.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.dashboard.data import Row, sort_key
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import PALETTE, Colours, Figure, PlotlyJson, axis, base_layout, provenance

ORACLES = ("oracle_topk", "oracle_topk_rows")
Y_VIEWS = (("accuracy", "model accuracy with this attention"), ("recall", "recall (share of dense mass kept)"),
           ("kl", "KL(dense || this) of the next-token distribution [nats]"))


def _line_name(row: Row) -> str:
    """`moba · blocked`, `causal_local w=256 · sdpa`."""
    if row.selection is not None:
        return f"{row.selection.selector} · {row.impl}"
    pattern = str(row.params.get("pattern"))
    return f"{pattern} w={row.params.get('window')} · {row.impl}" if "local" in pattern or pattern == "sink" \
        else f"{pattern} · {row.impl}"


def _amount(row: Row) -> float:
    sel = row.selection
    if sel is None:
        return float(row.params.get("window") or 0)
    return float(sel.budget if sel.budget is not None else sel.threshold or 0)


def dense_times(rows: Sequence[Row]) -> dict[tuple[str, int, str], float]:
    """(impl, seq_len, dtype) -> the median time of that implementation's causal case without a selection."""
    out: dict[tuple[str, int, str], float] = {}
    for r in rows:
        if r.measured_ok and r.selection is None and r.params.get("pattern") == "causal" and r.median_s:
            out[(r.impl, int(r.params["seq_len"]), str(r.params["dtype"]))] = r.median_s
    return out


def time_share(row: Row, dense: dict[tuple[str, int, str], float]) -> float | None:
    """The row's attention time over dense attention's on its shape: its own implementation's, else sdpa's."""
    n, dtype = int(row.params["seq_len"]), str(row.params["dtype"])
    base = dense.get((row.impl, n, dtype)) or dense.get(("sdpa", n, dtype))
    if base is None or row.median_s is None:
        return None
    seconds = row.median_s
    if row.selection is not None and row.selection.reference:  # an oracle: its attention, not its dense selector
        seconds = row.selection.attention_time_s.median
    return seconds / base


def _y(row: Row, view: str) -> float | None:
    q = row.quality
    if view == "accuracy":
        return q.value if q else None
    if view == "recall":
        return row.fidelity.recall.mean if row.fidelity else (1.0 if row.selection is None else None)
    return q.kl_mean if q else None


def _hover(row: Row, x: float | None) -> str:
    q = row.quality
    assert q is not None
    p = "-" if q.p_value is None else f"{q.p_value:.2g}"
    share = "-" if x is None else f"{x:.3f}"
    return plot_text(f"{_line_name(row)} {_amount(row):g}: accuracy {q.value:.3f} (dense {q.dense_value:.3f}, "
                     f"delta {q.delta:+.3f}, sign test p {p}, {q.samples} samples), KL {q.kl_mean or 0:.3g}; time "
                     f"{share} of dense; model forward {1e3 * (q.model_time_s or 0):.3g} ms "
                     f"(dense {1e3 * (q.model_time_dense_s or 0):.3g} ms)")


def _traces(rows: list[Row], share: dict[int, float | None], colours: Colours) -> list[PlotlyJson]:
    lines: dict[str, list[Row]] = {}
    for r in rows:
        lines.setdefault(_line_name(r), []).append(r)
    traces: list[PlotlyJson] = []
    for index, (name, members) in enumerate(sorted(lines.items(), key=lambda kv: sort_key(kv[0]))):
        members.sort(key=_amount)
        oracle = members[0].selection is not None and members[0].selection.selector in ORACLES
        colour = "#000000" if oracle else PALETTE[index % len(PALETTE)]
        points = [(share[id(r)], r) for r in members]
        for view, _ in Y_VIEWS:
            ys = [_y(r, view) for _, r in points]
            trace: PlotlyJson = {
                "type": "scatter", "mode": "lines+markers", "name": plot_text(name + (" (frontier)" if oracle else "")),
                "x": [x for x, _ in points], "y": ys, "visible": view == "accuracy",
                "line": {"color": colour, "dash": "dash" if oracle else "solid"},
                "marker": {"color": colour, "symbol": "diamond" if oracle else "circle", "size": 8},
                "hovertext": [_hover(r, x) for x, r in points], "hoverinfo": "text", "meta": view,
                "text": [f"{_amount(r):g}" for _, r in points]}
            if view == "accuracy":
                spans = [_ci_span(r) for _, r in points]
                trace["error_y"] = {"type": "data", "symmetric": False, "array": [hi for _, hi in spans],
                                    "arrayminus": [lo for lo, _ in spans]}
            traces.append(trace)
    return traces


def _ci_span(row: Row) -> tuple[float, float]:
    """(below, above) the accuracy: its bootstrap interval's reach either side."""
    q = row.quality
    if q is None or q.value is None or not q.ci95:
        return 0.0, 0.0
    return q.value - q.ci95[0], q.ci95[1] - q.value


def _dense_point(rows: list[Row]) -> list[PlotlyJson]:
    q = next((r.quality for r in rows if r.quality is not None), None)
    if q is None:
        return []
    out = []
    for view, _ in Y_VIEWS:
        y = {"accuracy": q.dense_value, "recall": 1.0, "kl": 0.0}[view]
        out.append({"type": "scatter", "mode": "markers", "name": "dense attention", "x": [1.0], "y": [y],
                    "visible": view == "accuracy", "meta": view, "hoverinfo": "text",
                    "hovertext": [plot_text(f"dense attention (sdpa, causal): accuracy {q.dense_value:.3f}")],
                    "marker": {"color": "#000000", "symbol": "star", "size": 14}})
    return out


def _menu(traces: list[PlotlyJson]) -> list[PlotlyJson]:
    buttons = []
    for view, title in Y_VIEWS:
        buttons.append({"label": view, "method": "update",
                        "args": [{"visible": [t["meta"] == view for t in traces]}, {"yaxis.title.text": title}]})
    return [{"type": "buttons", "direction": "right", "x": 0, "xanchor": "left", "y": 1.12, "yanchor": "bottom",
             "buttons": buttons, "showactive": True}]


def front_figure(rows: Sequence[Row], colours: Colours, times_from: Sequence[Row] | None = None,
                 source: str = "") -> Figure | None:
    """The front of one (model, task, length): see the module docstring. `times_from`: rows measured without a
    model whose times give x (the same selector, budget and implementation; `source` names where)."""
    scored = [r for r in rows if r.quality is not None and r.quality.value is not None and r.measured_ok]
    if not scored:
        return None
    share = _shares(scored, rows, times_from)
    kept = [r for r in scored if share[id(r)] is not None]
    if not kept:
        return None
    traces = _traces(kept, share, colours)
    traces += _dense_point(kept)
    first = kept[0]
    n = first.params["seq_len"]
    model, task = first.quality.model if first.quality else "?", first.params.get("task")
    prov = provenance(kept)
    where = source or f"the records themselves (N={n}, {first.workload})"
    layout = base_layout(f"What it costs {model}: accuracy against time, N={n}", prov, height=520)
    layout["xaxis"] = axis(f"attention time as a share of dense attention's (from {where})", log=True)
    layout["yaxis"] = axis(Y_VIEWS[0][1])
    layout["updatemenus"] = _menu(traces)
    layout["legend"] = {"title": {"text": "selector · implementation (points: budgets)"}}
    return Figure("quality_front", plot_text(f"Speed-quality front: {model} on {task} at N={n}, times from {where}"),
                  prov.text(), {"data": traces, "layout": layout},
                  notes=[f"{len(kept)} points; oracles dashed (drawn at their attention's time); dense attention: "
                         "the star"])


def _shares(scored: list[Row], rows: Sequence[Row], times_from: Sequence[Row] | None) -> dict[int, float | None]:
    if times_from is None:
        dense = dense_times(rows)
        return {id(r): time_share(r, dense) for r in scored}
    dense = dense_times(times_from)
    by_key = {(_line_name(t), _amount(t)): t for t in times_from if t.measured_ok}
    out: dict[int, float | None] = {}
    for r in scored:
        match = by_key.get((_line_name(r), _amount(r)))
        out[id(r)] = time_share(match, dense) if match is not None else None
    return out


def significance_table(rows: Sequence[Row]) -> Figure | None:
    """Per selector and implementation at the longest length: the smallest budget whose accuracy loss is not
    significant at 5%, the samples, and the smallest loss they can detect."""
    scored = [r for r in rows if r.quality and r.quality.value is not None and r.quality.metric == "accuracy"]
    if not scored:
        return None
    longest = max(int(r.params["seq_len"]) for r in scored)
    lines: dict[str, list[Row]] = {}
    for r in scored:
        if int(r.params["seq_len"]) == longest:
            lines.setdefault(_line_name(r), []).append(r)
    cells: list[list[str]] = [[], [], [], [], [], []]
    for name, members in sorted(lines.items(), key=lambda kv: sort_key(kv[0])):
        members.sort(key=_amount)
        fine = next((r for r in members if r.quality and (r.quality.p_value is None or r.quality.p_value >= 0.05)),
                    None)
        q = (fine or members[-1]).quality
        assert q is not None
        for column, value in zip(cells, [name, f"{_amount(fine):g}" if fine else "none tried",
                                         f"{q.value:.3f} ({q.delta:+.3f})", "-" if q.p_value is None
                                         else f"{q.p_value:.2g}", str(q.samples),
                                         "-" if q.min_detectable_loss is None else f"{q.min_detectable_loss:.3f}"],
                                  strict=True):
            column.append(plot_text(value))
    header = ["selector · implementation", "smallest budget, loss not significant", "accuracy (delta)",
              "sign test p", "samples", "smallest loss detectable"]
    trace = {"type": "table", "header": {"values": header, "align": "left"},
             "cells": {"values": cells, "align": "left"}}
    prov = provenance(scored)
    layout = base_layout(f"Budgets that keep the answers, N={longest}", prov, height=120 + 28 * len(cells[0]))
    return Figure("quality_table", f"The smallest budget whose loss is not significant at 5% (N={longest})",
                  prov.text(), {"data": [trace], "layout": layout})
