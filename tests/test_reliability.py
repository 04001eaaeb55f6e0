"""Nothing lost: `bench run` SIGKILLed at random moments, then resumed; two runs at once into one store."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

from bench.results.store import load_run
from tests.conftest import ROOT, bench_cmd, read_jsonl, write_suite

KILLS = 12  # random kill moments over one run; each costs a start of `bench run` (about 1.5 s here)


def quick_suite(name: str, seq_lens: list[int]) -> dict:
    return {"name": name, "impls": ["dense", "sdpa", "naive_loop"],
            "defaults": {"heads": 2, "head_dim": 16, "device": "cpu"}, "sweep": {"seq_len": seq_lens},
            "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "timeout_s": 60}}


def complete_lines(path: Path) -> tuple[int, bool]:
    """Parse every complete line of a records file; returns (count, torn tail present)."""
    if not path.exists():
        return 0, False
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    lines = [line for line in data[:end].split(b"\n") if line]
    for line in lines:
        json.loads(line)
    return len(lines), end < len(data)


def test_sigkilled_at_random_moments_then_resumed_nothing_is_lost(tmp_path):
    seq_lens = list(range(16, 16 + 8 * 12, 8))
    suite = write_suite(tmp_path, quick_suite("killme", seq_lens))
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rng = random.Random(20261129)
    run_dir: Path | None = None
    kills = torn_seen = 0
    measured_before = 0
    while kills < KILLS:
        args = ["run", str(suite), "--out", str(results)]
        if run_dir is not None:
            args += ["--resume", str(run_dir)]
        proc = subprocess.Popen(bench_cmd(*args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if run_dir is None:  # the first run: let it create its run directory, or a loaded machine never gets there
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None and not list(results.glob("*/run.json")):
                time.sleep(0.02)
        time.sleep(rng.uniform(0.05, 2.0))
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.wait()
        if run_dir is None:
            started = [d for d in results.iterdir() if (d / "run.json").exists()] if results.exists() else []
            assert started, "the first run never wrote its run.json"
            run_dir = started[0]
        count, torn = complete_lines(run_dir / "records.jsonl")
        torn_seen += torn
        assert count >= measured_before, "records were lost"
        measured_before = count
    assert run_dir is not None
    final = subprocess.run(bench_cmd("run", str(suite), "--out", str(results), "--resume", str(run_dir)),
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stdout + final.stderr
    records = read_jsonl(run_dir / "records.jsonl")
    pairs = [(r["case_id"], r["impl"]) for r in records]
    assert len(pairs) == len(set(pairs)) == len(seq_lens) * 3
    assert all(r["status"] == "ok" for r in records)
    run = load_run(run_dir)
    assert run.info.finished_at is not None and not run.warnings
    print(f"kills survived: {kills}, torn tails seen: {torn_seen}, records: {len(records)}, lost: 0")


def test_two_runs_at_once_into_one_store(tmp_path):
    results = tmp_path / "results"
    suites = [write_suite(tmp_path, quick_suite(name, [32, 48]), name=f"{name}.yaml") for name in ("one", "two")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(bench_cmd("run", str(s), "--out", str(results)), cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in suites]
    # and the same suite twice at the same moment: the run ids must still differ
    same = [subprocess.Popen(bench_cmd("run", str(suites[0]), "--out", str(results)), cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs + same:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out + err
    run_dirs = sorted(d for d in results.iterdir() if d.is_dir())
    assert len(run_dirs) == 4 and len({d.name for d in run_dirs}) == 4
    for run_dir in run_dirs:
        run = load_run(run_dir)
        assert run.info.run_id == run_dir.name and run.info.finished_at is not None
        assert len(run.records) == 2 * 3
        assert {r.case_id.split("-")[1] for r in run.records} == {"n32", "n48"}
    assert not list(results.glob("*/.run.json.*"))  # no temporary files left behind
