"""Peak memory against sequence length (or, as the time view, the parameter of data.x_key), with the cases that
were not measured (skipped, out of memory, failed, incorrect) marked on a strip below; and the achieved fraction
of the hardware's peak FLOP rate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.console.format import format_bytes
from bench.dashboard.data import Row, SeriesKey, sort_key, x_key, x_series, x_value
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import (
    Colours,
    Figure,
    XAxis,
    axis,
    base_layout,
    label_variants,
    provenance,
    row_hover,
    trace_style,
)

# Marker of each kind of unmeasured case on the strip: (symbol, colour).
MARK_STYLE = {"skipped": ("x-thin-open", "#7f7f7f"), "out of memory": ("triangle-up", "#d62728"),
              "failed": ("x", "#d62728"), "incorrect": ("diamond", "#ff7f0e")}


@dataclass(frozen=True)
class MemorySeries:
    key: SeriesKey
    rows: tuple[Row, ...]  # sorted along x, peak_bytes > 0
    x_key: str = "seq_len"  # the parameter on x (data.x_key)

    @property
    def x(self) -> list[int]:
        return [v for r in self.rows if (v := x_value(r, self.x_key)) is not None]

    @property
    def seq_len(self) -> list[int]:
        return [v for r in self.rows if (v := x_value(r, "seq_len")) is not None]

    @property
    def peak_bytes(self) -> list[int]:
        return [int(r.peak_bytes) for r in self.rows]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Mark:
    """A case without a memory figure, drawn on the strip at (x, impl)."""

    kind: str  # skipped | out of memory | failed | incorrect
    row: Row
    x: int  # its value of the parameter on x


@dataclass(frozen=True)
class MemoryData:
    series: tuple[MemorySeries, ...]
    marks: tuple[Mark, ...]
    not_positive: int  # ok records whose peak was <= 0 bytes above the inputs: no point on a log axis
    x_key: str = "seq_len"  # the parameter on x (data.x_key), as the time view's


def mark_kind(row: Row) -> str | None:
    if row.status == "ok":
        return None
    if row.out_of_memory:
        return "out of memory"
    return row.status


def memory_data(rows: Sequence[Row]) -> MemoryData | None:
    key = x_key(rows)
    on_x = [r for r in rows if x_value(r, key) is not None]
    measured = [r for r in on_x if r.status == "ok" and r.peak_bytes is not None]
    positive = [r for r in measured if r.peak_bytes > 0]  # type: ignore[operator]
    series = tuple(MemorySeries(k, tuple(members), key) for k, members in x_series(positive, key).items())
    marks = tuple(Mark(kind, r, x) for r in on_x
                  if (kind := mark_kind(r)) is not None and (x := x_value(r, key)) is not None)
    if not series and not marks:
        return None
    return MemoryData(series, marks, len(measured) - len(positive), key)


def memory_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    data = memory_data(rows)
    if data is None:
        return None
    traces = []
    x_axis = XAxis(data.x_key, [n for s in data.series for n in s.x] + [m.x for m in data.marks])
    variants = label_variants(s.key for s in data.series)
    for s in data.series:
        name = plot_text(s.key.name())
        texts = [row_hover(r, f"peak {format_bytes(r.peak_bytes)} above the inputs"
                              + (f" ({plot_text(r.memory_method)})" if r.memory_method else "")) for r in s.rows]
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": x_axis(s.x),
                       "y": s.peak_bytes,
                       "hovertext": texts, "hoverinfo": "text", "xaxis": "x", "yaxis": "y",
                       **trace_style(s.key, colours(s.key.impl), variants[s.key.label])})
    strip_impls = sorted({m.row.impl for m in data.marks}, key=sort_key)
    for kind, (symbol, colour) in MARK_STYLE.items():
        marks = [m for m in data.marks if m.kind == kind]
        if not marks:
            continue
        traces.append({"type": "scatter", "mode": "markers", "name": f"{kind} (no memory figure)",
                       "x": x_axis([m.x for m in marks]),
                       "y": [plot_text(m.row.impl) for m in marks],
                       "hovertext": [row_hover(m.row, f"<b>{kind}</b>: {plot_text(m.row.reason or 'no reason given')}")
                                     for m in marks],
                       "hoverinfo": "text", "marker": {"symbol": symbol, "color": colour, "size": 10},
                       "xaxis": "x", "yaxis": "y2"})
    prov = provenance([r for s in data.series for r in s.rows] + [m.row for m in data.marks])
    # the memory axis on top, the strip of unmeasured cases below it; each takes all the room when alone
    has_strip, has_series = bool(data.marks), bool(data.series)
    strip_top = 0.24 if has_series else 1.0
    layout = base_layout(f"Peak memory against {x_axis.against}", prov,
                         height=470 if has_strip and has_series else 430 if has_series else 150 + 40 * len(strip_impls))
    layout["xaxis"] = {**x_axis.layout, "anchor": "y2" if has_strip else "y"}
    layout["yaxis"] = axis("peak memory above inputs [bytes]", log=True, exponentformat="SI",
                           domain=[0.32 if has_strip else 0.0, 1.0], visible=has_series)
    if has_strip:
        layout["yaxis2"] = axis("not measured", type="category", domain=[0.0, strip_top],
                                categoryorder="array", categoryarray=[plot_text(i) for i in strip_impls])
    notes = []
    if data.not_positive:
        notes.append(f"{data.not_positive} ok record(s) peaked at <= 0 bytes above their inputs (allocator reuse); "
                     "a log axis cannot show them")
    return Figure("memory", f"Peak memory against {x_axis.against} ({x_axis.scale}); skipped, out-of-memory and "
                  "failed cases marked below", prov.text(), {"data": traces, "layout": layout}, notes=notes)


# ---------------------------------------------------------------------------------------------------------
# fraction of hardware peak


def peak_series(rows: Sequence[Row], x: str | None = None) -> dict[SeriesKey, list[Row]]:
    """Series of the records with a fraction of peak along x = `x` (default `x_key(rows)`, as the time view)."""
    with_peak = [r for r in rows if r.status == "ok" and r.peak_fraction is not None]
    return x_series(with_peak, x or x_key(rows))


def peak_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    on_x = x_key(rows)
    series = peak_series(rows, on_x)
    if not series:
        return None
    traces = []
    x_axis = XAxis(on_x, (v for members in series.values() for r in members if (v := x_value(r, on_x)) is not None))
    variants = label_variants(series)
    for key, members in series.items():
        texts = []
        for r in members:
            rate = f"{r.flops_per_s / 1e9:.3g} GFLOP/s" if r.flops_per_s else "rate unknown"
            peak = f"{r.peak_flops / 1e12:.3g} TFLOP/s" if r.peak_flops else "?"
            texts.append(row_hover(r, f"{100 * r.peak_fraction:.3g}% of peak ({rate} of {peak})",  # type: ignore[operator]
                                   plot_text(f"peak: {r.peak_source or '?'}"
                                             + (f", {r.peak_hardware}" if r.peak_hardware else ""))))
        traces.append({"type": "scatter", "mode": "lines+markers", "name": plot_text(key.name()),
                       "x": x_axis([v for r in members if (v := x_value(r, on_x)) is not None]),
                       "y": [100 * float(r.peak_fraction) for r in members],  # type: ignore[arg-type]
                       "hovertext": texts, "hoverinfo": "text",
                       **trace_style(key, colours(key.impl), variants[key.label])})
    prov = provenance(r for members in series.values() for r in members)
    layout = base_layout("Fraction of hardware peak FLOP rate", prov)
    layout["xaxis"] = x_axis.layout
    layout["yaxis"] = axis("useful FLOP rate / peak [%]", rangemode="tozero")
    return Figure("peak", "Fraction of the hardware's peak FLOP rate (useful FLOPs: 4·B·H·nnz·D forward)",
                  prov.text(), {"data": traces, "layout": layout})
