"""The dashboard's views, each from the synthetic runs of tests/dashboard_runs.py: time, speedup, memory,
communication, balance, break-even, correctness, history and provenance."""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import pytest

from bench.dashboard.data import (
    Row,
    rows_from_runs,
)
from bench.dashboard.figures import Colours, provenance
from bench.dashboard.views_breakeven import break_even, break_even_data, breakeven_figures
from bench.dashboard.views_comm import comm_figure, comm_series
from bench.dashboard.views_comm_balance import balance_figures
from bench.dashboard.views_correctness import correctness_figure, correctness_matrix
from bench.dashboard.views_history import history_figure, history_series
from bench.dashboard.views_memory import memory_data, memory_figure, peak_figure, peak_series
from bench.dashboard.views_time import speedup_data, speedup_figure, time_figure, time_series
from bench.results.store import load_run
from tests import dashboard_runs as store
from tests.dashboard_runs import facet_rows
from tests.synthetic import commit_id, record, write_run


def test_time_series_per_impl_and_window_with_ci_band(runs) -> None:
    series = time_series(facet_rows(runs["sweep"], "local"))
    names = {s.key.name() for s in series}
    assert "dense (w=16)" in names and "dense (w=32)" in names
    assert "triton_block_sparse (w=16) [Triton interpreter]" in names
    assert not any(s.key.impl == "flex" for s in series)  # skipped: no time
    dense = next(s for s in series if s.key.name() == "dense (w=16)")
    assert dense.seq_len == [128, 256, 512]
    assert dense.median_s == pytest.approx([store.T_DENSE[n] for n in (128, 256, 512)])
    xs, lo, hi = dense.band()
    assert xs == [128, 256, 512] and all(a < m < b for a, m, b in zip(lo, dense.median_s, hi, strict=True))
    naive = next(s for s in series if s.key.name() == "naive_loop (w=16)")
    assert naive.seq_len == [128, 256]  # out of memory at 512


def test_time_figure_draws_band_and_labels_interpreter(runs) -> None:
    fig = time_figure(facet_rows(runs["sweep"], "local"), Colours(["dense"]))
    go.Figure(fig.plotly)
    layout = fig.plotly["layout"]
    assert layout["xaxis"]["type"] == "log" and layout["yaxis"]["type"] == "log"
    bands = [t for t in fig.plotly["data"] if t.get("fill") == "toself"]
    assert len(bands) == len([t for t in fig.plotly["data"] if t.get("mode") == "lines+markers"])
    triton = [t for t in fig.plotly["data"] if "interpreter" in t["name"] and t.get("mode") == "lines+markers"]
    assert triton and triton[0]["line"]["dash"] == "dot"
    assert "Triton interpreter" in fig.provenance and "measured" in fig.provenance


def test_speedup_over_dense_by_window_and_density(runs) -> None:
    local = speedup_data(facet_rows(runs["sweep"], "local"))
    assert local.baseline == "dense" and local.y_key == "window"
    sdpa = next(p for p in local.panels if p.key.impl == "sdpa")
    assert {(c.seq_len, c.y) for c in sdpa.cells} == {(n, w) for n in store.T_DENSE for w in store.WINDOWS}
    assert all(c.speedup == pytest.approx(2.0) for c in sdpa.cells)
    blocks = speedup_data(facet_rows(runs["sweep"], "block_random"))
    assert blocks.y_key == "density"
    csr = next(p for p in blocks.panels if p.key.impl == "csr")
    for c in csr.cells:
        assert c.speedup == pytest.approx(1 / (0.2 + 1.6 * c.y))
    fig = speedup_figure(facet_rows(runs["sweep"], "block_random"))
    go.Figure(fig.plotly)
    heat = next(t for t in fig.plotly["data"] if t["name"] == "csr")
    assert heat["y"] == [str(d) for d in store.DENSITIES] and heat["x"] == ["N=128", "N=256", "N=512"]


@pytest.mark.parametrize(("pattern", "axis"), [("local", "window"), ("block_random", "density"),
                                               ("bigbird", "density"), ("causal", None)])
def test_speedup_axis_is_the_pattern_field_when_nothing_varies(pattern: str, axis: str | None, tmp_path: Path) -> None:
    """One case per pattern (as the smoke suite has): the axis is the field the pattern reads, from its label."""
    from bench.dashboard.views_time import speedup_y_key
    from bench.spec.case import Case

    case = Case(pattern=pattern, seq_len=128, window=16, density=0.25, block_size=32, global_tokens=2)
    row = rows_from_runs([load_run(write_run(tmp_path, commit=commit_id(1), records=[
        record(case.case_id, "dense", store.samples(1e-3), params=case.params())]))])[0]
    assert speedup_y_key([row]) == axis


