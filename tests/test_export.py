"""`bench export` read back by the real `pytest-benchmark compare`, CSV rows, and the `benchmarks/` entry."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.cli import main
from tests.conftest import ROOT, outer_pytest_env, write_suite
from tests.synthetic import commit_id, noisy, params, record, write_run


def pytest_benchmark_compare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The `pytest-benchmark` console script (its module form, so the venv's copy is used)."""
    return subprocess.run([sys.executable, "-m", "pytest_benchmark", "compare", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    base_samples = {impl: noisy(rng, median, n=12) for impl, median in (("dense", 2e-3), ("sdpa", 5e-4))}
    base = write_run(tmp_path / "results", commit=commit_id(1), records=[
        record("local-n128", "dense", base_samples["dense"]), record("local-n128", "sdpa", base_samples["sdpa"]),
        record("local-n128", "blocked", None, status="skipped", reason="needs a GPU"),
        record("local-n128", "cp_ring", noisy(rng, 1e-3), source="modelled")])
    new = write_run(tmp_path / "results", commit=commit_id(2), started_at="2026-01-02T00:00:00.000000Z", records=[
        record("local-n128", "dense", base_samples["dense"] * 1.5), record("local-n128", "sdpa", base_samples["sdpa"])])
    return base, new


def test_pytest_benchmark_compare_reads_the_export(tmp_path, two_runs, capsys):
    base, new = two_runs
    for run, name in ((base, "0001_base.json"), (new, "0002_new.json")):
        assert main(["export", str(run), "--format", "pytest-benchmark", "-o", str(tmp_path / name)]) == 0
    err = capsys.readouterr().err
    assert "2 of 4 records left out" in err  # the skipped one and the modelled one
    doc = json.loads((tmp_path / "0001_base.json").read_text())
    assert {"machine_info", "commit_info", "benchmarks", "datetime", "version"} <= set(doc)
    assert doc["commit_info"]["id"] == commit_id(1)
    (dense,) = [b for b in doc["benchmarks"] if b["extra_info"]["impl"] == "dense"]
    assert dense["name"] == "dense[local-n128]" and dense["group"] == "local-n128" and dense["params"]["seq_len"] == 128
    assert dense["stats"]["rounds"] == 12 and len(dense["stats"]["data"]) == 12
    assert dense["stats"]["median"] == pytest.approx(float(np.median(dense["stats"]["data"])))

    proc = pytest_benchmark_compare("0001_base.json", "0002_new.json", "--group-by=name", "--columns=median,rounds",
                                    "--csv=compared", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Failed to load" not in proc.stdout + proc.stderr
    assert "dense[local-n128]" in proc.stdout and "sdpa[local-n128]" in proc.stdout
    rows = csv_rows(next(tmp_path.glob("compared*.csv")))
    assert sorted(r["name"] for r in rows) == ["smoke::dense[local-n128]"] * 2 + ["smoke::sdpa[local-n128]"] * 2
    new_doc = json.loads((tmp_path / "0002_new.json").read_text())
    expected = sorted(b["stats"]["median"] for d in (doc, new_doc) for b in d["benchmarks"])
    assert sorted(float(r["median"]) for r in rows) == pytest.approx(expected)


def test_csv_has_one_row_per_record(tmp_path, two_runs, capsys):
    base, _ = two_runs
    out = tmp_path / "base.csv"
    assert main(["export", str(base), "--format", "csv", "-o", str(out)]) == 0
    rows = csv_rows(out)
    assert [(r["impl"], r["status"], r["source"]) for r in rows] == [
        ("dense", "ok", "measured"), ("sdpa", "ok", "measured"), ("blocked", "skipped", "measured"),
        ("cp_ring", "ok", "modelled")]
    assert float(rows[0]["time_median_s"]) == pytest.approx(json.loads(
        (base / "records.jsonl").read_text().splitlines()[0])["time_s"]["median"])
    assert rows[2]["time_median_s"] == "" and rows[2]["reason"] == "needs a GPU"
    assert rows[0]["param.seq_len"] == "128" and rows[0]["commit"] == commit_id(1)
    assert main(["export", str(base), "--format", "csv", "-o", str(tmp_path / "no" / "such.csv")]) == 2
    assert "-o: the output file's directory does not exist" in capsys.readouterr().err


def test_csv_has_a_column_for_every_case_field(tmp_path):
    """Columns come from the Case's fields, so none is dropped (cp_layout, ulysses_degree were)."""
    from dataclasses import fields

    from bench.spec.case import Case

    run = write_run(tmp_path / "zigzag", commit=commit_id(3), records=[record(
        "z", "cp_usp", noisy(np.random.default_rng(1), 1e-3), params=params(world_size=4, cp_layout="zigzag",
                                                                            ulysses_degree=2, documents=[64, 64]))])
    out = tmp_path / "base.csv"
    assert main(["export", str(run), "--format", "csv", "-o", str(out)]) == 0
    header = out.read_text().splitlines()[0].split(",")
    assert {f"param.{f.name}" for f in fields(Case)} <= set(header)
    assert {"param.cp_layout", "param.ulysses_degree", "param.kv_lens", "contention_verdict"} <= set(header)
    rows = csv_rows(out)
    assert (rows[0]["param.cp_layout"], rows[0]["param.ulysses_degree"]) == ("zigzag", "2")
    assert json.loads(rows[0]["param.documents"]) == [64, 64]


def test_default_test_run_does_not_collect_benchmarks(pytestconfig):
    assert pytestconfig.getini("testpaths") == ["tests"]
    assert (ROOT / "benchmarks" / "test_attention.py").is_file()


def test_benchmarks_entry_runs_under_pytest_benchmark(tmp_path):
    suite = write_suite(tmp_path, {"name": "pb", "impls": ["dense", "sdpa"],
                                   "defaults": {"heads": 2, "head_dim": 16, "seq_len": 64, "device": "cpu"},
                                   "sweep": {"pattern": ["local", "causal"], "mode": ["fwd", "fwd_bwd"]},
                                   "measure": {"warmup": 1, "repeat": 4}})
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/", "-q", "-p", "no:cacheprovider",
                           f"--bench-suite={suite}", "--bench-impl=sdpa", "-k", "local",
                           f"--benchmark-json={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=outer_pytest_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed, 2 deselected" in proc.stdout
    doc = json.loads(out.read_text())
    names = sorted(b["name"] for b in doc["benchmarks"])
    assert len(names) == 2 and all(n.startswith("test_attention[sdpa-local_w64-n64") for n in names)
    for bench in doc["benchmarks"]:
        assert bench["stats"]["rounds"] == 4 and len(bench["stats"]["data"]) == 4
        assert bench["extra_info"]["rel_l2"] < 1e-4 and bench["extra_info"]["device"] == "cpu"
    assert pytest_benchmark_compare(str(out), cwd=tmp_path).returncode == 0
    # a suite error is a usage error naming the field, not a traceback
    bad = write_suite(tmp_path, {"name": "pb", "impls": ["nope"]}, name="bad.yaml")
    proc = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/", "-q", "-p", "no:cacheprovider",
                           f"--bench-suite={bad}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=outer_pytest_env())
    assert proc.returncode == 4 and "impls[0]" in proc.stderr and "'nope'" in proc.stderr
