"""Which section a record lands in and in what order: measurements before models on a suite page, and a record
that failed before naming its device beside its measured neighbours (found on the first GPU run, where a failed
pair said `cuda` and the others `cuda:0 NVIDIA H200`)."""

from __future__ import annotations

import re
from types import SimpleNamespace

from bench.cli import main
from bench.results.environment import Environment
from bench.results.index import record_device
from tests.synthetic import commit_id, record, write_run


def _run_on(env: dict) -> SimpleNamespace:
    return SimpleNamespace(info=SimpleNamespace(env=Environment.model_validate(env)))


def test_a_record_without_a_device_takes_the_runs_device_of_its_kind():
    failed = record("c", "flex", None, status="failed", device=None, params={"device": "cuda"})
    gpu_run = _run_on({"backend": "cuda", "gpus": [{"cuda_index": 0, "name": "NVIDIA H200"}]})
    assert record_device(failed, gpu_run) == "cuda:0 NVIDIA H200"
    cpu_failed = record("c", "flex", None, status="failed", device=None, params={"device": "auto"})
    assert record_device(cpu_failed, _run_on({"backend": "cpu", "cpu": {"model": "AMD EPYC"}})) == "cpu: AMD EPYC"
    assert record_device(failed, _run_on({"backend": "cuda"})) == "cuda"  # nothing better known: what was asked
    named = record("c", "flex", [1e-3], device="cuda:1 NVIDIA A100")
    assert record_device(named, gpu_run) == "cuda:1 NVIDIA A100"


def test_measured_sections_come_before_modelled_ones(tmp_path):
    results = tmp_path / "results"
    modelled = record("m", "dense", [1e-3], device="model: NVIDIA H200 (SXM)", source="modelled")
    write_run(results, commit=commit_id(1), records=[modelled], source="modelled", suite="gpu",
              started_at="2026-01-01T00:00:00.000000Z")
    measured = record("m", "dense", [2e-3], device="cuda:0 NVIDIA H200")
    write_run(results, commit=commit_id(2), records=[measured], suite="gpu", started_at="2026-01-02T00:00:00.000000Z")
    assert main(["dashboard", "--results", str(results), "-o", str(tmp_path / "out")]) == 0
    headings = re.findall(r"<h2[^>]*>([^<]*)", (tmp_path / "out" / "suite-gpu.html").read_text())
    devices = [h for h in headings if "H200" in h]
    assert len(devices) == 2 and "cuda:0 NVIDIA H200" in devices[0] and "model:" in devices[1], headings
