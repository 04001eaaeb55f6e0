"""Time against sequence length (log-log, with the median's 95% interval as a band; against the number of
documents, q_len, window, ... where only that varies: data.x_key) and speedup over dense as a heatmap over
(sequence length, window or density)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bench.console.format import format_seconds
from bench.dashboard.data import (
    BASELINES,
    X_KEYS,
    Row,
    SeriesKey,
    baseline_impl,
    format_value,
    pair_key,
    series_of,
    sort_key,
    varying_keys,
    x_key,
    x_series,
    x_value,
)
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import (
    X_TITLES,
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

# ---------------------------------------------------------------------------------------------------------
# time against sequence length (or the parameter of data.x_key)


@dataclass(frozen=True)
class TimeSeries:
    key: SeriesKey
    rows: tuple[Row, ...]  # sorted along x
    x_key: str = "seq_len"  # the parameter on x (data.x_key)

    @property
    def x(self) -> list[int]:
        return [v for r in self.rows if (v := x_value(r, self.x_key)) is not None]

    @property
    def seq_len(self) -> list[int]:
        return [v for r in self.rows if (v := x_value(r, "seq_len")) is not None]

    @property
    def median_s(self) -> list[float]:
        return [float(r.median_s) for r in self.rows]  # type: ignore[arg-type]

    def band(self) -> tuple[list[int], list[float], list[float]]:
        """(x, low, high) of the points that have a 95% interval of their median."""
        with_ci = [r for r in self.rows if r.ci95_s is not None]
        return ([v for r in with_ci if (v := x_value(r, self.x_key)) is not None],
                [r.ci95_s[0] for r in with_ci], [r.ci95_s[1] for r in with_ci])  # type: ignore[index]


def time_series(rows: Sequence[Row], x: str | None = None) -> list[TimeSeries]:
    """One series per (impl, provenance, other varying parameters) over the `ok` records with a time, along
    x = `x` (default: `x_key(rows)`, seq_len unless only another count varies)."""
    key = x or x_key(rows)
    timed = [r for r in rows if r.measured_ok]
    return [TimeSeries(k, tuple(members), key) for k, members in x_series(timed, key).items()]


def rgba(colour: str, alpha: float) -> str:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def time_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    key = x_key(rows)
    series = time_series(rows, key)
    if not series:
        return None
    traces = []
    variants = label_variants(s.key for s in series)
    x_axis = XAxis(key, (n for s in series for n in s.x))
    single_n = x_axis.single  # one x value: CIs as error bars instead of a band
    for s in series:
        name = plot_text(s.key.name())
        style = trace_style(s.key, colours(s.key.impl), variants[s.key.label])
        xs, lo, hi = s.band()
        if single_n:
            pairs = [(r.ci95_s, float(r.median_s)) for r in s.rows]  # type: ignore[arg-type]
            style["error_y"] = {"type": "data", "symmetric": False, "color": colours(s.key.impl),
                                "array": [ci[1] - m if ci else 0 for ci, m in pairs],
                                "arrayminus": [m - ci[0] if ci else 0 for ci, m in pairs]}
        elif xs:
            traces.append({"type": "scatter", "mode": "lines", "x": xs + xs[::-1], "y": hi + lo[::-1], "fill": "toself",
                           "fillcolor": rgba(colours(s.key.impl), 0.15), "line": {"width": 0}, "hoverinfo": "skip",
                           "showlegend": False, "legendgroup": name, "name": f"{name} 95% CI"})
        texts = []
        for r in s.rows:
            ci = f" [{format_seconds(r.ci95_s[0])}, {format_seconds(r.ci95_s[1])}]" if r.ci95_s else ""
            texts.append(row_hover(r, f"median {format_seconds(r.median_s)}{ci} over {r.samples} samples"))
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "legendgroup": name,
                       "x": x_axis(s.x), "y": s.median_s,
                       "hovertext": texts, "hoverinfo": "text", **style})
    prov = provenance(r for s in series for r in s.rows)
    layout = base_layout(f"Time per call against {x_axis.against}", prov)
    layout["xaxis"] = x_axis.layout
    layout["yaxis"] = axis("time per call [s] (median, band: 95% CI)", log=True, exponentformat="SI")
    return Figure("time", f"Time per call against {x_axis.against} ({x_axis.scale}; band: 95% CI of the median)",
                  prov.text(), {"data": traces, "layout": layout})


# ---------------------------------------------------------------------------------------------------------
# speedup over dense


@dataclass(frozen=True)
class SpeedupCell:
    seq_len: int
    y: object  # the window or density of the case (None when the pattern has neither)
    speedup: float  # baseline median / impl median: > 1 means faster than the baseline
    row: Row
    baseline: Row


@dataclass(frozen=True)
class SpeedupPanel:
    key: SeriesKey
    cells: tuple[SpeedupCell, ...]


@dataclass(frozen=True)
class SpeedupData:
    baseline: str
    y_key: str | None  # density | window | another of data.X_KEYS (documents, ...) | None
    panels: tuple[SpeedupPanel, ...]


def speedup_y_key(rows: Sequence[Row]) -> str | None:
    """The heatmap's second axis: the density or window that varies, else another count of data.X_KEYS that
    does (documents, ...); else the density or window the pattern uses."""
    varying = varying_keys(rows, exclude=["seq_len"])
    for key in ("density", "window", *X_KEYS[1:]):
        if key in varying:
            return key
    fields = pattern_fields(rows[0]) if rows else set()
    return next((key for key in ("density", "window") if key in fields), None)


def pattern_fields(row: Row) -> set[str]:
    """The fields the case's pattern reads, from the pattern label that starts its case id.

    `bench.spec.case` writes ids as `<pattern label>-n<N>-...` and the label carries exactly the pattern's fields
    (`local_w64`, `block_random_p0.1_b64_s0`: see Pattern.label). Reading them here keeps torch (which
    bench.patterns imports) out of the dashboard.
    """
    label, pattern = row.case_id.split("-", 1)[0], str(row.params.get("pattern"))
    if not label.startswith(pattern + "_"):
        return set()
    short = {"w": "window", "p": "density", "b": "block_size", "d": "dilation",
             "g": "global_tokens", "s": "seed"}
    out = set()
    for part in label[len(pattern) + 1:].split("_"):
        letters = part.rstrip("0123456789.e+-")
        if letters in short:
            out.add(short[letters])
    return out


def speedup_data(rows: Sequence[Row]) -> SpeedupData | None:
    """Speedup of every implementation over the baseline (dense, else sdpa) on the same case and environment."""
    baseline = baseline_impl(rows)
    if baseline is None:
        return None
    base = {pair_key(r): r for r in rows if r.impl == baseline and r.measured_ok}
    timed = [r for r in rows if r.impl != baseline and r.measured_ok and pair_key(r) in base
             and isinstance(r.params.get("seq_len"), int)]
    y_key = speedup_y_key(rows)
    panels = []
    for key, members in series_of(timed, ["seq_len", *([y_key] if y_key else [])]).items():
        cells = []
        for r in members:
            b = base[pair_key(r)]
            if r.median_s and b.median_s:
                cells.append(SpeedupCell(int(r.params["seq_len"]), _y_value(r, y_key), b.median_s / r.median_s, r, b))
        if cells:
            panels.append(SpeedupPanel(key, tuple(cells)))
    return SpeedupData(baseline, y_key, tuple(panels)) if panels else None


def _y_value(row: Row, y_key: str | None) -> object:
    """A cell's row: the density or window as given; documents as a count (data.x_value)."""
    if y_key is None:
        return None
    return x_value(row, y_key) if y_key in X_KEYS[1:] and y_key != "window" else row.params.get(y_key)


