"""`bench run` end to end: records, isolation of failing implementations, crash safety and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import ROOT, bench_cmd, only_run_dir, read_jsonl, run_bench, write_suite

GOLDEN = json.loads((Path(__file__).parent / "golden" / "record_schema.json").read_text())


def small_suite(**overrides) -> dict:
    suite = {"name": "t", "impls": ["dense", "sdpa"], "defaults": {"heads": 2, "head_dim": 16, "seq_len": 64},
             "sweep": {"pattern": ["local", "causal"], "mode": ["fwd", "fwd_bwd"]},
             "measure": {"warmup": 1, "repeat": 3, "max_time_s": 0.05, "timeout_s": 120}}
    suite.update(overrides)
    return suite


def test_records_follow_the_golden_schema(tmp_path):
    suite = write_suite(tmp_path, small_suite())
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = only_run_dir(tmp_path / "results")
    info = json.loads((run_dir / "run.json").read_text())
    assert sorted(info) == GOLDEN["run.json"]
    assert sorted(info["suite"]) == GOLDEN["run.json:suite"]
    assert sorted(info["env"]) == GOLDEN["run.json:env"]
    assert sorted(info["env"]["git"]) == GOLDEN["run.json:env.git"]
    assert sorted(info["env"]["load"]) == GOLDEN["run.json:env.load"]
    assert info["env"]["load"]["end"]["at"] >= info["env"]["load"]["start"]["at"]
    assert info["finished_at"] is not None and info["run_id"] == run_dir.name
    records = read_jsonl(run_dir / "records.jsonl")
    assert len(records) == 4 * 2  # one per (case, impl)
    for r in records:
        assert sorted(r) == GOLDEN["record"]
        assert sorted(r["params"]) == GOLDEN["record:params"]
        assert r["status"] == "ok", r
        assert sorted(r["time_s"]) == GOLDEN["record:time_s"]
        assert sorted(r["setup"]) == GOLDEN["record:setup"] and r["setup"]["first_call_s"] > 0
        assert len(r["time_s"]["samples"]) == r["time_s"]["n"] >= 3
        assert sorted(r["memory"]) == GOLDEN["record:memory"]
        assert sorted(r["error"]) == GOLDEN["record:error"]
        assert sorted(r["contention"]) == GOLDEN["record:contention"]
        assert sorted(r["timing"]) == GOLDEN["record:timing"]
        assert r["timing"]["cache"] == "cold" and r["timing"]["rotated_sets"] == 2 and r["timing"]["checked_calls"] >= 1
        assert r["contention"]["verdict"] in ("quiet", "busy") and r["contention"]["cpu_over_wall"] > 0
        assert r["error"]["rel_l2"] <= r["error"]["tolerance"]
        if r["params"]["mode"] == "fwd_bwd":
            assert set(r["error"]["grads"]) == {"dq", "dk", "dv"}
        assert r["setup_s"] > 0 and r["flops"] > 0
    assert "median time per call" in proc.stdout


def test_failing_implementations_are_isolated(tmp_path, faulty_plugin):
    suite = write_suite(tmp_path, small_suite(
        impls=["fault_raise", "fault_nan", "fault_shape", "fault_hang", "fault_wrong", "dense"],
        plugins=["faulty.py"], sweep={"seq_len": [64]}, measure={"repeat": 3, "timeout_s": 8}))
    start = time.monotonic()
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert time.monotonic() - start < 120
    records = {r["impl"]: r for r in read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")}
    assert records["fault_raise"]["status"] == "failed"
    assert records["fault_raise"]["reason"] == "RuntimeError during first call: planted failure in the call"
    assert "planted failure" in records["fault_raise"]["details"]
    assert records["fault_nan"]["status"] == "incorrect"
    assert records["fault_nan"]["reason"] == f"output has {2 * 64 * 16} NaN/Inf values"
    assert records["fault_shape"]["status"] == "failed"
    assert records["fault_shape"]["reason"] == ("wrong output: got (1, 2, 63, 16), expected a tensor of shape "
                                                "(1, 2, 64, 16)")
    assert records["fault_hang"]["status"] == "failed"
    assert records["fault_hang"]["reason"] == "timed out after 8 s during prepare; worker killed"
    assert records["fault_wrong"]["status"] == "incorrect"
    assert "output off the float64 oracle: rel_l2" in records["fault_wrong"]["reason"]
    assert records["fault_wrong"]["error"]["rel_l2"] > 0.1
    assert records["dense"]["status"] == "ok"  # the next implementation still ran


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone for our purposes
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") >= 0
    except OSError:
        return True


def _workers_of(run_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "bench.run.worker"], capture_output=True, text=True).stdout.split()
    mine = []
    for pid in map(int, out):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == run_pid:
            mine.append(pid)
    return mine


def test_killed_run_keeps_records_and_resume_completes_exactly_the_missing(tmp_path):
    suite_content = small_suite(impls=["naive_loop", "dense", "sdpa"],
                                sweep={"seq_len": [32, 48, 64, 80, 96, 112]},
                                measure={"warmup": 1, "repeat": 5, "max_time_s": 0.3, "timeout_s": 120})
    suite = write_suite(tmp_path, suite_content)
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(bench_cmd("run", str(suite), "--out", str(results)), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records_path = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        runs = list(results.glob("*/records.jsonl")) if results.exists() else []
        if runs and runs[0].read_bytes().count(b"\n") >= 4:
            records_path = runs[0]
            break
        time.sleep(0.05)
    assert records_path is not None, "the run wrote no records in time"
    workers = _workers_of(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = records_path.read_bytes()
    lines = kept.split(b"\n")
    for line in lines[:-1]:
        json.loads(line)  # every complete line parses
    measured = len(lines) - 1
    assert 4 <= measured < 18
    time.sleep(1.0)
    assert all(_process_gone(pid) for pid in workers), "a worker outlived the killed runner"

    resumed = run_bench("run", str(suite), "--out", str(results), "--resume", str(records_path.parent))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    records = read_jsonl(records_path)
    pairs = [(r["case_id"], r["impl"]) for r in records]
    assert len(pairs) == len(set(pairs)) == 6 * 3  # every pair exactly once
    assert records_path.read_bytes().startswith(kept[: kept.rfind(b"\n") + 1])  # nothing rewritten
    assert json.loads((records_path.parent / "run.json").read_text())["finished_at"] is not None


def test_resume_drops_a_torn_last_line_and_remeasures_it(tmp_path):
    suite = write_suite(tmp_path, small_suite(impls=["dense"], sweep={"seq_len": [32, 64]}))
    results = tmp_path / "results"
    assert run_bench("run", str(suite), "--out", str(results)).returncode == 0
    run_dir = only_run_dir(results)
    path = run_dir / "records.jsonl"
    good = path.read_bytes().split(b"\n")
    path.write_bytes(good[0] + b"\n" + good[1][: len(good[1]) // 2])  # a write torn by a kill
    proc = run_bench("run", str(suite), "--out", str(results), "--resume", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert "dropped a torn last line" in proc.stdout
    records = read_jsonl(path)
    assert len(records) == 2 and records[0]["case_id"] != records[1]["case_id"]


def test_resume_refuses_another_suite(tmp_path):
    suite = write_suite(tmp_path, small_suite(impls=["dense"], sweep={"seq_len": [32]}))
    results = tmp_path / "results"
    assert run_bench("run", str(suite), "--out", str(results)).returncode == 0
    other = write_suite(tmp_path, small_suite(impls=["dense"], sweep={"seq_len": [48]}), name="other.yaml")
    proc = run_bench("run", str(other), "--out", str(results), "--resume", str(only_run_dir(results)))
    assert proc.returncode == 2
    assert "--resume" in proc.stderr and "suite: the run was made from suite" in proc.stderr


def test_extensions_are_built_before_the_first_pair_for_the_devices_of_its_pairs(monkeypatch):
    """A build inside a pair counts against that pair's timeout (blocked's C++ kernels take a minute or more
    on a busy 2-core machine): the runner asks each implementation to build first, for its pairs' devices."""
    import torch
    from rich.console import Console

    from bench import registry
    from bench.api import case_for
    from bench.patterns import make_pattern
    from bench.run import runner

    asked: dict[str, set[str]] = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def build_ahead(self, devices):
            asked[self.name] = devices

    monkeypatch.setattr(registry, "get", lambda name: Recorder(name))
    q = torch.zeros(1, 2, 64, 32)
    case = case_for(q, make_pattern("causal", 64), "fwd", q)
    todo = [runner.Pair(case, "blocked"), runner.Pair(case, "blocked")]
    runner._build_ahead(["blocked", "dense"], todo, None, Console(quiet=True))
    assert asked == {"blocked": {"cpu"}}  # dense has no pair left to run: nothing asked of it


