"""What every figure shares: its provenance line, the trace styles that tell models and interpreter runs apart,
colours per implementation, hover formatting, and the `Figure` container the pages render.

Figures are plain plotly dicts (`{"data": [...], "layout": {...}}`): building `plotly.graph_objects` for
hundreds of traces is slow and embeds a 6 KB template in each; the tests validate every dict we produce with
`plotly.graph_objects.Figure`, so a misspelt property still fails.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.dashboard.data import SHORT_NAMES, Row, SeriesKey
from bench.dashboard.escaping import plot_text

# plotly's default qualitative palette ("Plotly"), then a few more; implementations keep their colour on every page.
PALETTE = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880", "#ff97ff",
           "#fecb52", "#1f77b4", "#8c564b", "#7f7f7f", "#bcbd22", "#17becf")
MODEL_NOTE = "model: computed from a hardware model, not measured"
INTERPRETER_NOTE = "Triton interpreter: a CPU emulation of the kernel, its time is not kernel speed"


# Plotly's own JSON (a figure, a trace, a layout or an axis): its schema is Plotly's (plotly.com/python/reference),
# checked by the browser tests that render every page, not modelled again here.
PlotlyJson = dict[str, Any]


@dataclass
class Figure:
    """One figure of a page: its plotly dict plus the caption the HTML shows above it (plain text)."""

    view: str  # which view made it: time, speedup, memory, comm, imbalance, overlap, breakeven, peak,
    # correctness, history
    title: str
    provenance: str
    plotly: PlotlyJson
    notes: list[str] = field(default_factory=list)
    id: str = ""  # set when its page is rendered: the key of its data in the page's JSON


@dataclass(frozen=True)
class Provenance:
    devices: tuple[str, ...]
    backends: tuple[str, ...]
    commits: tuple[str, ...]
    sources: tuple[str, ...]
    interpreter: bool
    busy: int = 0  # records timed on a busy machine
    above_roof: int = 0  # records whose figure passes a roof
    fallback: int = 0  # records of a slower path under the implementation's name

    @property
    def kind(self) -> str:
        if self.sources == ("modelled",):
            return "MODEL (not measured)"
        if "modelled" in self.sources:
            return "measured, and model traces marked [model] (dashed)"
        return "measured"

    def text(self) -> str:
        commits = ", ".join(self.commits[:3]) + (f" +{len(self.commits) - 3} more" if len(self.commits) > 3 else "")
        parts = [self.kind, f"device {' | '.join(self.devices)}", f"backend {', '.join(self.backends)}",
                 f"commit {commits or 'unknown'}"]
        if self.interpreter:
            parts.append("includes Triton interpreter timings (CPU emulation, not kernel speed)")
        if self.busy:
            parts.append(f"{self.busy} records timed on a busy machine (hover: BUSY): not to be trusted")
        if self.above_roof:
            parts.append(f"{self.above_roof} records above the roof (hover: ABOVE THE ROOF): no target or gain is "
                         "claimed from them")
        if self.fallback:
            parts.append(f"{self.fallback} records of a fallback path (hover: FALLBACK)")
        return " · ".join(parts)


def provenance(rows: Iterable[Row]) -> Provenance:
    rows = list(rows)
    backends: list[str] = []
    for row in rows:
        backends.append(row.backend)
        if row.comm_backend:
            backends.append(f"comm {row.comm_backend}")
    return Provenance(
        devices=tuple(dict.fromkeys(r.device for r in rows)),
        backends=tuple(dict.fromkeys(backends)),
        commits=tuple(dict.fromkeys(r.short_commit + ("+dirty" if r.dirty else "") for r in rows)),
        sources=tuple(sorted({r.source for r in rows})),
        interpreter=any(r.interpreter for r in rows),
        busy=sum(r.busy is not None for r in rows),
        above_roof=sum(r.above_roof is not None for r in rows),
        fallback=sum(r.fallback is not None for r in rows),
    )


class Colours:
    """One colour per implementation name, stable across the pages of one dashboard."""

    def __init__(self, impls: Iterable[str]) -> None:
        self._colour = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(sorted(set(impls)))}

    def __call__(self, impl: str) -> str:
        return self._colour.get(impl, "#444444")


SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "x", "star", "pentagon", "hexagon",
           "triangle-down")


def label_variants(keys: Iterable[SeriesKey]) -> dict[str, int]:
    """A marker symbol index per series label, so `dense (w=16)` and `dense (w=32)` differ by more than a legend."""
    return {label: i for i, label in enumerate(dict.fromkeys(k.label for k in keys))}


def trace_style(key: SeriesKey, colour: str, variant: int = 0) -> PlotlyJson:
    """Colour: the implementation; marker symbol: the other parameters (`variant`); line: the provenance.

    Measured: solid line, filled markers. Model: dashed line, open markers. Triton interpreter: dotted line.
    """
    dash = "dash" if key.source == "modelled" else "dot" if key.interpreter else "solid"
    symbol = SYMBOLS[variant % len(SYMBOLS)] + ("-open" if key.source == "modelled" else "")
    return {"line": {"color": colour, "dash": dash}, "marker": {"color": colour, "symbol": symbol, "size": 7}}


def figure_title(title: str, prov: Provenance) -> PlotlyJson:
    """A plotly title: the view's name (ours, or escaped) and the escaped provenance line below it."""
    prefix = "MODEL - " if prov.sources == ("modelled",) else ""
    return {"text": f"{plot_text(prefix + title)}<br><sup>{plot_text(prov.text())}</sup>", "x": 0.01,
            "xanchor": "left", "font": {"size": 15}}


