"""Per-rank balance and overlap of distributed records against world size.

Imbalance: max / mean of the ranks' useful FLOPs (record comm.imbalance; 1 is balanced: a causal mask split in
contiguous chunks gives the last rank most of the work, zigzag evens it). Overlap: the measured fraction of
communication time hidden behind compute (comm.overlap_fraction; 0 for blocking collectives). The hover of each
point lists every rank's FLOPs, communication time and hidden time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bench.dashboard.data import Row, series_of
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
from bench.dashboard.views_comm import world_size


def _ranks_text(row: Row) -> str:
    parts = []
    for r in row.comm_per_rank:
        flops, comm_s, hidden_s = r.flops, r.comm_s, r.hidden_s
        times = "" if comm_s is None else f", comm {comm_s * 1e3:.3g} ms (hidden {(hidden_s or 0) * 1e3:.3g})"
        parts.append(f"rank {r.rank}: {'?' if flops is None else f'{flops:.3g}'} FLOPs{times}")
    return "<br>".join(parts)


def _figure(rows: Sequence[Row], colours: Colours, view: str, value: Callable[[Row], float | None], title: str,
            y_title: str, caption: str) -> Figure | None:
    kept = [r for r in rows if r.status == "ok" and value(r) is not None]
    if not kept:
        return None
    groups = series_of(kept, ["world_size"])
    variants = label_variants(groups)
    traces = []
    for key, members in groups.items():
        members = sorted(members, key=world_size)
        name = plot_text(key.name())
        style = trace_style(key, colours(key.impl), variants[key.label])
        texts = [row_hover(r, f"imbalance {r.comm_imbalance:.3f}" if r.comm_imbalance is not None else "imbalance ?",
                           f"overlap {r.comm_overlap:.2f}" if r.comm_overlap is not None else "overlap: no comm time",
                           _ranks_text(r)) for r in members]
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": [world_size(r) for r in members],
                       "y": [value(r) for r in members], "hovertext": texts, "hoverinfo": "text", **style})
    prov = provenance(kept)
    layout = base_layout(title, prov)
    layout["xaxis"] = axis("world size P (ranks)", log=True, dtick=0.30102999566)
    layout["yaxis"] = axis(y_title, rangemode="tozero")
    return Figure(view, caption, prov.text(), {"data": traces, "layout": layout})


def balance_figures(rows: Sequence[Row], colours: Colours) -> list[Figure]:
    """The imbalance figure and the overlap figure, each where some record has the figure."""
    figures = [
        _figure(rows, colours, "imbalance", lambda r: r.comm_imbalance, "Per-rank imbalance against world size",
                "imbalance: max / mean useful FLOPs per rank",
                "Per-rank imbalance of useful work (max / mean of the ranks' FLOPs; 1 is balanced)"),
        _figure(rows, colours, "overlap", lambda r: r.comm_overlap, "Communication overlap against world size",
                "overlap fraction (hidden / communication time)",
                "Measured overlap: the fraction of each record's communication time hidden behind compute (blocking "
                "collectives hide none)"),
    ]
    return [f for f in figures if f is not None]
