"""The roofline views: where each measured call sits against the machine's two roofs.

- roofline: arithmetic intensity (useful FLOPs over the least bytes the call must move) against the achieved
  FLOP rate, both axes log; the compute roof (the calibrated matmul rate, or a GPU's datasheet) and the memory
  roof (bandwidth x intensity: the calibrated all-thread read, or the datasheet) drawn. Decode sits far left, under
  the memory roof; prefill right, under the compute roof.
- decode: time per call against the KV length for the cases with a few query rows (q_len <= 16), per
  implementation, with the memory floor (the least bytes over the bandwidth) drawn: a call at the floor reads
  every byte it needs once, at the machine's read bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.dashboard.data import Row
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import Colours, Figure, PlotlyJson, axis, base_layout, provenance, row_hover

DECODE_ROWS = 16


def _intensity(row: Row) -> float:
    return float(row.flops or 0) / float(row.bytes_moved or 1)


def _rate(row: Row) -> float:
    return float(row.flops or 0) / float(row.median_s or 1)


def _rooflined(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.measured_ok and r.bytes_moved and r.flops and r.median_s
            and (r.peak_bandwidth or r.peak_flops)]


def roofline_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    points = _rooflined(rows)
    if len(points) < 2:
        return None
    traces: list[PlotlyJson] = []
    for impl in sorted({r.impl for r in points}):
        members = [r for r in points if r.impl == impl]
        traces.append({"type": "scatter", "mode": "markers", "name": plot_text(impl),
                       "x": [_intensity(r) for r in members], "y": [_rate(r) for r in members],
                       "marker": {"color": colours(impl), "size": 9}, "hoverinfo": "text",
                       "hovertext": [row_hover(r, plot_text(
                           f"{_intensity(r):.3g} FLOP/byte, {_rate(r) / 1e9:.3g} GFLOP/s, "
                           f"{(r.bytes_moved or 0) / (r.median_s or 1) / 1e9:.3g} GB/s; bound: {r.peak_bound}"))
                           for r in members]})
    intensities = [_intensity(r) for r in points]
    lo, hi = min(intensities) / 2, max(intensities) * 2
    bandwidth = max((r.peak_bandwidth for r in points if r.peak_bandwidth), default=None)
    peak = max((r.peak_flops for r in points if r.peak_flops), default=None)
    grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
    if bandwidth:
        roof = [bandwidth * x if peak is None else min(peak, bandwidth * x) for x in grid]
        source = next(r.peak_bandwidth_source for r in points if r.peak_bandwidth == bandwidth)
        traces.append({"type": "scatter", "mode": "lines", "name": plot_text(f"roof ({source}, "
                                                                          f"{bandwidth / 1e9:.3g} GB/s)"),
                       "x": grid, "y": roof, "line": {"color": "#444444", "dash": "dash"}, "hoverinfo": "skip"})
    elif peak:
        traces.append({"type": "scatter", "mode": "lines", "name": "compute roof", "x": grid,
                       "y": [peak] * len(grid), "line": {"color": "#444444", "dash": "dash"}, "hoverinfo": "skip"})
    prov = provenance(points)
    layout = base_layout("Roofline: achieved rate against arithmetic intensity", prov)
    layout["xaxis"] = axis("arithmetic intensity (useful FLOPs / least bytes moved)", log=True)
    layout["yaxis"] = axis("achieved FLOP/s (useful)", log=True)
    return Figure("roofline", "Roofline: each call against the memory roof (bandwidth x intensity) and the compute "
                  "roof", prov.text(), {"data": traces, "layout": layout})


def decode_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    decode = [r for r in rows if r.measured_ok and r.median_s and isinstance(r.params.get("seq_len"), int)
              and isinstance(r.params.get("q_len"), int) and r.params["q_len"] <= DECODE_ROWS]
    if len({r.params["seq_len"] for r in decode}) < 2:
        return None
    traces: list[PlotlyJson] = []
    for impl in sorted({r.impl for r in decode}):
        members = sorted((r for r in decode if r.impl == impl), key=lambda r: r.params["seq_len"])
        traces.append({"type": "scatter", "mode": "lines+markers", "name": plot_text(impl),
                       "x": [r.params["seq_len"] for r in members], "y": [r.median_s for r in members],
                       "marker": {"color": colours(impl)}, "line": {"color": colours(impl)}, "hoverinfo": "text",
                       "hovertext": [row_hover(r, plot_text(
                           f"{(r.median_s or 0) * 1e3:.3g} ms per step; "
                           + (f"{r.bytes_moved / (r.median_s or 1) / 1e9:.3g} GB/s" if r.bytes_moved else "")))
                           for r in members]})
    floor = {}
    for r in decode:
        if r.bytes_moved and r.peak_bandwidth:
            floor[r.params["seq_len"]] = r.bytes_moved / r.peak_bandwidth
    if floor:
        xs = sorted(floor)
        source = next(r.peak_bandwidth_source for r in decode if r.peak_bandwidth)
        traces.append({"type": "scatter", "mode": "lines", "name": plot_text(f"memory floor ({source})"),
                       "x": xs, "y": [floor[x] for x in xs], "line": {"color": "#444444", "dash": "dash"},
                       "hoverinfo": "skip"})
    prov = provenance(decode)
    layout = base_layout("Decode: time per step against KV length", prov)
    layout["xaxis"] = axis("KV length (keys)", log=True)
    layout["yaxis"] = axis("time per step (s)", log=True)
    return Figure("decode", "Decode: time per step against the KV length, the memory floor (least bytes over the "
                  "read bandwidth) dashed", prov.text(), {"data": traces, "layout": layout})