def test_a_run_stored_before_a_field_was_added_resumes_and_another_suite_does_not(tmp_path):
    """run.json keeps the suite's content with every default filled in; a measure field added since (its
    default unchanged) must not stop `--resume`, while a changed setting still does."""
    suite = write_suite(tmp_path, {"name": "old", "impls": ["dense"], "defaults": {"heads": 2, "head_dim": 16},
                                   "sweep": {"seq_len": [64]}, "measure": {"repeat": 2, "warmup": 0}})
    results = tmp_path / "results"
    assert run_bench("run", str(suite), "--out", str(results)).returncode == 0
    run_dir = only_run_dir(results)
    info = json.loads((run_dir / "run.json").read_text())
    del info["suite"]["content"]["measure"]["wait_for_quiet_s"]  # as a run written before the field existed
    (run_dir / "run.json").write_text(json.dumps(info))
    resumed = run_bench("run", str(suite), "--out", str(results), "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    changed = write_suite(tmp_path, {"name": "old", "impls": ["dense"], "defaults": {"heads": 2, "head_dim": 16},
                                     "sweep": {"seq_len": [64]}, "measure": {"repeat": 3, "warmup": 0}}, "b.yaml")
    refused = run_bench("run", str(changed), "--out", str(results), "--resume", str(run_dir))
    assert refused.returncode == 2 and "other content" in refused.stderr
