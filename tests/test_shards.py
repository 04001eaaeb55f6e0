"""Shards of one run (`bench run --shard I/N`) and `bench submit --executor local`: the split, the parts, locks,
a shard killed mid-run and resubmitted for its missing pairs only, and bad input (exit 2, nothing lost)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bench.cli import main
from bench.errors import BadInput
from bench.results.store import read_run_records
from bench.run.cluster.shards import PartLock, ShardSpec, parse_shard, split
from bench.spec.suite import load_suite
from tests.conftest import ROOT, bench_cmd, read_jsonl, write_suite

SUITE = {"name": "shardy", "impls": ["dense", "sdpa"],
         "defaults": {"heads": 2, "head_dim": 16, "seq_len": 64, "device": "cpu"},
         "sweep": {"pattern": ["local", "causal", "dense"], "mode": ["fwd", "fwd_bwd"]},
         "measure": {"warmup": 0, "repeat": 3, "max_time_s": 0.02, "timeout_s": 60, "memory": "worker"}}
RUN_ID = "20260101T000000-abc1234-shardy"


def pairs_of(suite_path: Path) -> set[tuple[str, str]]:
    suite = load_suite(suite_path)
    return {(c.case_id, i) for c in suite.cases for i in suite.impls}


def test_the_split_is_deterministic_complete_and_keeps_rank_groups_whole():
    weights = [1, 1, 4, 1, 2, 1, 1, 4, 1]
    parts = split(weights, 3)
    assert parts == split(weights, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))  # each pair in exactly one part
    loads = [sum(weights[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(weights)
    assert split(weights, 1) == [list(range(len(weights)))]
    assert split([1, 1], 4)[2:] == [[], []]  # more shards than pairs: empty parts


@pytest.mark.parametrize("text", ["3/2", "2/2", "-1/2", "1/0", "a/b", "1"])
def test_bad_shards_are_refused(text):
    with pytest.raises(BadInput, match="0 <= I < N"):
        parse_shard(text)


def test_bad_input_exits_2_with_a_message(tmp_path, capsys, monkeypatch):
    suite = write_suite(tmp_path, SUITE)
    out = str(tmp_path / "results")
    cases = [
        (["run", str(suite), "--shard", "3/2", "--out", out], "--shard: got '3/2'"),
        (["run", str(suite), "--shard", "0/2", "--run-id", "../up", "--out", out], "--run-id: got '../up'"),
        (["run", str(suite), "--run-id", ".hidden", "--out", out], "not starting with '.'"),
        (["run", str(suite), "--run-id", "nightly-42", "--resume", out], "with --resume"),
        (["submit", str(suite), "--executor", "pbs", "--out", out], "executors: local, slurm"),
        (["submit", "--attach", str(tmp_path)], "no submit.json"),
    ]
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch
    cases.append((["submit", str(suite), "--executor", "slurm", "--out", out], "no sbatch"))
    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)
    assert not (tmp_path / "results").exists()


def test_another_suite_or_a_second_process_of_a_shard_is_refused_and_nothing_is_lost(tmp_path, capsys):
    suite = write_suite(tmp_path, {**SUITE, "sweep": {"pattern": ["local"], "mode": ["fwd"]}})
    out = tmp_path / "results"
    assert main(["run", str(suite), "--shard", "0/2", "--run-id", RUN_ID, "--out", str(out)]) == 0
    run_dir = out / RUN_ID
    part = run_dir / "records.0of2.jsonl"
    before = part.read_bytes()
    assert len(read_jsonl(part)) == 1
    other = write_suite(tmp_path, {**SUITE, "sweep": {"pattern": ["causal"], "mode": ["fwd"]}}, "other.yaml")
    capsys.readouterr()
    assert main(["run", str(other), "--shard", "0/2", "--run-id", RUN_ID, "--out", str(out)]) == 2
    assert "other content" in capsys.readouterr().err
    lock = PartLock(run_dir, ShardSpec(1, 2))  # another process writes shard 1
    try:
        assert main(["run", str(suite), "--shard", "1/2", "--run-id", RUN_ID, "--out", str(out)]) == 2
        assert f"being written by pid {os.getpid()}" in capsys.readouterr().err
    finally:
        lock.release()
    assert part.read_bytes() == before and not (run_dir / "records.1of2.jsonl").exists()
    # The same shard again: nothing left to measure, nothing appended.
    assert main(["run", str(suite), "--shard", "0/2", "--run-id", RUN_ID, "--out", str(out)]) == 0
    assert part.read_bytes() == before
    assert json.loads((run_dir / "run.json").read_text())["finished_at"] is None  # shard 1 has not run
    # The other shard, resumed by its directory: the run is whole, and finished.
    assert main(["run", str(suite), "--resume", str(run_dir), "--shard", "1/2"]) == 0
    assert sorted((r.case_id, r.impl) for r in read_run_records(run_dir).records) == sorted(pairs_of(suite))
    assert json.loads((run_dir / "run.json").read_text())["finished_at"] is not None


def test_local_shards_concurrently_one_killed_and_resubmitted_lose_and_duplicate_nothing(tmp_path, capsys):
    """Two local shards run at once (`submit --no-wait`), shard 1 is SIGKILLed after its first record, and
    `submit --attach` (another process, which did not start them) watches shard 0 to its end and resubmits shard 1
    for its missing pairs."""
    suite = write_suite(tmp_path, {**SUITE, "measure": {**SUITE["measure"], "repeat": 20, "max_time_s": 0.3}})
    out = tmp_path / "results"
    assert main(["submit", str(suite), "--shards", "2", "--out", str(out), "--no-wait"]) == 0
    assert "bench submit --attach" in capsys.readouterr().out
    run_dir = next(out.glob("*-shardy"))
    jobs = json.loads((run_dir / "submit.json").read_text())["jobs"]
    try:
        part, deadline = run_dir / "records.1of2.jsonl", time.monotonic() + 240
        while not (part.exists() and read_jsonl(part)) and time.monotonic() < deadline:
            time.sleep(0.2)
        killed_at = len(read_jsonl(part))
        assert killed_at > 0, "shard 1 wrote nothing"
        os.killpg(int(jobs["1"][0]["id"]), signal.SIGKILL)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        attach = subprocess.run(bench_cmd("submit", "--attach", str(run_dir)), cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
    finally:
        for job in json.loads((run_dir / "submit.json").read_text())["jobs"].values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(job[-1]["id"]), signal.SIGKILL)  # only if the test failed half-way
    assert attach.returncode == 0, attach.stdout + attach.stderr
    assert "shard 1/2: job" in attach.stdout and "submitting it again (2 of 3)" in attach.stdout
    assert "shards: 0 pending, 0 running, 0 unknown, 2 done, 0 failed" in attach.stdout
    merged = read_run_records(run_dir)
    keys = [(r.case_id, r.impl) for r in merged.records]
    assert sorted(keys) == sorted(pairs_of(suite)) and not merged.warnings  # every pair once
    assert all(r.status == "ok" and r.error is not None and r.error.rel_l2 <= r.error.tolerance
               for r in merged.records)
    assert len(read_jsonl(part)) >= killed_at  # nothing written was lost
    plan = json.loads((run_dir / "submit.json").read_text())
    assert len(plan["jobs"]["1"]) == 2 and len(plan["jobs"]["0"]) == 1
    assert json.loads((run_dir / "run.json").read_text())["finished_at"] is not None


def test_rank_groups_as_shards_of_their_own():
    from bench.run.cluster.shards import split_rank_groups

    sizes = [1, 2, 1, 4, 1, 2, 4, 1]
    parts = split_rank_groups(sizes, 4)
    assert parts[:2] == [[1, 5], [3, 6]]  # P=2, then P=4, each whole
    assert sorted(parts[2] + parts[3]) == [0, 2, 4, 7]
    with pytest.raises(BadInput, match="need at least one more"):
        split_rank_groups(sizes, 2)


def test_slurm_task_variables_become_the_launchers():
    from bench.run.cluster.slurm_rank import launcher_env

    env = launcher_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                        "SLURM_JOB_NUM_NODES": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"})
    assert env == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2"}
    with pytest.raises(SystemExit, match="SLURM_PROCID"):
        launcher_env({})
