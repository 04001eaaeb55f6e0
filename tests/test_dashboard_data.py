"""The data each dashboard figure is built from, checked against synthetic runs with known laws
(tests/dashboard_runs.py), plus escaping, page assembly and the `bench dashboard` command line."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import plotly.graph_objects as go
import pytest

from bench.cli import main
from bench.dashboard.data import (
    current_rows,
    facets,
    format_documents,
    params_label,
    rows_from_runs,
    varying_keys,
    workload,
    x_key,
)
from bench.dashboard.escaping import plot_text, round_floats, script_json
from bench.dashboard.figures import Colours
from bench.dashboard.render import build_dashboard
from bench.dashboard.suite_page import build_suite_page, suite_file_name
from bench.dashboard.views_correctness import correctness_matrix
from bench.dashboard.views_history import history_series
from bench.dashboard.views_memory import memory_data, memory_figure
from bench.dashboard.views_time import speedup_data, speedup_figure, time_figure, time_series
from bench.results.index import load_index
from bench.results.store import load_run
from tests import dashboard_runs as store
from tests.conftest import run_bench
from tests.dashboard_runs import facet_rows
from tests.synthetic import commit_id, params, record, write_run

HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(1)>"


def by(items, **want):
    return [x for x in items if all(getattr(x, k) == v for k, v in want.items())]


# --- rows --------------------------------------------------------------------------------------------------


def test_rows_carry_provenance_and_no_samples(runs) -> None:
    rows = rows_from_runs([runs["sweep"], runs["model"]])
    assert len(rows) == len(runs["sweep"].records) + len(runs["model"].records)
    model = [r for r in rows if r.suite == "h100"]
    assert {r.source for r in model} == {"modelled"} and {r.device for r in model} == {store.H100}
    assert {r.source for r in rows if r.suite == "sweep"} == {"measured"}
    triton = [r for r in rows if r.impl == "triton_block_sparse"]
    assert triton and all(r.interpreter for r in triton)
    assert all(r.commit == commit_id(3) and r.fingerprint for r in rows)
    assert not hasattr(rows[0], "samples_s")  # rows keep the median and its interval, never raw samples
    dense = next(r for r in rows if r.impl == "dense" and r.params["seq_len"] == 256)
    assert dense.median_s == pytest.approx(store.T_DENSE[256])
    assert dense.ci95_s is not None and dense.ci95_s[0] < dense.median_s < dense.ci95_s[1]


def test_current_rows_keep_the_latest_run(tmp_path: Path) -> None:
    p = params("local", 128)
    old = write_run(tmp_path, commit=commit_id(1), records=[record("c1", "dense", store.samples(1.0), params=p)],
                    started_at="2026-01-01T00:00:00.000000Z")
    new = write_run(tmp_path, commit=commit_id(2), records=[record("c1", "dense", store.samples(2.0), params=p)],
                    started_at="2026-01-02T00:00:00.000000Z")
    rows = current_rows(rows_from_runs([load_run(new), load_run(old)]))
    assert len(rows) == 1 and rows[0].median_s == pytest.approx(2.0) and rows[0].commit == commit_id(2)


def test_facets_and_varying_keys(runs) -> None:
    groups = facets(current_rows(rows_from_runs([runs["sweep"]])))
    assert set(groups) == {("local", "float32", "fwd", store.CPU, "MHA H2"),
                           ("block_random", "float32", "fwd", store.CPU, "MHA H2"),
                           ("local", "float16", "fwd", store.CPU, "MHA H2")}
    local = groups[("local", "float32", "fwd", store.CPU, "MHA H2")]
    assert varying_keys(local) == ["seq_len", "window"]
    assert varying_keys(local, exclude=["seq_len"]) == ["window"]


# --- workloads: GQA, decode, packed documents ---------------------------------------------------------------

DOCS = ("causal", "bfloat16", "fwd", store.CPU, "MHA H8")  # the documents sweep: one length, 1 to 64 documents


@pytest.mark.parametrize(("given", "expected"), [
    ({"heads": 8}, "MHA H8"),  # a record from before kv_heads and q_len existed
    ({"heads": 8, "kv_heads": None, "q_len": None, "seq_len": 4096}, "MHA H8"),
    ({"heads": 8, "kv_heads": 8, "q_len": 4096, "seq_len": 4096}, "MHA H8"),  # the defaults written out
    ({"heads": 32, "kv_heads": 8, "seq_len": 4096}, "GQA H32/8"),
    ({"heads": 8, "kv_heads": 1}, "MQA H8/1"),
    ({"heads": 32, "kv_heads": 8, "q_len": 16, "seq_len": 4096}, "GQA H32/8 · q_len 16"),
    ({"heads": 8, "q_len": 1, "seq_len": 4096}, "MHA H8 · q_len 1"),
    ({"heads": 4, "kv_heads": 3}, "GQA H4/3"),
    ({}, "H?"),
    ({"heads": "many", "kv_heads": 9}, "Hmany"),
    ({"heads": 4, "kv_heads": 8}, "H4/8"),  # not a grouping: shown as given
])
def test_workload_names_shape_and_query_rows(given: dict, expected: str) -> None:
    assert workload(given) == expected


def test_facets_split_by_workload(runs) -> None:
    groups = facets(current_rows(rows_from_runs([runs["workloads"]])))
    prefill = ("causal", "float32", "fwd", store.CPU)
    assert list(groups) == [(*prefill, "MHA H8"), (*prefill, "GQA H32/8"), (*prefill, "MQA H8/1"),
                            (*prefill, "GQA H32/8 · q_len 1"), DOCS]
    # records without the new fields and records with them written out as their defaults share a facet and a series
    mha = groups[(*prefill, "MHA H8")]
    assert {"kv_heads" in r.params for r in mha} == {True, False}
    assert varying_keys(mha) == ["seq_len"]
    assert {s.key.name(): s.x for s in time_series(mha)} == {"dense": list(store.WORKLOAD_N),
                                                             "sdpa": list(store.WORKLOAD_N)}
    decode = {s.key.name(): s for s in time_series(groups[(*prefill, "GQA H32/8 · q_len 1")])}
    assert decode["dense"].x == list(store.DECODE_N)
    assert decode["dense"].median_s == pytest.approx([1e-5 * n / 1024 for n in store.DECODE_N])
    gqa = {s.key.name(): s for s in time_series(groups[(*prefill, "GQA H32/8")])}
    assert gqa["dense"].median_s == pytest.approx([4e-3 * (n / 1024) ** 2 for n in store.WORKLOAD_N])


def test_sections_and_filters_name_the_workload(runs) -> None:
    rows = rows_from_runs([runs["workloads"]])
    page = build_suite_page("workloads", [runs["workloads"]], rows, [], [], Colours([]))
    values = page.filter_values()
    assert list(values) == ["pattern", "dtype", "mode", "device", "workload"]
    assert values["workload"] == ["MHA H8", "GQA H32/8", "MQA H8/1", "GQA H32/8 · q_len 1"]
    assert values["dtype"] == ["float32", "bfloat16"]
    decode = page.sections[3]
    assert decode.title == f"causal · float32 · fwd · {store.CPU} · GQA H32/8 · q_len 1"
    assert decode.facet_values()["workload"] == "GQA H32/8 · q_len 1" and decode.key == decode.rows[0].facet()
    # a record from before the workload fields (an old run) still renders, as MHA
    old = load_run(write_run(runs["root"].parent / "old-run", commit=commit_id(5), records=[
        record("c1", "dense", store.samples(1e-3), params={k: v for k, v in params().items() if k != "kv_heads"})]))
    (section,) = build_suite_page("old", [old], rows_from_runs([old]), [], [], Colours([])).sections
    assert section.workload == "MHA H2" and section.figures


def test_series_labels_use_the_short_names_of_the_new_fields(runs) -> None:
    gqa_decode = [r for r in rows_from_runs([runs["workloads"]]) if r.params.get("kv_heads") == 8
                  and r.params["heads"] == 32 and r.params["seq_len"] == 4096 and r.impl == "dense"]
    labels = {params_label(r, ["heads", "kv_heads", "q_len"]) for r in gqa_decode}
    assert labels == {"H=32, Hkv=8", "H=32, Hkv=8, q=1"}  # q_len = seq_len is the default: left out, not q=None
    mha = next(r for r in gqa_decode if r.params.get("q_len") is None)
    mha = replace(mha, params={**mha.params, "heads": 8, "kv_heads": 8, "prefix": 32, "image_width": 64})
    assert params_label(mha, ["kv_heads", "prefix", "image_width"]) == "pre=32, iw=64"  # Hkv = H: the default
    # packed documents as a list: grouping works (lists are not hashable) and the label stays short
    docs = facets(current_rows(rows_from_runs([runs["workloads"]])))[DOCS]
    by_seq_len = time_series(docs, x="seq_len")  # seq_len forced on x: each documents value is its own series
    assert {s.key.name() for s in by_seq_len if s.key.impl == "flex"} == {
        "flex (docs=1)", "flex (docs=4)", "flex (docs=16)", "flex (docs=64x128)"}
    assert [label for _, label in correctness_matrix(docs).cases] == ["docs=1", "docs=4", "docs=16", "docs=64x128"]


@pytest.mark.parametrize(("value", "expected"), [
    (None, "None"), (8, "8"), ([2048] * 4, "4x2048"), ([512, 1536], "512+1536"), ([1, 2, 3, 4], "1+2+3+4"),
    (["a", 1], "['a', 1]"),
])
def test_documents_print_compactly(value, expected: str) -> None:
    assert format_documents(value) == expected


def test_long_document_lists_print_their_count_and_stay_apart() -> None:
    one, other = [100, 200, 300, 400, 24], [200, 100, 300, 400, 24]
    assert format_documents(one).startswith("5 of 24..400 #") and len(format_documents(one)) < 24
    assert format_documents(one) != format_documents(other)


def test_documents_sweep_draws_time_and_memory_against_the_number_of_documents(runs) -> None:
    rows = facets(current_rows(rows_from_runs([runs["workloads"]])))[DOCS]
    assert {r.params["seq_len"] for r in rows} == {store.DOCS_N}
    assert x_key(rows) == "documents"
    series = {s.key.name(): s for s in time_series(rows)}
    assert set(series) == {"dense", "flex", "sdpa"}  # one line per implementation, not one point per case
    assert series["flex"].x == list(store.DOCUMENTS)  # 64 was given as a list of lengths: counted
    assert series["flex"].median_s == pytest.approx([store.T_DOCS_DENSE / d for d in store.DOCUMENTS])
    assert series["sdpa"].x == [1, 4, 16]  # skipped at 64
    fig = time_figure(rows, Colours([]))
    go.Figure(fig.plotly)
    xaxis = fig.plotly["layout"]["xaxis"]
    assert xaxis["title"]["text"] == "packed documents (count)" and xaxis["type"] == "log"
    assert fig.title.startswith("Time per call against number of documents (log-log")
    flex = next(t for t in fig.plotly["data"] if t["name"] == "flex")
    assert flex["x"] == list(store.DOCUMENTS)
    memory = memory_data(rows)
    assert memory.x_key == "documents"
    flex_memory = next(s for s in memory.series if s.key.impl == "flex")
    assert flex_memory.x == list(store.DOCUMENTS) and flex_memory.peak_bytes == [2**24 // d for d in store.DOCUMENTS]
    assert [(m.kind, m.row.impl, m.x) for m in memory.marks] == [("skipped", "sdpa", 64)]
    fig = memory_figure(rows, Colours([]))
    go.Figure(fig.plotly)
    assert fig.plotly["layout"]["xaxis"]["title"]["text"] == "packed documents (count)"
    assert fig.title.startswith("Peak memory against number of documents")
    # the speedup heatmap's second axis is the number of documents too: one panel per implementation
    speedup = speedup_data(rows)
    assert speedup.y_key == "documents" and {p.key.name() for p in speedup.panels} == {"flex", "sdpa"}
    flex_cells = next(p for p in speedup.panels if p.key.impl == "flex").cells
    assert {c.y: c.speedup for c in flex_cells} == pytest.approx({d: float(d) for d in store.DOCUMENTS})
    go.Figure(speedup_figure(rows).plotly)


def test_x_axis_is_seq_len_whenever_it_varies(runs) -> None:
    docs = facets(current_rows(rows_from_runs([runs["workloads"]])))[DOCS]
    longer = [replace(r, params={**r.params, "seq_len": 2 * store.DOCS_N}, case_id=r.case_id + "-2n") for r in docs]
    assert x_key(docs + longer) == "seq_len"
    assert {s.key.name() for s in time_series(docs + longer) if s.key.impl == "flex"} == {
        "flex (docs=1)", "flex (docs=4)", "flex (docs=16)", "flex (docs=64x128)"}
    # one length and a window sweep (16, 32): time against the window, on a linear axis (a factor 2)
    local = [r for r in facet_rows(runs["sweep"], "local") if r.params["seq_len"] == 256]
    assert x_key(local) == "window"
    dense = next(s for s in time_series(local) if s.key.name() == "dense")
    assert dense.x == list(store.WINDOWS)
    fig = time_figure(local, Colours([]))
    assert fig.plotly["layout"]["xaxis"]["type"] == "linear"
    assert fig.title.startswith("Time per call against window (log y")
    assert memory_data(local).x_key == "window"
    # nothing varies: seq_len, one category
    single = [r for r in local if r.params["window"] == 16]
    assert x_key(single) == "seq_len"
    assert time_figure(single, Colours([])).plotly["layout"]["xaxis"]["type"] == "category"


@pytest.mark.parametrize(("field", "values", "axis_type"), [
    ("q_len", [1, 16, 256], "log"), ("prefix", [0, 64, 128], "linear"), ("image_width", [16, 32, 64, 128], "log"),
    ("kv_heads", [None, 2, 1], "log"),  # None is heads (4): 1, 2, 4 spans a factor of 4
])
def test_x_axis_for_each_count_that_varies(field: str, values: list, axis_type: str, tmp_path: Path) -> None:
    records = [record(f"c{i}", "dense", store.samples(1e-3 * (i + 1)), params=params("causal", 256, heads=4,
                                                                                      **{field: v}))
               for i, v in enumerate(values)]
    rows = rows_from_runs([load_run(write_run(tmp_path, commit=commit_id(1), records=records))])
    assert x_key(rows) == field
    (series,) = time_series(rows)
    expected = [4 if v is None else v for v in values]
    assert series.x == sorted(expected)
    fig = time_figure(rows, Colours([]))
    go.Figure(fig.plotly)
    assert fig.plotly["layout"]["xaxis"]["type"] == axis_type


def test_history_is_drawn_in_the_section_of_its_workload(tmp_path: Path) -> None:
    runs = []
    for i in range(2):
        records = [record(f"{name}-n{n}", "dense", store.samples(1e-3 * n / 128 * (1 + i)),
                          params=params("causal", n, heads=8, kv_heads=kv))
                   for name, kv in (("mha", None), ("gqa", 2)) for n in (128, 256)]
        runs.append(load_run(write_run(tmp_path, commit=commit_id(i), records=records, suite="hist",
                                       started_at=f"2026-01-0{i + 1}T00:00:00.000000Z")))
    rows = rows_from_runs(runs)
    history, commits = history_series(runs, rows, "hist")
    page = build_suite_page("hist", runs, rows, history, commits, Colours([]))
    assert [s.workload for s in page.sections] == ["MHA H8", "GQA H8/2"]
    for section, name in zip(page.sections, ("mha", "gqa"), strict=True):
        (fig,) = [f for f in section.figures if f.view == "history"]
        cases = {t["hovertext"][0].split("<br>")[1] for t in fig.plotly["data"] if t["mode"] == "lines+markers"}
        assert cases == {f"{name}-n128", f"{name}-n256"}


# --- time and speedup ----------------------------------------------------------------------------------------


# --- memory and peak ------------------------------------------------------------------------------------------


# --- communication -----------------------------------------------------------------------------------------


# --- break-even ------------------------------------------------------------------------------------------------


# --- correctness -------------------------------------------------------------------------------------------


# --- history -------------------------------------------------------------------------------------------------


# --- provenance and escaping ----------------------------------------------------------------------------------


def test_escaping() -> None:
    data = {"name": "</script><!-- & \u2028", "x": [1.234567891, float("nan")]}
    text = script_json(round_floats(data))
    assert not re.search(r"[<>&\u2028]", text)
    assert json.loads(text)["name"] == data["name"]
    assert round_floats(data)["x"] == [1.2346, None]
    assert plot_text(HOSTILE) == ("&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;")


def test_hostile_strings_reach_figures_only_escaped(tmp_path: Path) -> None:
    p = params(HOSTILE, 128)
    records = [record("c1", "dense", store.samples(1e-3), params=p, device=HOSTILE),
               record("c1", HOSTILE, None, params=p, status="failed", reason=HOSTILE, device=HOSTILE)]
    run = load_run(write_run(tmp_path, commit=commit_id(1), records=records))
    rows = rows_from_runs([run])
    page = build_suite_page(HOSTILE, [run], rows, [], [], Colours([HOSTILE]))
    assert page.figures
    for fig in page.figures:
        go.Figure(fig.plotly)
        dumped = json.dumps(fig.plotly)
        assert "<script" not in dumped and "<img" not in dumped and "&lt;script&gt;" in dumped


def test_odd_records_render_without_crashing(tmp_path: Path) -> None:
    """Records are data: parameters of the wrong type, missing or out of range never stop the render."""
    odd = [record("a", "dense", store.samples(1e-3), params={"seq_len": "big", "pattern": None, "window": [1, 2]}),
           record("b", "dense", store.samples(1e-3), params={}),
           record("c", "csr", store.samples(2e-3), params=params("block_random", 128, density=True)),
           record("d", "dense", store.samples(1e-3), params=params("block_random", 128, density=0.5),
                  memory={"peak_bytes": -5}),
           record("e", "csr", [0.0] * 6, params=params("block_random", 128, density=0.5)),
           record("f", "x", store.samples(1e-3), params=params("local", 128, world_size="4"),
                  comm={"backend": "gloo", "bytes_total": 0, "bytes_max_rank": 0, "by_op": {}}),
           record("g", "dense", store.samples(1e-3), params=params("local", -1))]
    run = load_run(write_run(tmp_path, commit=commit_id(1), records=odd))
    result = build_dashboard([run], tmp_path / "out")
    html = result.pages[0].read_text()
    data = json.loads(re.search(r'type="application/json">(.*?)</script>', html, re.S).group(1))
    assert data["figures"]
    for figure in data["figures"].values():
        go.Figure(figure)


# --- pages and the command line -----------------------------------------------------------------------------


def test_suite_file_names() -> None:
    assert suite_file_name("smoke") == "suite-smoke.html"
    hostile = suite_file_name(HOSTILE)
    assert re.fullmatch(r"suite\.[0-9a-f]{16}\.html", hostile)
    assert suite_file_name("../../etc") != suite_file_name("../../etd") and "/" not in suite_file_name("../../etc")


def test_build_dashboard_writes_pages_assets_and_small_data(runs, tmp_path: Path) -> None:
    index = load_index(runs["root"])
    out = tmp_path / "dash"
    result = build_dashboard(index.runs, out)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["assets", "index.html", "suite-h100.html", "suite-multi.html", "suite-nightly.html",
                     "suite-sweep.html", "suite-workloads.html"]
    assert sorted(p.name for p in (out / "assets").iterdir()) == ["dashboard.css", "dashboard.js", "plotly.min.js"]
    for page in result.pages:
        html = page.read_text()
        assert '<script src="assets/plotly.min.js"></script>' in html
        assert "cdn" not in html.lower() and "https://" not in html
        data = json.loads(re.search(r'<script id="dashboard-data" type="application/json">(.*?)</script>', html,
                                    re.S).group(1))
        ids = re.findall(r'data-figure="(fig\d+)"', html)
        assert ids and sorted(ids) == sorted(data["figures"])
        for figure in data["figures"].values():
            go.Figure(figure)
    sweep = (out / "suite-sweep.html").read_text()
    # raw samples stay out of the page: a sample off the median (median * 1.01) never appears
    assert f"{store.T_DENSE[256] * 1.01:.5g}" not in sweep and len(sweep) < 400_000
    index_html = (out / "index.html").read_text()
    for name in ("sweep", "multi", "h100", "nightly", "workloads"):
        assert f'href="suite-{name}.html"' in index_html
    assert "with filters for pattern, dtype, mode, device and workload (" in " ".join(index_html.split())
    assert commit_id(2) in index_html and "model" in index_html
    views = set(re.findall(r'class="view view-(\w+)"', sweep))
    assert views == {"time", "speedup", "memory", "breakeven", "breakeven_ratio", "correctness"}
    stale = out / "suite-gone.html"
    stale.write_text("old")
    build_dashboard(index.runs, out)
    assert not stale.exists()


def test_cli_dashboard_default_store_and_bad_input(runs, tmp_path: Path, capsys) -> None:
    def bench(*args: str) -> tuple[int, str, str]:
        code = main(["dashboard", *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = bench("--results", str(runs["root"]), "-o", str(tmp_path / "out"))
    assert code == 0 and "5 suite page(s)" in out and (tmp_path / "out" / "index.html").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = bench("--results", str(empty), "-o", str(tmp_path / "out2"))
    assert code == 2 and "no runs to show" in err
    broken = write_run(tmp_path / "broken", commit=commit_id(1), records=[])
    (broken / "records.jsonl").write_text('{"case_id": 1}\n')
    code, _, err = bench(str(broken), "-o", str(tmp_path / "out3"))
    assert code == 2 and f"{broken / 'records.jsonl'}" in err and "line 1" in err
    weird = write_run(tmp_path / "weird", commit=commit_id(1), records=[])
    info = json.loads((weird / "run.json").read_text())
    info["env"]["git"] = "main"
    (weird / "run.json").write_text(json.dumps(info))
    code, _, err = bench(str(weird), "-o", str(tmp_path / "out4"))
    assert code == 2 and "field env.git: got 'main'; Input should be a valid dictionary" in err and "run.json" in err


def test_cli_dashboard_runs_as_a_command(runs, tmp_path: Path) -> None:
    done = run_bench("dashboard", str(runs["sweep"].path), "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "suite-sweep.html").is_file() and "1 suite page(s)" in done.stdout
