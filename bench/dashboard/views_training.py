"""Training against dense ([R4 3/6]): each training case's loss curve with its attention beside the dense run's
from the same weights and batches, and the final delta (mean of the last ten steps)."""

from __future__ import annotations

from collections.abc import Sequence

from bench.dashboard.data import Row, sort_key
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import PALETTE, Figure, PlotlyJson, axis, base_layout, provenance
from bench.dashboard.views_quality import _amount, _line_name


def training_figure(rows: Sequence[Row]) -> Figure | None:
    trained = [r for r in rows if r.training is not None and r.training.curve]
    if not trained:
        return None
    trained.sort(key=lambda r: (sort_key(_line_name(r)), _amount(r)))
    traces: list[PlotlyJson] = []
    dense_drawn: set[tuple[int, str]] = set()
    for index, r in enumerate(trained):
        t = r.training
        assert t is not None and t.curve is not None
        colour = PALETTE[index % len(PALETTE)]
        name = f"{_line_name(r)} {_amount(r):g}"
        traces.append({"type": "scatter", "mode": "lines", "name": plot_text(f"{name} (delta {t.delta:+.3g})"),
                       "x": list(range(1, len(t.curve) + 1)), "y": t.curve, "line": {"color": colour},
                       "hovertext": plot_text(f"{name}: final loss {t.loss:.4g}, dense {t.loss_dense:.4g}, "
                                              f"{t.steps} steps at lr {t.lr:g}, {t.time_s or 0:.3g} s"),
                       "hoverinfo": "text"})
        key = (int(r.params["seq_len"]), str(r.params.get("pattern")) if r.selection else "causal")
        if t.curve_dense and key not in dense_drawn:
            dense_drawn.add(key)
            traces.append({"type": "scatter", "mode": "lines", "name": plot_text(f"dense (N={key[0]})"),
                           "x": list(range(1, len(t.curve_dense) + 1)), "y": t.curve_dense,
                           "line": {"color": "#000000", "dash": "dash"}, "hoverinfo": "name"})
    prov = provenance(trained)
    layout = base_layout("Training with each attention from the same weights and batches", prov, height=480)
    layout["xaxis"] = axis("step")
    layout["yaxis"] = axis("loss (the task's)", log=True)
    return Figure("training", "Training against dense: loss per step (dashed: dense attention)", prov.text(),
                  {"data": traces, "layout": layout})