def _grid_domains(n: int, columns: int) -> list[tuple[list[float], list[float]]]:
    """(x domain, y domain) of n panels in a grid, row-major from the top, with gaps between them."""
    rows = math.ceil(n / columns)
    gap_x, gap_y = 0.06, 0.16
    width, height = (1 - gap_x * (columns - 1)) / columns, (1 - gap_y * (rows - 1)) / rows
    out = []
    for i in range(n):
        r, c = divmod(i, columns)
        x0, y1 = c * (width + gap_x), 1 - r * (height + gap_y)
        out.append(([x0, x0 + width], [max(y1 - height, 0.0), y1]))
    return out


def speedup_figure(rows: Sequence[Row]) -> Figure | None:
    data = speedup_data(rows)
    if data is None:
        return None
    columns = min(len(data.panels), 3)
    domains = _grid_domains(len(data.panels), columns)
    y_name = {"density": "density p", "window": "window w"}.get(data.y_key or "") or X_TITLES.get(data.y_key or "",
                                                                                              ("", ""))[0]
    all_speedups = [c.speedup for p in data.panels for c in p.cells if c.speedup > 0]
    span = max([1.0, *(abs(math.log2(s)) for s in all_speedups)])
    prov = provenance(r for p in data.panels for c in p.cells for r in (c.row, c.baseline))
    layout = base_layout(f"Speedup over {data.baseline}", prov,
                         height=140 + 260 * math.ceil(len(data.panels) / columns))
    step = max(1, math.ceil(2 * span / 8))  # at most ~9 ticks, at powers of two
    ticks = list(range(-step * math.floor(span / step), math.floor(span) + 1, step))
    # plotly's RdBu runs blue (low) to red (high); reversed, faster (log2 speedup > 0) is blue
    layout["coloraxis"] = {"colorscale": "RdBu", "reversescale": True, "cmin": -span, "cmax": span, "cmid": 0,
                           "colorbar": {"title": {"text": f"x over {plot_text(data.baseline)}"},
                                        "tickvals": ticks, "ticktext": [f"x{2.0 ** v:g}" for v in ticks]}}
    layout["annotations"] = []
    traces = []
    for i, (panel, (xd, yd)) in enumerate(zip(data.panels, domains, strict=True)):
        suffix = "" if i == 0 else str(i + 1)
        xs = sorted({c.seq_len for c in panel.cells})
        ys = sorted({c.y for c in panel.cells}, key=sort_key)
        x_labels = [f"N={n}" for n in xs]
        # no window or density to vary: the one row is the pattern's, not "None"
        y_labels = [plot_text(format_value(y) if y is not None else str(panel.cells[0].row.params.get("pattern")))
                    for y in ys]
        z: list[list[float | None]] = [[None] * len(xs) for _ in ys]
        text: list[list[str]] = [[""] * len(xs) for _ in ys]
        hovers: list[list[str]] = [[""] * len(xs) for _ in ys]
        for c in panel.cells:
            yi, xi = ys.index(c.y), xs.index(c.seq_len)
            z[yi][xi] = math.log2(c.speedup) if c.speedup > 0 else None
            text[yi][xi] = f"x{c.speedup:.2g}"
            hovers[yi][xi] = row_hover(c.row, f"x{c.speedup:.3g} over {plot_text(data.baseline)} "
                                              f"({format_seconds(c.baseline.median_s)} / "
                                              f"{format_seconds(c.row.median_s)})")
        traces.append({"type": "heatmap", "x": x_labels, "y": y_labels, "z": z, "text": text,
                       "texttemplate": "%{text}", "hovertext": hovers, "hoverinfo": "text",
                       "coloraxis": "coloraxis", "xaxis": f"x{suffix}", "yaxis": f"y{suffix}",
                       "name": plot_text(panel.key.name())})
        last_row = i >= len(data.panels) - columns
        layout[f"xaxis{suffix}"] = axis("sequence length" if last_row else "", domain=xd, anchor=f"y{suffix}",
                                        type="category")
        layout[f"yaxis{suffix}"] = axis(y_name if i % columns == 0 else "", domain=yd, anchor=f"x{suffix}",
                                        type="category")
        layout["annotations"].append({"text": plot_text(panel.key.name()), "xref": "paper", "yref": "paper",
                                      "x": (xd[0] + xd[1]) / 2, "y": yd[1], "yanchor": "bottom",
                                      "xanchor": "center", "showarrow": False, "font": {"size": 12}})
    title = (f"Speedup over {data.baseline} (its median time / the implementation's, same case and environment; "
             f"blue: faster)")
    note = [] if data.baseline == BASELINES[0] else [f"no dense records here: speedups are over {data.baseline}"]
    return Figure("speedup", title, prov.text(), {"data": traces, "layout": layout}, notes=note)
