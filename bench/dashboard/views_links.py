"""Inter-node bytes against world size: for each implementation and placement (nodes x ranks per node), the bytes
its ranks sent between nodes, counted, over the closed form's split; what decides a CP scheme on a cluster, where
the links between nodes are several times slower than those inside one."""

from __future__ import annotations

from collections.abc import Sequence

from bench.console.format import format_bytes
from bench.dashboard.data import Row, series_of
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import Colours, Figure, axis, base_layout, provenance, row_hover


def placement(row: Row) -> str:
    nodes = row.comm_ranks_per_node
    if len(set(nodes)) == 1:
        return f"{len(nodes)} node{'s' if len(nodes) > 1 else ''} x {nodes[0]}"
    return f"{len(nodes)} nodes of {'/'.join(map(str, nodes))}"


def links_figure(rows: Sequence[Row], colours: Colours) -> Figure | None:
    placed = [r for r in rows if r.comm_by_link is not None and r.comm_ranks_per_node]
    if not any(len(r.comm_ranks_per_node) > 1 for r in placed):
        return None  # one node everywhere: nothing crosses a node
    traces = []
    for key, members in series_of(placed, ["world_size"]).items():
        by_placement: dict[str, list[Row]] = {}
        for r in members:
            by_placement.setdefault(placement(r), []).append(r)
        for where, group in sorted(by_placement.items()):
            group.sort(key=lambda r: int(r.params.get("world_size") or 1))
            name = plot_text(f"{key.name()} ({where})")
            xs = [int(r.params.get("world_size") or 1) for r in group]
            inter = [r.comm_by_link[1] for r in group if r.comm_by_link is not None]
            texts = [row_hover(r, f"{r.comm_by_link[1]:,} bytes between nodes, {r.comm_by_link[0]:,} inside nodes",
                               _check(r), f"{plot_text(where)} ({len(r.comm_ranks_per_node)} nodes)")
                     for r in group if r.comm_by_link is not None]
            traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "legendgroup": name, "x": xs,
                           "y": inter, "hovertext": texts, "hoverinfo": "text",
                           "marker": {"color": colours(key.impl), "size": 8 + 2 * len(group[0].comm_ranks_per_node)}})
            expected = [(x, r.comm_expected_by_link[1]) for x, r in zip(xs, group, strict=True)
                        if r.comm_expected_by_link is not None]
            if expected:
                traces.append({"type": "scatter", "mode": "lines", "name": f"{name} closed form", "legendgroup": name,
                               "x": [x for x, _ in expected], "y": [e for _, e in expected], "hoverinfo": "skip",
                               "line": {"color": colours(key.impl), "dash": "dot", "width": 1.5}})
    prov = provenance(placed)
    layout = base_layout("Bytes between nodes against world size", prov)
    layout["xaxis"] = axis("world size P (ranks)", log=True, dtick=0.30102999566)
    layout["yaxis"] = axis("bytes sent between nodes per call (all ranks)", exponentformat="SI")
    mismatched = [r for r in placed if r.comm_expected_by_link is not None and r.comm_expected_by_link !=
                  r.comm_by_link]
    notes = [f"{len(mismatched)} record(s) differ from the closed form's split"] if mismatched else []
    return Figure("links", "Bytes between nodes against world size, per implementation and placement (nodes x ranks "
                  "per node; counted by bench.comm per peer; dotted: the closed form)", prov.text(),
                  {"data": traces, "layout": layout}, notes=notes)


def _check(r: Row) -> str:
    if r.comm_expected_by_link is None:
        return "no closed form"
    if r.comm_expected_by_link == r.comm_by_link:
        return "= closed form"
    return f"closed form: {format_bytes(r.comm_expected_by_link[1])} between nodes"
