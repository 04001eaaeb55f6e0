"""Peak memory against sequence length, with the cases that were not measured (skipped, out of memory, failed,
incorrect) marked on a strip below; and the achieved fraction of the hardware's peak FLOP rate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.dashboard.data import Row, SeriesKey, series_of, sort_key
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import (
    Colours,
    Figure,
    SeqLenAxis,
    axis,
    base_layout,
    format_bytes,
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
    rows: tuple[Row, ...]  # sorted by seq_len, peak_bytes > 0

    @property
    def seq_len(self) -> list[int]:
        return [int(r.params["seq_len"]) for r in self.rows]

    @property
    def peak_bytes(self) -> list[int]:
        return [int(r.peak_bytes) for r in self.rows]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Mark:
    """A case without a memory figure, drawn on the strip at (seq_len, impl)."""

    kind: str  # skipped | out of memory | failed | incorrect
    row: Row


@dataclass(frozen=True)
class MemoryData:
    series: tuple[MemorySeries, ...]
    marks: tuple[Mark, ...]
    not_positive: int  # ok records whose peak was <= 0 bytes above the inputs: no point on a log axis


def mark_kind(row: Row) -> str | None:
    if row.status == "ok":
        return None
    if row.out_of_memory:
        return "out of memory"
    return row.status


def memory_data(rows: Sequence[Row]) -> MemoryData | None:
    with_seq = [r for r in rows if isinstance(r.params.get("seq_len"), int)]
    measured = [r for r in with_seq if r.status == "ok" and r.peak_bytes is not None]
    positive = [r for r in measured if r.peak_bytes > 0]  # type: ignore[operator]
    series = tuple(MemorySeries(key, tuple(sorted(members, key=lambda r: r.params["seq_len"])))
                   for key, members in series_of(positive, ["seq_len"]).items())
    marks = tuple(Mark(kind, r) for r in with_seq if (kind := mark_kind(r)) is not None)
    if not series and not marks:
        return None
    return MemoryData(series, marks, len(measured) - len(positive))


def memory_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    data = memory_data(rows)
    if data is None:
        return None
    traces = []
    x_axis = SeqLenAxis([n for s in data.series for n in s.seq_len]
                        + [int(m.row.params["seq_len"]) for m in data.marks])
    variants = label_variants(s.key for s in data.series)
    for s in data.series:
        name = plot_text(s.key.name())
        texts = [row_hover(r, f"peak {format_bytes(r.peak_bytes)} above the inputs"
                              + (f" ({plot_text(r.memory_method)})" if r.memory_method else "")) for r in s.rows]
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": x_axis(s.seq_len),
                       "y": s.peak_bytes,
                       "hovertext": texts, "hoverinfo": "text", "xaxis": "x", "yaxis": "y",
                       **trace_style(s.key, colours(s.key.impl), variants[s.key.label])})
    strip_impls = sorted({m.row.impl for m in data.marks}, key=sort_key)
    for kind, (symbol, colour) in MARK_STYLE.items():
        marks = [m for m in data.marks if m.kind == kind]
        if not marks:
            continue
        traces.append({"type": "scatter", "mode": "markers", "name": f"{kind} (no memory figure)",
                       "x": x_axis([int(m.row.params["seq_len"]) for m in marks]),
                       "y": [plot_text(m.row.impl) for m in marks],
                       "hovertext": [row_hover(m.row, f"<b>{kind}</b>: {plot_text(m.row.reason or 'no reason given')}")
                                     for m in marks],
                       "hoverinfo": "text", "marker": {"symbol": symbol, "color": colour, "size": 10},
                       "xaxis": "x", "yaxis": "y2"})
    prov = provenance([r for s in data.series for r in s.rows] + [m.row for m in data.marks])
    # the memory axis on top, the strip of unmeasured cases below it; each takes all the room when alone
    has_strip, has_series = bool(data.marks), bool(data.series)
    strip_top = 0.24 if has_series else 1.0
    layout = base_layout("Peak memory against sequence length", prov,
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
    return Figure("memory", "Peak memory against sequence length (log-log); skipped, out-of-memory and failed "
                  "cases marked below", prov.text(), {"data": traces, "layout": layout}, notes=notes)


# ---------------------------------------------------------------------------------------------------------
# fraction of hardware peak


def peak_series(rows: Sequence[Row]) -> dict[SeriesKey, list[Row]]:
    with_peak = [r for r in rows if r.status == "ok" and r.peak_fraction is not None
                 and isinstance(r.params.get("seq_len"), int)]
    return {key: sorted(members, key=lambda r: r.params["seq_len"])
            for key, members in series_of(with_peak, ["seq_len"]).items()}


def peak_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    series = peak_series(rows)
    if not series:
        return None
    traces = []
    x_axis = SeqLenAxis(int(r.params["seq_len"]) for members in series.values() for r in members)
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
                       "x": x_axis([int(r.params["seq_len"]) for r in members]),
                       "y": [100 * float(r.peak_fraction) for r in members],  # type: ignore[arg-type]
                       "hovertext": texts, "hoverinfo": "text",
                       **trace_style(key, colours(key.impl), variants[key.label])})
    prov = provenance(r for members in series.values() for r in members)
    layout = base_layout("Fraction of hardware peak FLOP rate", prov)
    layout["xaxis"] = x_axis.layout
    layout["yaxis"] = axis("useful FLOP rate / peak [%]", rangemode="tozero")
    return Figure("peak", "Fraction of the hardware's peak FLOP rate (useful FLOPs: 4·B·H·nnz·D forward)",
                  prov.text(), {"data": traces, "layout": layout})
