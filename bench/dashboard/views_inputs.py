"""The inputs view: what each case's inputs make of dense attention (records with `attention_stats`), cases side
by side, so that random inputs (flat rows) and structured or captured ones (concentrated rows) can be told apart.

Bars: the mean share of a row's mass in its top 1/5/10% of keys, top 5% of key blocks and first 4 keys, one bar
group per statistic, one bar per case; whiskers from p5 to p95 over rows; the entropy on hover.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.dashboard.data import Row, param_order, params_label, varying_keys
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import PALETTE, Figure, axis, base_layout, provenance

SHARES = (("top1_mass", "top 1% keys"), ("top5_mass", "top 5% keys"), ("top10_mass", "top 10% keys"),
          ("block_top5_mass", "top 5% blocks"), ("sink_mass", "first 4 keys"))


def _cases(rows: Sequence[Row]) -> list[Row]:
    """One row per case that carries statistics (they are the case's, whichever implementation's record)."""
    first: dict[str, Row] = {}
    for row in rows:
        if row.attention_stats is not None:
            first.setdefault(row.case_id, row)
    keys = [k for k in varying_keys(list(first.values())) if k != "env"]
    return sorted(first.values(), key=lambda r: [param_order(r, k) for k in ["inputs", *keys]])


def inputs_figure(rows: Sequence[Row]) -> Figure | None:
    cases = _cases(rows)
    if not cases:
        return None
    keys = [k for k in varying_keys(cases) if k != "env"]
    traces = []
    for index, row in enumerate(cases):
        assert row.attention_stats is not None
        stats = row.attention_stats.model_dump()
        name = params_label(row, keys) or row.case_id
        means = [stats[key]["mean"] for key, _ in SHARES]
        entropy = stats["entropy"]
        hover = [plot_text(f"{name}: {label} {stats[key]['mean']:.3f} (p5 {stats[key]['p5']:.3f}, p95 "
                           f"{stats[key]['p95']:.3f}); entropy {entropy['mean']:.2f} nats; {stats['rows']} rows")
                 for key, label in SHARES]
        traces.append({"type": "bar", "name": plot_text(name), "x": [label for _, label in SHARES], "y": means,
                       "marker": {"color": PALETTE[index % len(PALETTE)]}, "hovertext": hover, "hoverinfo": "text",
                       "error_y": {"type": "data", "symmetric": False,
                                   "array": [stats[key]["p95"] - stats[key]["mean"] for key, _ in SHARES],
                                   "arrayminus": [stats[key]["mean"] - stats[key]["p5"] for key, _ in SHARES]}})
    prov = provenance(cases)
    layout = base_layout("Inputs: where dense attention's mass goes", prov)
    layout["barmode"] = "group"
    layout["xaxis"] = axis("share of a row's attention mass held by", type="category")
    layout["yaxis"] = axis("mean over rows (whiskers p5..p95)", range=[0, 1.05])
    return Figure("inputs", "Inputs: the share of each row's attention mass in its top keys, per case (flat random "
                  "rows against structured or captured ones)", prov.text(), {"data": traces, "layout": layout})
