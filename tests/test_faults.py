"""Fault injection: planted implementations misbehave in every way; the run survives each one.

Each fault is followed by a real implementation that must still run ok; the run ends with exit code 1 and
leaves no process behind (found by an environment marker every child inherits).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from tests.conftest import only_run_dir, read_jsonl, run_bench, write_suite

FAULTS_THEN_REAL = ["fault_raise", "naive_loop", "fault_nan", "dense", "fault_shape", "sdpa", "fault_hang",
                    "fault_abort", "fault_sigkill", "fault_oom", "fault_wrong"]

EXPECTED = {  # impl -> (status, reason prefix)
    "fault_raise": ("failed", "RuntimeError during first call: planted failure in the call"),
    "fault_nan": ("incorrect", "output has "),
    "fault_shape": ("failed", "wrong output: got (1, 2, 47, 16), expected a tensor of shape (1, 2, 48, 16)"),
    "fault_hang": ("failed", "timed out after 6 s during prepare; worker killed"),
    "fault_abort": ("failed", "worker process died during first call (killed by SIGABRT)"),
    "fault_sigkill": ("failed", "worker process died during prepare (killed by SIGKILL)"),
    "fault_oom": ("failed", "out of memory during first call: CUDA out of memory. Tried to allocate 64.00 GiB"),
    "fault_wrong": ("incorrect", "output off the float64 oracle: rel_l2 "),
}


def processes_with_marker(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                status = (proc / "status").read_text()
                if "State:\tZ" not in status:
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_every_fault_kind_gives_its_record_and_the_run_goes_on(tmp_path, faulty_plugin):
    suite = write_suite(tmp_path, {
        "name": "faults", "impls": FAULTS_THEN_REAL, "plugins": ["faulty.py"],
        "defaults": {"heads": 2, "head_dim": 16, "seq_len": 48, "device": "cpu"},
        "measure": {"warmup": 1, "repeat": 3, "max_time_s": 0.05, "timeout_s": 6},
    })
    marker = f"BENCH_FAULT_TEST_{uuid.uuid4().hex}"
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"), env={marker: "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    records = {r["impl"]: r for r in read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")}
    assert list(records) == FAULTS_THEN_REAL  # every implementation got exactly one record, in order
    for impl, (status, reason) in EXPECTED.items():
        assert records[impl]["status"] == status, records[impl]
        assert records[impl]["reason"].startswith(reason), records[impl]["reason"]
    for real in ("naive_loop", "dense", "sdpa"):
        assert records[real]["status"] == "ok", records[real]
    assert processes_with_marker(marker) == []


def test_a_sticky_cuda_error_replaces_the_worker(tmp_path, faulty_plugin):
    """After an illegal address or a device-side assert every later launch in that CUDA context fails: the pair
    after it is measured by a fresh worker (here the error is planted on the CPU; the runner reads its reason)."""
    suite = write_suite(tmp_path, {
        "name": "sticky", "impls": ["fault_pid", "fault_sticky"], "plugins": ["faulty.py"],
        "defaults": {"heads": 2, "head_dim": 16, "device": "cpu"}, "sweep": {"seq_len": [48, 64]},
        "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "timeout_s": 30},
    })
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    pids = [r["config"]["pid"] for r in records if r["impl"] == "fault_pid"]
    assert [r["status"] for r in records if r["impl"] == "fault_pid"] == ["ok", "ok"]
    assert "illegal memory access" in next(r["reason"] for r in records if r["impl"] == "fault_sticky")
    assert pids[0] != pids[1]