def test_speedup_falls_back_to_sdpa_and_says_so(runs) -> None:
    rows = [r for r in facet_rows(runs["sweep"], "local") if r.impl != "dense"]
    data = speedup_data(rows)
    assert data.baseline == "sdpa"
    assert speedup_figure(rows).notes == ["no dense records here: speedups are over sdpa"]


def test_memory_series_and_unmeasured_marks(runs) -> None:
    data = memory_data(facet_rows(runs["sweep"], "local"))
    csr = next(s for s in data.series if s.key.name() == "csr (w=32)")
    assert csr.seq_len == [128, 256, 512] and csr.peak_bytes == [n * 32 * 64 for n in (128, 256, 512)]
    kinds = {(m.kind, m.row.impl, m.row.params["seq_len"]) for m in data.marks}
    assert ("out of memory", "naive_loop", 512) in kinds
    assert ("skipped", "flex", 128) in kinds
    fig = memory_figure(facet_rows(runs["sweep"], "local"), Colours([]))
    go.Figure(fig.plotly)
    oom = next(t for t in fig.plotly["data"] if t["name"].startswith("out of memory"))
    assert oom["yaxis"] == "y2" and "tried to allocate 2.0 GiB" in oom["hovertext"][0]


def test_peak_fraction_of_a_model_is_labelled_model(runs) -> None:
    rows = facet_rows(runs["model"], "local", device=store.H100)
    series = peak_series(rows)
    assert {k.name() for k in series} == {"dense [model]", "csr [model]"}
    fig = peak_figure(rows, Colours([]))
    go.Figure(fig.plotly)
    dense = next(t for t in fig.plotly["data"] if t["name"] == "dense [model]")
    assert dense["y"] == pytest.approx([40.0] * 3) and dense["x"] == list(store.T_DENSE)
    assert fig.plotly["layout"]["title"]["text"].startswith("MODEL - ")
    assert fig.provenance.startswith("MODEL (not measured)") and store.H100 in fig.provenance
    assert all(t["line"]["dash"] == "dash" for t in fig.plotly["data"])
    time = time_figure(rows, Colours([]))
    assert all("[model]" in t["name"] for t in time.plotly["data"])


def test_mixed_measured_and_modelled_traces_stay_apart(runs) -> None:
    rows = rows_from_runs([runs["model"]])
    measured = [Row(**{**r.__dict__, "source": "measured"}) for r in rows if r.impl == "dense"]
    series = time_series(rows + measured)
    assert {s.key.source for s in series if s.key.impl == "dense"} == {"measured", "modelled"}
    assert provenance(rows + measured).kind.startswith("measured, and model traces")


def test_comm_points_over_closed_form(runs) -> None:
    rows = facet_rows(runs["comm"], "local")
    series = {s.key.impl: s for s in comm_series(rows)}
    ring = series["cp_ring"]
    assert ring.world_size == [2, 4]
    expected = [(p - 1) * 2 * 256 * 4 * 32 * 4 for p in (2, 4)]
    assert ring.expected_bytes == expected and ring.bytes_total == [expected[0], expected[1] + 4096]
    assert [r.params["world_size"] for r in ring.mismatches] == [4]
    assert series["tp_heads"].mismatches == []
    fig = comm_figure(rows, Colours([]))
    go.Figure(fig.plotly)
    lines = [t for t in fig.plotly["data"] if t["name"].endswith("closed form")]
    assert {t["name"] for t in lines} == {"cp_ring closed form", "tp_heads closed form"}
    assert fig.notes == ["cp_ring: 1 record(s) differ from the closed form"]
    assert "comm gloo" in fig.provenance


