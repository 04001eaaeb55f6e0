"""Break-even sparsity: the density below which a sparse implementation beats dense (and sdpa), from density
sweeps (block_random and the other patterns with a density field).

How it is found: at each measured density p the ratio r(p) = t_impl / t_baseline of medians on the same case and
environment. A sparse kernel's time grows about linearly with the kept blocks while dense attention's does not
depend on them, so r is close to linear in p between two measured densities; the break-even p* is where the
straight line between the last density with r < 1 and the next one with r >= 1 crosses 1 (the first such
crossing from the sparse end). When r < 1 at every measured density, p* lies above the largest one; when r >= 1
already at the smallest, below it: both are shown as bounds, never as a value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from bench.console.format import format_seconds
from bench.dashboard.data import BASELINES, Row, SeriesKey, pair_key, params_label, series_of, varying_keys
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import (
    Colours,
    Figure,
    axis,
    base_layout,
    hover,
    label_variants,
    provenance,
    trace_style,
)

HOW = ("linear interpolation of t_impl / t_baseline in density between the two measured densities around "
       "the crossing of 1; bounds where it never crosses")


@dataclass(frozen=True)
class RatioPoint:
    density: float
    ratio: float  # t_impl / t_baseline: < 1 means the sparse implementation is faster
    row: Row
    baseline: Row


@dataclass(frozen=True)
class BreakEven:
    key: SeriesKey  # impl and provenance; its label names the varying parameters besides density
    baseline: str
    seq_len: int
    points: tuple[RatioPoint, ...]  # by density
    density: float  # the break-even density, or the bound
    bound: str  # "exact" | "above" (faster at every measured density) | "below" (slower at every one)

    def describe(self) -> str:
        if self.bound == "above":
            return f"p* > {self.density:g}: faster than {self.baseline} at every measured density"
        if self.bound == "below":
            return f"p* < {self.density:g}: slower than {self.baseline} at every measured density"
        return f"p* = {self.density:.3g}: faster than {self.baseline} below this density"


def break_even(points: Sequence[tuple[float, float]]) -> tuple[float, str]:
    """(p*, bound) from (density, t_impl / t_baseline) points; see the module docstring."""
    pts = sorted(points)
    if not pts:
        raise ValueError("break_even needs at least one point")
    d0, r0 = pts[0]
    if r0 >= 1:
        return (d0, "exact") if r0 == 1 else (d0, "below")
    for (d_lo, r_lo), (d_hi, r_hi) in pairwise(pts):
        if r_hi >= 1:
            return d_lo + (1 - r_lo) * (d_hi - d_lo) / (r_hi - r_lo), "exact"
    return pts[-1][0], "above"


def break_even_data(rows: Sequence[Row]) -> list[BreakEven]:
    """Break-even density of every non-baseline implementation, per baseline present, per series and seq_len."""
    with_density = [r for r in rows if isinstance(r.params.get("density"), (int, float))
                    and not isinstance(r.params.get("density"), bool) and isinstance(r.params.get("seq_len"), int)]
    if len({r.params["density"] for r in with_density}) < 2:
        return []
    out = []
    for baseline in BASELINES:
        base = {pair_key(r): r for r in with_density if r.impl == baseline and r.measured_ok}
        if not base:
            continue
        timed = [r for r in with_density if r.impl not in BASELINES and r.measured_ok and pair_key(r) in base]
        for key, members in series_of(timed, ["density"]).items():
            by_seq: dict[int, list[RatioPoint]] = {}
            for r in members:
                b = base[pair_key(r)]
                if r.median_s and b.median_s:
                    by_seq.setdefault(int(r.params["seq_len"]), []).append(
                        RatioPoint(float(r.params["density"]), r.median_s / b.median_s, r, b))
            for seq_len, pts in sorted(by_seq.items()):
                pts.sort(key=lambda p: p.density)
                density, bound = break_even([(p.density, p.ratio) for p in pts])
                out.append(BreakEven(key, baseline, seq_len, tuple(pts), density, bound))
    return out


def _summary_key(item: BreakEven, label_keys: Sequence[str]) -> tuple[SeriesKey, str]:
    row = item.points[0].row
    return SeriesKey(item.key.impl, item.key.source, item.key.interpreter, params_label(row, label_keys)), item.baseline


def breakeven_figures(rows: Sequence[Row], colours: Colours) -> list[Figure]:
    items = break_even_data(rows)
    if not items:
        return []
    used = [r for it in items for p in it.points for r in (p.row, p.baseline)]
    prov = provenance(used)
    label_keys = varying_keys(used, exclude=["density", "seq_len"])
    # break-even density against seq_len
    groups: dict[tuple[SeriesKey, str], list[BreakEven]] = {}
    for it in items:
        groups.setdefault(_summary_key(it, label_keys), []).append(it)
    traces = []
    symbols = {"exact": "circle", "above": "triangle-up-open", "below": "triangle-down-open"}
    variants = label_variants(key for key, _ in groups)
    for (key, baseline), its in groups.items():
        style = trace_style(key, colours(key.impl), variants[key.label])
        style["line"]["dash"] = "solid" if baseline == BASELINES[0] else "dashdot"
        style["marker"]["symbol"] = [symbols[it.bound] for it in its]
        style["marker"]["size"] = 10
        texts = [hover([f"<b>{plot_text(key.name())}</b> vs {baseline}", f"N={it.seq_len}",
                        plot_text(it.describe()), f"from {len(it.points)} densities: "
                        + ", ".join(f"p={p.density:g} x{p.ratio:.2f}" for p in it.points)]) for it in its]
        traces.append({"type": "scatter", "mode": "lines+markers", "name": f"{plot_text(key.name())} vs {baseline}",
                       "x": [it.seq_len for it in its], "y": [it.density for it in its], "hovertext": texts,
                       "hoverinfo": "text", **style})
    layout = base_layout("Break-even density against sequence length", prov)
    layout["xaxis"] = axis("sequence length N", log=True)
    layout["yaxis"] = axis("break-even density p* (faster below)", rangemode="tozero")
    summary = Figure("breakeven", "Break-even density: below it the sparse implementation beats the baseline "
                     "(▲ open: above the largest density measured; ▼ open: below the smallest)", prov.text(),
                     {"data": traces, "layout": layout}, notes=[f"how: {HOW}"])
    # how it was found: the time ratio against density, crossing 1
    traces = [{"type": "scatter", "mode": "lines", "name": "ratio 1 (break-even)", "x": [0, 1], "y": [1, 1],
               "line": {"color": "#444444", "dash": "dash", "width": 1}, "hoverinfo": "skip"}]
    variants = label_variants(it.key for it in items)
    for it in items:
        key = it.key
        style = trace_style(key, colours(key.impl), variants[key.label])
        name = plot_text(f"{key.name()} vs {it.baseline}")
        texts = [hover([f"<b>{name}</b>", f"p={p.density:g}: x{p.ratio:.3g} of {it.baseline}'s time "
                        f"({format_seconds(p.row.median_s)} / {format_seconds(p.baseline.median_s)})",
                        plot_text(f"run {p.row.run_id}")]) for p in it.points]
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "legendgroup": name,
                       "x": [p.density for p in it.points], "y": [p.ratio for p in it.points], "hovertext": texts,
                       "hoverinfo": "text", **style})
        if it.bound == "exact":
            traces.append({"type": "scatter", "mode": "markers", "name": f"{name} p*", "legendgroup": name,
                           "showlegend": False, "x": [it.density], "y": [1.0],
                           "hovertext": [hover([f"<b>{name}</b>", plot_text(it.describe())])], "hoverinfo": "text",
                           "marker": {"symbol": "star", "size": 13, "color": colours(key.impl)}})
    layout = base_layout("Time relative to the baseline against density", prov)
    layout["xaxis"] = axis("density p (kept fraction)", range=[0, 1])
    layout["yaxis"] = axis("t_impl / t_baseline (below 1: faster)", log=True)
    ratio = Figure("breakeven_ratio", "Time relative to the baseline against density; ★ marks the interpolated "
                   "break-even", prov.text(), {"data": traces, "layout": layout}, notes=[f"how: {HOW}"])
    return [summary, ratio]
