"""Communication bytes against world size per implementation: measured points (all ranks, and the busiest rank)
over the closed-form line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.console.format import format_bytes
from bench.dashboard.data import Row, SeriesKey, series_of
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import (
    Colours,
    Figure,
    axis,
    base_layout,
    label_variants,
    provenance,
    row_hover,
    trace_style,
)


@dataclass(frozen=True)
class CommSeries:
    key: SeriesKey
    rows: tuple[Row, ...]  # sorted by world size

    @property
    def world_size(self) -> list[int]:
        return [world_size(r) for r in self.rows]

    @property
    def bytes_total(self) -> list[int]:
        return [int(r.comm_bytes_total) for r in self.rows]  # type: ignore[arg-type]

    @property
    def expected_bytes(self) -> list[int | None]:
        return [r.comm_expected_bytes for r in self.rows]

    @property
    def mismatches(self) -> list[Row]:
        """Records whose counted bytes differ from the implementation's closed form."""
        return [r for r in self.rows
                if r.comm_expected_bytes is not None and r.comm_expected_bytes != r.comm_bytes_total]


def world_size(row: Row) -> int:
    value = row.params.get("world_size")
    return int(value) if isinstance(value, int) else 1


def comm_series(rows: Sequence[Row]) -> list[CommSeries]:
    counted = [r for r in rows if r.comm_bytes_total is not None]
    return [CommSeries(key, tuple(sorted(members, key=world_size)))
            for key, members in series_of(counted, ["world_size"]).items()]


def comm_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    series = comm_series(rows)
    if not series:
        return None
    traces = []
    variants = label_variants(s.key for s in series)
    for s in series:
        name = plot_text(s.key.name())
        style = trace_style(s.key, colours(s.key.impl), variants[s.key.label])
        expected = [(w, e) for w, e in zip(s.world_size, s.expected_bytes, strict=True) if e is not None]
        if expected:
            traces.append({"type": "scatter", "mode": "lines", "name": f"{name} closed form",
                           "legendgroup": name, "x": [w for w, _ in expected], "y": [e for _, e in expected],
                           "line": {"color": colours(s.key.impl), "dash": "dot", "width": 1.5},
                           "hovertext": [f"{name} closed form: {e:,} bytes at P={w}" for w, e in expected],
                           "hoverinfo": "text"})
        texts = []
        for r in s.rows:
            ops = ", ".join(f"{plot_text(op)} {format_bytes(b)}" for op, b in r.comm_by_op.items()) or "no ops"
            check = ("" if r.comm_expected_bytes is None else " = closed form" if r.comm_expected_bytes ==
                     r.comm_bytes_total else f" ≠ closed form {r.comm_expected_bytes:,}")
            levels = "; ".join(f"level {plot_text(level)} {format_bytes(b)}" + (
                "" if e is None else " = closed form" if e == b else f" ≠ closed form {format_bytes(e)}")
                for level, (b, e) in r.comm_by_level.items())
            texts.append(row_hover(r, f"{r.comm_bytes_total:,} bytes sent, all ranks{check}",
                                   f"busiest rank {format_bytes(r.comm_bytes_max_rank)}; {ops}",
                                   *([levels] if levels else []), plot_text(f"backend {r.comm_backend}")))
        marker_style = {**style["marker"], "size": 9}
        traces.append({"type": "scatter", "mode": "markers", "name": f"{name} measured" if s.key.source != "modelled"
                       else name, "legendgroup": name, "x": s.world_size, "y": s.bytes_total, "hovertext": texts,
                       "hoverinfo": "text", "marker": marker_style})
        busiest = [(w, r) for w, r in zip(s.world_size, s.rows, strict=True) if r.comm_bytes_max_rank is not None]
        if busiest:
            symbol = str(marker_style["symbol"])
            traces.append({"type": "scatter", "mode": "markers", "name": f"{name} busiest rank", "legendgroup": name,
                           "x": [w for w, _ in busiest], "y": [r.comm_bytes_max_rank for _, r in busiest],
                           "hovertext": [f"{name} busiest rank: {r.comm_bytes_max_rank:,} bytes at P={w}"
                                         for w, r in busiest], "hoverinfo": "text",
                           "marker": {**marker_style, "size": 7,
                                      "symbol": symbol if symbol.endswith("-open") else f"{symbol}-open"}})
    prov = provenance(r for s in series for r in s.rows)
    layout = base_layout("Communication bytes against world size", prov)
    layout["xaxis"] = axis("world size P (ranks)", log=True, dtick=0.30102999566)  # log10(2): a tick per doubling
    layout["yaxis"] = axis("bytes sent per call (all ranks; open: the busiest rank)", log=True, exponentformat="SI")
    notes = [f"{s.key.name()}: {len(s.mismatches)} record(s) differ from the closed form"
             for s in series if s.mismatches]
    return Figure("comm", "Communication bytes against world size (filled points: all ranks, counted by bench.comm; "
                  "open points: the busiest rank; dotted: the implementation's closed form)", prov.text(),
                  {"data": traces, "layout": layout}, notes=notes)