def test_balance_and_overlap_per_world_size(runs) -> None:
    rows = facet_rows(runs["comm"], "local")
    figures = {f.view: f for f in balance_figures(rows, Colours([]))}
    assert set(figures) == {"imbalance", "overlap"}
    for fig in figures.values():
        go.Figure(fig.plotly)
    imbalance = {t["name"]: t for t in figures["imbalance"].plotly["data"]}
    assert imbalance["cp_ring"]["x"] == [2, 4] and imbalance["cp_ring"]["y"] == pytest.approx([4 / 3, 8 / 5])
    assert imbalance["tp_heads"]["y"] == [1.0, 1.0]
    assert "rank 3: 4e+06 FLOPs, comm 1 ms (hidden 0.4)" in imbalance["cp_ring"]["hovertext"][1]
    overlap = {t["name"]: t["y"] for t in figures["overlap"].plotly["data"]}
    assert overlap == {"cp_ring": [0.4, 0.4], "tp_heads": [0.0, 0.0]}
    ring = next(r for r in rows if r.impl == "cp_ring" and r.params["world_size"] == 2)
    assert ring.comm_by_level == {"ring": (2 * 256 * 4 * 32 * 4, 2 * 256 * 4 * 32 * 4)}
    hover = next(t for t in comm_figure(rows, Colours([])).plotly["data"] if t["name"] == "cp_ring measured")
    assert "level ring" in hover["hovertext"][0] and "= closed form" in hover["hovertext"][0]
    busiest = next(t for t in comm_figure(rows, Colours([])).plotly["data"] if t["name"] == "cp_ring busiest rank")
    assert busiest["y"] == [r.comm_bytes_max_rank for r in sorted(
        (r for r in rows if r.impl == "cp_ring"), key=lambda r: r.params["world_size"])]
    assert busiest["marker"]["symbol"].endswith("-open")


@pytest.mark.parametrize(("points", "expected"), [
    ([(0.1, 0.5), (0.3, 0.9), (0.6, 1.5)], (0.35, "exact")),  # crosses between 0.3 and 0.6
    ([(0.1, 0.5), (0.9, 0.8)], (0.9, "above")),  # faster everywhere: a lower bound
    ([(0.1, 1.2), (0.9, 3.0)], (0.1, "below")),  # slower everywhere: an upper bound
    ([(0.2, 1.0), (0.5, 2.0)], (0.2, "exact")),
    ([(0.6, 1.5), (0.1, 0.5), (0.3, 1.1), (0.45, 0.9)], (0.1 + 0.5 * 0.2 / 0.6, "exact")),  # first crossing
])
def test_break_even_interpolation(points, expected) -> None:
    density, bound = break_even(points)
    assert bound == expected[1] and density == pytest.approx(expected[0])


def test_break_even_of_csr_against_dense_and_sdpa(runs) -> None:
    items = break_even_data(facet_rows(runs["sweep"], "block_random"))
    assert {(i.key.impl, i.baseline) for i in items} == {("csr", "dense"), ("csr", "sdpa")}
    for item in items:
        assert item.bound == "exact" and [p.density for p in item.points] == list(store.DENSITIES)
        assert item.density == pytest.approx(0.5 if item.baseline == "dense" else 0.1875)
    assert sorted({i.seq_len for i in items}) == [128, 256, 512]
    figures = breakeven_figures(facet_rows(runs["sweep"], "block_random"), Colours([]))
    assert [f.view for f in figures] == ["breakeven", "breakeven_ratio"]
    for f in figures:
        go.Figure(f.plotly)
        assert any(n.startswith("how: linear interpolation") for n in f.notes)
    summary = figures[0].plotly["data"]
    assert {t["name"] for t in summary} == {"csr vs dense", "csr vs sdpa"}
    assert next(t for t in summary if t["name"] == "csr vs dense")["y"] == pytest.approx([0.5] * 3)
    assert break_even_data(facet_rows(runs["sweep"], "local")) == []  # no density sweep there


def test_correctness_matrix_cells_and_hover(runs) -> None:
    rows = facet_rows(runs["sweep"], "local")
    matrix = correctness_matrix(rows)
    assert "triton_block_sparse [Triton interpreter]" in matrix.impls
    labels = dict(matrix.cases)
    assert len(labels) == len(store.T_DENSE) * len(store.WINDOWS) and labels[rows[0].case_id] == "N=128, w=16"
    naive_512 = next(c for c, label in matrix.cases if label == "N=512, w=16")
    assert matrix.status("naive_loop", naive_512) == "failed"
    assert matrix.status("flex", naive_512) == "skipped" and matrix.status("dense", naive_512) == "ok"
    fig = correctness_figure(rows)
    go.Figure(fig.plotly)
    heat = fig.plotly["data"][0]
    row = heat["y"].index("naive_loop")
    assert heat["z"][row][heat["x"].index("N=512, w=16")] == 3
    assert "out of memory during call" in heat["hovertext"][row][heat["x"].index("N=512, w=16")]
    bad = correctness_figure(facet_rows(runs["sweep"], "local", dtype="float16"))
    assert "rel. L2 error 5.00e-01 (tolerance 1e-04)" in bad.plotly["data"][0]["hovertext"][0][0]


