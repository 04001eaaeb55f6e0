"""`bench export --format github-action-benchmark|bencher`: the JSON those CI trackers read, from a stored run."""

from __future__ import annotations

import json

import pytest

from bench.cli import main
from tests.synthetic import record, write_run

COMMIT = "0123456789abcdef" * 2 + "01234567"


@pytest.fixture
def run_dir(tmp_path):
    samples = [1.0e-3, 1.1e-3, 1.2e-3, 1.3e-3, 1.4e-3]
    return write_run(tmp_path, commit=COMMIT, records=[
        record("local-n128", "dense", samples), record("local-n128", "csr", [2e-3] * 5),
        record("causal-n128", "flex", None, status="skipped", reason="needs CUDA")])


def export(capsys, run_dir, fmt: str) -> tuple[int, object, str]:
    code = main(["export", str(run_dir), "--format", fmt])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def test_github_action_benchmark_custom_smaller_is_better(capsys, run_dir):
    code, doc, err = export(capsys, run_dir, "github-action-benchmark")
    assert code == 0 and isinstance(doc, list) and len(doc) == 2
    first = doc[0]
    assert set(first) == {"name", "unit", "value", "range", "extra"}
    assert first["name"] == "dense[local-n128]" and first["unit"] == "us"
    assert first["value"] == pytest.approx(1200.0)  # the median, in microseconds
    assert first["range"].startswith("± ") and COMMIT[:12] in first["extra"]
    assert "1 of 3 records left out" in err  # the skipped one: a tracker plots times


def test_bencher_metric_format(capsys, run_dir, tmp_path):
    code, doc, _ = export(capsys, run_dir, "bencher")
    assert code == 0 and set(doc) == {"dense[local-n128]", "csr[local-n128]"}
    latency = doc["dense[local-n128]"]["latency"]
    assert latency["value"] == pytest.approx(1.2e6)  # nanoseconds, Bencher's latency measure
    assert latency["lower_value"] <= latency["value"] <= latency["upper_value"]
    out = tmp_path / "bmf.json"
    assert main(["export", str(run_dir), "--format", "bencher", "-o", str(out)]) == 0
    assert json.loads(out.read_text()) == doc
