"""The correctness matrix: implementation x case, coloured by status, the error against the fp64 oracle (or the
reason of a skip or failure) on hover."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.dashboard.data import Row, SeriesKey, param_order, params_label, sort_key, varying_keys
from bench.dashboard.escaping import plot_text
from bench.dashboard.figures import Figure, axis, base_layout, provenance, row_hover

STATUS_CODE = {"ok": 0, "skipped": 1, "incorrect": 2, "failed": 3}
STATUS_COLOUR = {"ok": "#2ca02c", "skipped": "#c7c7c7", "incorrect": "#ff7f0e", "failed": "#d62728"}


@dataclass(frozen=True)
class CorrectnessMatrix:
    impls: tuple[str, ...]  # y: implementation names with their provenance tags ([model], [Triton interpreter])
    cases: tuple[tuple[str, str], ...]  # x: (case_id, short label), by parameters
    cells: dict[tuple[str, str], Row]  # (impl name, case_id) -> record

    def status(self, impl: str, case_id: str) -> str | None:
        row = self.cells.get((impl, case_id))
        return row.status if row else None


def impl_name(row: Row) -> str:
    return SeriesKey(row.impl, row.source, row.interpreter, "").name()


def case_labels(rows: Sequence[Row]) -> list[tuple[str, str]]:
    """(case_id, label naming the parameters that vary) in parameter order; the case id where labels collide."""
    keys = [k for k in varying_keys(rows) if k != "env"]
    first: dict[str, Row] = {}
    for r in rows:
        first.setdefault(r.case_id, r)
    ordered = sorted(first.values(), key=lambda r: [param_order(r, k) for k in ["seq_len", *keys]])
    labels = [params_label(r, keys) or r.case_id for r in ordered]
    if len(set(labels)) < len(labels):
        labels = [r.case_id for r in ordered]
    return [(r.case_id, label) for r, label in zip(ordered, labels, strict=True)]


def correctness_matrix(rows: Sequence[Row]) -> CorrectnessMatrix | None:
    if not rows:
        return None
    impls = sorted(dict.fromkeys(impl_name(r) for r in rows), key=sort_key)
    return CorrectnessMatrix(tuple(impls), tuple(case_labels(rows)), {(impl_name(r), r.case_id): r for r in rows})


def _ratios(row: Row) -> str:
    """Each tensor's error over the same-dtype reference's (bench.measure.oracle.numerics), e.g. `out 0.9x, dq 1.1x`."""
    e = row.error
    if e is None or e.ratio is None:
        return ""
    parts = [f"out {e.ratio:.2g}x"] + ([f"lse {e.lse_ratio:.2g}x"] if e.lse_ratio is not None else [])
    parts += [f"{name} {g.ratio:.2g}x" for name, g in (e.grads or {}).items() if g.ratio is not None]
    flag = " <b>worse than the same-dtype reference</b>" if e.numerics == "worse_than_reference" else ""
    return f"<br>error / same-dtype reference's: {', '.join(parts)}{flag}"


def _status_line(row: Row) -> str:
    if row.status in ("ok", "incorrect") and row.tolerance is not None:
        rel = "NaN/inf" if row.rel_l2 is None else f"{row.rel_l2:.2e}"
        line = (f"<b>{row.status}</b>: rel. L2 error {rel} (tolerance {row.tolerance:.0e}), max abs "
                f"{'-' if row.max_abs is None else f'{row.max_abs:.2e}'}, {row.rows_checked} rows checked"
                f"{_ratios(row)}")
    else:
        line = f"<b>{plot_text(row.status)}</b>"
    if row.reason:
        line += f"<br>{plot_text(row.reason)}"
    return line


def correctness_figure(rows: Sequence[Row]) -> Figure | None:
    matrix = correctness_matrix(rows)
    if matrix is None:
        return None
    x = [plot_text(label) for _, label in matrix.cases]
    y = [plot_text(name) for name in matrix.impls]
    z: list[list[int | None]] = []
    texts: list[list[str]] = []
    ratios: list[list[str]] = []  # in each cell: the output's ratio to the same-dtype reference ("!": above 2)
    for impl in matrix.impls:
        z_row, t_row, r_row = [], [], []
        for case_id, _ in matrix.cases:
            row = matrix.cells.get((impl, case_id))
            z_row.append(STATUS_CODE.get(row.status) if row else None)
            t_row.append(row_hover(row, _status_line(row)) if row else f"{plot_text(impl)}: not run on this case")
            worse = row is not None and row.error is not None and row.error.numerics == "worse_than_reference"
            r_row.append(f"{row.error.ratio:.2g}x" if row and row.error and row.error.ratio is not None else "")
            if worse:
                r_row[-1] += " !"
        z.append(z_row)
        texts.append(t_row)
        ratios.append(r_row)
    n = len(STATUS_CODE) - 1
    scale = []  # one flat colour band per status code
    for status, code in STATUS_CODE.items():
        scale += [[max(code - 0.5, 0) / n, STATUS_COLOUR[status]], [min(code + 0.5, n) / n, STATUS_COLOUR[status]]]
    traces: list[dict] = [{"type": "heatmap", "x": x, "y": y, "z": z, "zmin": 0, "zmax": n, "colorscale": scale,
                           "showscale": False, "xgap": 2, "ygap": 2, "hovertext": texts, "hoverinfo": "text",
                           "text": ratios, "texttemplate": "%{text}", "textfont": {"size": 10},
                           "name": "status"}]
    for status, colour in STATUS_COLOUR.items():  # legend entries only
        traces.append({"type": "scatter", "mode": "markers", "name": status, "x": [None], "y": [None],
                       "marker": {"symbol": "square", "size": 12, "color": colour}, "hoverinfo": "skip"})
    prov = provenance(rows)
    counts = {s: sum(r.status == s for r in rows) for s in STATUS_CODE}
    # rotated case labels need their room below the plot: the height grows with the longest, automargin keeps it
    longest = max((len(label) for label in x), default=0)
    layout = base_layout("Correctness against the float64 oracle", prov,
                         height=max(260, 150 + 30 * len(y) + int(4.5 * min(longest, 80))))
    layout["legend"] = {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.02, "yanchor": "bottom"}
    layout["xaxis"] = axis("case", type="category", tickangle=-35, automargin=True)
    layout["yaxis"] = axis("", type="category", automargin=True, autorange="reversed")
    summary = ", ".join(f"{c} {s}" for s, c in counts.items() if c)
    return Figure("correctness", f"Correctness: implementation x case ({summary}); in each cell the output's error "
                  "over a same-dtype reference's (! above 2); errors, gradients or the reason on hover",
                  prov.text(), {"data": traces, "layout": layout})