def base_layout(title: str, prov: Provenance, *, height: int = 430) -> PlotlyJson:
    return {"title": figure_title(title, prov), "height": height, "margin": {"t": 80, "l": 70, "r": 20, "b": 60},
            "hovermode": "closest", "plot_bgcolor": "#ffffff", "paper_bgcolor": "#ffffff",
            "legend": {"font": {"size": 11}}, "font": {"family": "system-ui, sans-serif", "size": 12}}


def axis(title: str, *, log: bool = False, **extra: Any) -> PlotlyJson:
    out: PlotlyJson = {"title": {"text": title}, "gridcolor": "#e8e8e8", "zerolinecolor": "#cccccc",
                           "type": "log" if log else "linear"}
    out.update(extra)
    return out


# The x axis of each parameter the time and memory views may put there (data.X_KEYS): (axis title, what the
# figure title says it is drawn against).
X_TITLES = {"seq_len": ("sequence length N", "sequence length"),
            "documents": ("packed documents (count)", "number of documents"),
            "q_len": ("query rows q_len (keys: seq_len)", "query rows"),
            "prefix": ("prefix length", "prefix length"),
            "window": ("window w", "window"),
            "image_width": ("image width (tokens per row)", "image width"),
            "kv_heads": ("KV heads Hkv", "KV heads")}


class XAxis:
    """The x axis of the views over one parameter (data.x_key): one category for a single value (a log axis
    around one point picks a meaningless range); log for positive values spanning a factor of 4 or more (any
    two sequence lengths: those sweeps double); else linear (a prefix of 0, a few neighbouring counts)."""

    def __init__(self, key: str, values: Iterable[int], **extra: Any) -> None:
        distinct = set(values)
        self.key = key
        self.title, self.against = X_TITLES.get(key, (key, key))
        self.single = len(distinct) <= 1
        self.log = (not self.single and min(distinct) > 0
                    and (key == "seq_len" or max(distinct) >= 4 * min(distinct)))
        if self.single:
            self.layout = axis(self.title, type="category", **extra)
        else:
            self.layout = axis(self.title, log=self.log, **extra)

    @property
    def scale(self) -> str:
        """How the figure's title describes its axes (the y axes of the time and memory views are log)."""
        return "log-log" if self.log else "log y"

    def __call__(self, values: Sequence[int]) -> list[int] | list[str]:
        short = SHORT_NAMES.get(self.key, self.key)
        return [f"{short}={v}" for v in values] if self.single else list(values)


def hover(lines: Sequence[str]) -> str:
    """Hover text from lines that are already escaped (use `plot_text` on data first)."""
    return "<br>".join(lines)


def row_hover(row: Row, *extra: str) -> str:
    """The common hover lines of one record: implementation, case, provenance. Data escaped here."""
    lines = [f"<b>{plot_text(row.impl)}</b>", plot_text(row.case_id), *extra,
             plot_text(f"{row.source} on {row.device}"), plot_text(f"run {row.run_id}"),
             plot_text(f"commit {row.short_commit}{' (dirty tree)' if row.dirty else ''}")]
    if row.interpreter:
        lines.append(plot_text(INTERPRETER_NOTE))
    if row.busy is not None:
        lines.append(plot_text(f"BUSY: timed on a busy machine ({row.busy})"))
    if row.above_roof is not None:
        lines.append(plot_text(f"ABOVE THE ROOF: {row.above_roof}"))
    if row.fallback is not None:
        lines.append(plot_text(f"FALLBACK: {row.fallback}"))
    return hover(lines)
