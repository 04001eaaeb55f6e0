"""Every caller that times a case prepares it through bench.measure.case.prepare: a selection case is timed with its
selector and a paged case through its page table in the pair session (`bench run`), in the fresh process of the
memory probe, in `bench profile`, in the pytest-benchmark entry of benchmarks/ and in `bench.api`; the ranks of a
distributed pair refuse a selection they cannot take instead of timing the base pattern, and read a paged case
through its table. The traced plugins (tests/plugins/traced.py, traced_gather.py) note each selection made, each
attend over one and each read through a page table, with the process that did it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from bench import api
from bench.patterns import make_pattern
from bench.selection import Selection
from bench.spec.plugins import load_plugin
from tests.conftest import PLUGINS, ROOT, bench_cmd, only_run_dir, outer_pytest_env, read_jsonl, write_suite

SHAPE = {"heads": 2, "head_dim": 16, "seq_len": 256, "block_size": 64, "pattern": "causal", "device": "cpu"}
SUITE = {"name": "traced", "impls": ["traced"], "plugins": [str(PLUGINS / "traced.py")],
         "sweeps": [{"defaults": {**SHAPE, "selector": "traced_first_blocks"}, "sweep": {}},
                    {"defaults": {**SHAPE, "q_len": 1, "page_size": 16}, "sweep": {}}],
         "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "timeout_s": 120, "memory": "fresh"}}


def _events(trace: Path) -> Counter:
    """(event, pid) -> count, from the trace file."""
    return Counter(tuple(line.split()) for line in trace.read_text().splitlines()) if trace.exists() else Counter()


def _by_event(events: Counter) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for event, pid in events:
        out.setdefault(event, set()).add(pid)
    return out


@pytest.fixture()
def traced(tmp_path, monkeypatch):
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("BENCH_TEST_TRACE", str(trace))
    return trace, write_suite(tmp_path, SUITE)


def test_the_worker_and_the_fresh_memory_process_time_the_selector_and_read_the_page_table(traced, tmp_path):
    trace, suite = traced
    proc = subprocess.run(bench_cmd("run", str(suite), "--out", str(tmp_path / "r")), capture_output=True,
                          text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    selected, paged = read_jsonl(only_run_dir(tmp_path / "r") / "records.jsonl")
    assert selected["selection"]["selector"] == "traced_first_blocks" and selected["status"] == "ok"
    assert paged["params"]["page_size"] == 16 and paged["status"] == "ok"
    assert selected["memory"]["process"] == paged["memory"]["process"] == "fresh"
    pids = _by_event(_events(trace))
    # the worker and the memory probe's fresh processes: two processes at least made selections, attended over
    # them, and read through the page table
    for event in ("select", "attend", "page_table", "paged_call"):
        assert len(pids.get(event, set())) >= 2, (event, pids)


def test_bench_profile_traces_the_selection_case_end_to_end_and_the_paged_case_through_its_table(traced, tmp_path):
    trace, suite = traced
    for index in (0, 1):
        proc = subprocess.run(bench_cmd("profile", str(suite), "--impl", "traced", "--case", str(index), "-o",
                                        str(tmp_path / f"p{index}.json")), capture_output=True, text=True,
                              timeout=600, env={**os.environ})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert ("selected case" if index == 0 else "paged case") in proc.stdout
    events = Counter(event for event, _ in _events(trace).elements())
    # profile: the first call, one more warm-up and three traced calls, each end to end
    assert events["select"] >= 5 and events["attend"] >= 5
    assert events["page_table"] == 1 and events["paged_call"] >= 5


def test_the_pytest_benchmark_entry_times_both_kinds_as_run_does(traced, tmp_path):
    trace, suite = traced
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "benchmarks"),
                           "--bench-suite", str(suite), f"--benchmark-json={out}", "--benchmark-disable-gc"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=outer_pytest_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kinds = sorted(b["extra_info"]["kind"] for b in json.loads(out.read_text())["benchmarks"])
    assert kinds == ["paged", "selected"]
    events = Counter(event for event, _ in _events(trace).elements())
    assert events["select"] >= 2 and events["attend"] >= 2 and events["page_table"] == 1 and events["paged_call"] >= 2


def test_the_python_api_attends_over_a_given_selection_through_prepare_selected(traced):
    trace, _ = traced
    load_plugin(str(PLUGINS / "traced.py"), base_dir=None, file="test", field="plugins")
    pattern = make_pattern("causal", 128)
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    own = torch.tensor([[0, -1], [1, 0]], dtype=torch.int32).expand(1, 2, 2, 2).contiguous()
    out = api.attention("traced", q, k, v, pattern, Selection(own, 64, 64, "head"), block_size=64)
    assert out.shape == q.shape
    assert Counter(event for event, _ in _events(trace).elements())["attend"] == 1


def test_ranks_refuse_a_selection_they_cannot_take_instead_of_timing_the_base_pattern(tmp_path):
    suite = write_suite(tmp_path, {**SUITE, "impls": ["cp_ring"],
                                   "sweeps": [{"defaults": {**SHAPE, "world_size": 2,
                                                            "selector": "traced_first_blocks"}, "sweep": {}}]})
    proc = subprocess.run(bench_cmd("run", str(suite), "--out", str(tmp_path / "r")), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = read_jsonl(only_run_dir(tmp_path / "r") / "records.jsonl")
    assert record["status"] == "skipped" and "selection" in record["reason"], record


def test_ranks_time_a_paged_case_through_its_page_table(tmp_path, monkeypatch):
    """tp_heads (heads over 2 ranks) takes decode over a paged cache: each of the two rank processes gathers the
    pages inside its timed call."""
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("BENCH_TEST_TRACE", str(trace))
    suite = write_suite(tmp_path, {**SUITE, "impls": ["tp_heads"], "plugins": [str(PLUGINS / "traced_gather.py")],
                                   "sweeps": [{"defaults": {**SHAPE, "world_size": 2, "q_len": 1, "page_size": 16},
                                               "sweep": {}}]})
    proc = subprocess.run(bench_cmd("run", str(suite), "--out", str(tmp_path / "r")), capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = read_jsonl(only_run_dir(tmp_path / "r") / "records.jsonl")
    assert record["status"] == "ok" and record["params"]["page_size"] == 16, record
    gathered_by = _by_event(_events(trace)).get("gather", set())
    assert len(gathered_by) == 2, gathered_by  # two processes: the ranks


def test_the_fresh_memory_process_takes_a_reference_selection_from_the_worker(tmp_path, monkeypatch):
    """A reference selector (a yardstick that costs dense attention) runs in the worker only: its selection travels to
    the fresh memory process in a file, and the memory figure is the attention's over it, said in its note."""
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("BENCH_TEST_TRACE", str(trace))
    plugins = [str(PLUGINS / "traced.py"), str(PLUGINS / "traced_reference.py")]
    suite = write_suite(tmp_path, {**SUITE, "plugins": plugins, "sweeps": [
        {"defaults": {**SHAPE, "selector": "traced_reference_blocks"}, "sweep": {}}]})
    proc = subprocess.run(bench_cmd("run", str(suite), "--out", str(tmp_path / "r")), capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = read_jsonl(only_run_dir(tmp_path / "r") / "records.jsonl")
    assert record["status"] == "ok" and record["memory"]["process"] == "fresh", record["memory"]
    assert record["memory"]["note"].startswith("the attention over the reference selection"), record["memory"]
    by = _by_event(_events(trace))
    assert len(by["reference_select"]) == 1, by  # the worker alone made the selection
    assert len(by["attend"]) == 2 and by["reference_select"] < by["attend"], by  # the fresh process attended too