def test_history_finds_the_step_with_its_commit_range(runs) -> None:
    nightly = [runs[f"history{i}"] for i in range(4)]
    rows = rows_from_runs(nightly)
    items, commits = history_series(nightly, rows, "nightly")
    assert commits == [commit_id(i) for i in range(4)]
    dense = [it for it in items if it.series.impl == "dense"]
    assert len(dense) == 3 and all(len(it.series.points) == 4 for it in dense)
    for it in dense:
        (step,) = it.series.steps
        assert (step.commit_before, step.commit_after, step.direction) == (commit_id(1), commit_id(2), "slower")
        assert step.ratio == pytest.approx(2.0, rel=0.01)
    assert all(not it.series.steps for it in items if it.series.impl == "sdpa")
    fig = history_figure(items, commits, Colours([]))
    go.Figure(fig.plotly)
    steps = [t for t in fig.plotly["data"] if t["name"].endswith(" steps")]
    assert len(steps) == 3 and all(t["x"] == [commit_id(2)[:8]] for t in steps)
    assert fig.plotly["layout"]["xaxis"]["categoryarray"] == [commit_id(i)[:8] for i in range(4)]
    assert "between commits" in steps[0]["hovertext"][0]
    one_commit = history_series([runs["sweep"]], rows_from_runs([runs["sweep"]]), "sweep")
    assert history_figure(one_commit[0], one_commit[1], Colours([])) is None


def test_models_never_enter_history(runs) -> None:
    items, commits = history_series([runs["model"]], rows_from_runs([runs["model"]]), "h100")
    assert items == [] and commits == []


def test_provenance_names_device_backend_commit_and_kind(runs) -> None:
    text = provenance(rows_from_runs([runs["comm"]])).text()
    assert text == f"measured · device {store.CPU} · backend cpu, comm gloo · commit {commit_id(3)[:7]}"
    model = provenance(rows_from_runs([runs["model"]])).text()
    assert model == f"MODEL (not measured) · device {store.H100} · backend model · commit {commit_id(3)[:7]}"


def test_harness_cost_stacks_each_records_phases_longest_first(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One bar per record, one trace per phase in the pair's order, the bars' stacks equal to phases_s; records
    without phases (written before them) are left out; past MAX_BARS only the longest walls stay, with a note."""
    from bench.dashboard import views_harness
    from bench.spec.case import Case

    records = []
    for i, n in enumerate([128, 256, 512]):
        case = Case(pattern="causal", seq_len=n, selector="moba", budget=0.25, block_size=32)
        phases = {"pattern": 0.1 * (i + 1), "selection": 0.2, "first call": 0.3, "check": 0.05 * (i + 1),
                  "fidelity": 0.4, "timing": 2.0 + i, "memory": 0.5}
        records.append(record(case.case_id, "blocked", store.samples(1e-3), params=case.params(),
                              wall_s=sum(phases.values()), phases_s=phases))
    old = Case(pattern="causal", seq_len=1024)
    records.append(record(old.case_id, "dense", store.samples(1e-3), params=old.params(), wall_s=9.0))
    rows = rows_from_runs([load_run(write_run(tmp_path, commit=commit_id(1), records=records))])
    fig = views_harness.harness_figure(rows)
    assert fig is not None and fig.notes == []
    go.Figure(fig.plotly)
    traces = fig.plotly["data"]
    assert [t["name"] for t in traces] == ["pattern", "selection", "first call", "check", "fidelity", "timing",
                                           "memory"]
    assert all(len(t["x"]) == 3 for t in traces)  # the record without phases is not drawn
    stacks = [sum(t["x"][i] for t in traces) for i in range(3)]
    walls = sorted((r.wall_s for r in rows if r.phases_s), key=float)
    assert sorted(stacks) == pytest.approx(walls)
    assert views_harness.harness_share(next(r for r in rows if r.phases_s)) == pytest.approx(
        1 - 2.0 / (2.0 + 0.1 + 0.2 + 0.3 + 0.05 + 0.4 + 0.5))
    monkeypatch.setattr(views_harness, "MAX_BARS", 2)
    fewer = views_harness.harness_figure(rows)
    assert fewer is not None and fewer.notes == ["the 2 longest of 3 records; 1 shorter ones left out"]
    assert max(fewer.plotly["data"][-2]["x"]) == 4.0  # the longest timing (N=512) kept
