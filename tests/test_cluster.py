"""Beyond one machine, for real: a Slurm controller and node daemon started on localhost with a slurm.conf of
the test's own, `bench submit --executor slurm` of a small suite as 4 shards with one shard cancelled while it
runs; and a rank group over two "nodes", two torchrun launchers on localhost (--nnodes 2 --node-rank 0|1).

Where Slurm's daemons are missing or cannot start, the test says why: it FAILS when the environment variable CI
is set (.ci/run installs slurm-wlm) and is skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cli import main
from bench.results.store import read_run_records
from tests.conftest import ROOT, bench_cmd, only_run_dir, read_jsonl, write_suite

SUITE = {"name": "cluster", "impls": ["dense", "sdpa"],
         "defaults": {"heads": 2, "head_dim": 16, "seq_len": 64, "device": "cpu"},
         "sweep": {"pattern": ["local", "causal", "dense"], "mode": ["fwd", "fwd_bwd"]},
         "measure": {"warmup": 0, "repeat": 3, "max_time_s": 0.02, "timeout_s": 60, "memory": "worker"}}


def unavailable(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"Slurm is needed in CI: {why}")
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SLURM_CONF = """ClusterName=benchtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm(tmp_path):
    """slurmctld and slurmd on localhost (root, no munge: auth/none); SLURM_CONF for the clients."""
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo") if not shutil.which(b)]
    if missing:
        unavailable(f"{', '.join(missing)} not on PATH (Debian: apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        unavailable("the test's slurmd runs jobs as root, and this is not root")
    directory = tmp_path / "slurm"
    (directory / "state").mkdir(parents=True)
    (directory / "spool").mkdir()
    conf = directory / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname(), ctld_port=free_port(), d_port=free_port(),
                                      dir=directory, cpus=os.cpu_count() or 1))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen([name, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for name in ("slurmctld", "slurmd")]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            if state.strip() in ("idle", "mixed", "allocated"):
                break
            time.sleep(0.5)
        else:
            logs = "".join((directory / n).read_text()[-800:] for n in ("slurmctld.log", "slurmd.log")
                           if (directory / n).exists())
            unavailable(f"slurmctld/slurmd did not bring the node up within 30 s: {logs}")
        yield env
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            try:
                d.wait(timeout=15)
            except subprocess.TimeoutExpired:
                d.kill()


def test_slurm_array_of_4_shards_with_one_cancelled_equals_a_single_process_run(slurm, tmp_path):
    suite = write_suite(tmp_path, SUITE)
    out = tmp_path / "results"
    env = {**slurm, "PYTHONPATH": str(ROOT)}
    submit = subprocess.Popen(bench_cmd("submit", str(suite), "--executor", "slurm", "--shards", "4", "--out",
                                        str(out)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        victim, deadline = None, time.monotonic() + 120
        while victim is None and time.monotonic() < deadline:  # cancel shard 2 once it runs
            plan = next(out.glob("*/submit.json"), None) if out.exists() else None
            if plan is not None:
                job = json.loads(plan.read_text())["jobs"]["2"][0]["id"]
                state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=slurm, capture_output=True,
                                       text=True).stdout.strip()
                if state == "RUNNING":
                    victim = job
                    subprocess.run(["scancel", job], env=slurm, check=True)
            time.sleep(0.3)
        assert victim is not None, "shard 2 never ran"
        output, _ = submit.communicate(timeout=400)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode == 0, output
    assert "running" in output and "pending" in output and "4 done, 0 failed" in output
    assert f"shard 2/4: job {victim} ended" in output, output
    run_dir = only_run_dir(out)
    sharded = read_run_records(run_dir)
    assert not sharded.warnings
    assert len(json.loads((run_dir / "submit.json").read_text())["jobs"]["2"]) == 2
    # The single-process run, pair for pair: every case once, every check ok, the same exact figures.
    assert main(["run", str(suite), "--out", str(tmp_path / "single")]) == 0
    single = {(r["case_id"], r["impl"]): r for r in read_jsonl(only_run_dir(tmp_path / "single") / "records.jsonl")}
    got = {(r.case_id, r.impl): r for r in sharded.records}
    assert sorted(got) == sorted(single) and len(sharded.records) == len(got)
    for key, record in got.items():
        assert record.status == single[key]["status"] == "ok"
        assert record.flops == single[key]["flops"] and record.error is not None
        assert record.error.rel_l2 <= record.error.tolerance


RANK_SUITE = {"name": "twonodes", "impls": ["cp_ring", "cp_sparse", "cp_usp", "tp_heads"],
              "defaults": {"heads": 4, "head_dim": 8, "seq_len": 64, "window": 8, "block_size": 8,
                           "device": "cpu", "world_size": 4},
              "sweep": {"pattern": ["local"]},
              "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "timeout_s": 120, "memory": "worker"}}


def test_a_rank_group_over_two_torchrun_nodes_counts_bytes_per_link(tmp_path):
    suite = write_suite(tmp_path, RANK_SUITE)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "bench", "run", str(suite), "--out", str(tmp_path / "results")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode == 0 for p in launchers), "\n".join(o[-2000:] for o in outputs)
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    assert {r["impl"] for r in records} == set(RANK_SUITE["impls"])
    golden = json.loads((Path(__file__).parent / "golden" / "record_schema.json").read_text())
    for r in records:
        assert r["status"] == "ok", r
        comm = r["comm"]
        assert sorted(comm) == golden["record:comm"] and sorted(comm["topology"]) == golden["record:comm.topology"]
        assert sorted(comm["by_link"]) == sorted(comm["expected_bytes_by_link"]) == golden["record:comm.by_link"]
        assert comm["topology"]["nodes"] == 2 and comm["topology"]["ranks_per_node"] == [2, 2]
        assert comm["topology"]["node_of_rank"] == [0, 0, 1, 1]
        assert comm["by_link"] == comm["expected_bytes_by_link"], r["impl"]
        assert comm["by_link"]["inter_node"] > 0
        assert sum(comm["by_link"].values()) == comm["bytes_total"] == comm["expected_bytes"]
    usp = next(r for r in records if r["impl"] == "cp_usp")
    assert usp["config"]["ulysses_groups"] == "inside nodes"


def test_a_rank_group_job_runs_its_ranks_as_srun_tasks(slurm, tmp_path):
    """The job `--nodes-per-rank-group K` submits per world size, here with K = 1 (one node is what this Slurm
    has): srun starts P tasks, bench.run.cluster.slurm_rank turns Slurm's variables into torchrun's, rank 0 leads."""
    from bench.run.cluster.executors import SlurmExecutor
    from bench.run.cluster.plan import SubmitPlan

    suite = write_suite(tmp_path, {**RANK_SUITE, "impls": ["cp_ring", "dense"],
                                   "defaults": {**RANK_SUITE["defaults"], "world_size": 2}})
    run_id = "20260101T000000-abc1234-twonodes"
    run_dir = tmp_path / "results" / run_id
    run_dir.mkdir(parents=True)
    plan = SubmitPlan(suite_file=str(suite), executor="slurm", run_id=run_id, out=str(tmp_path / "results"),
                      rank_groups=[2], shards=1, submitted_at="2026-01-01T00:00:00Z")
    os.environ["SLURM_CONF"] = slurm["SLURM_CONF"]  # the executor's sbatch and squeue read it
    try:
        executor = SlurmExecutor(None, 0, None)
        jobs = executor.start_all(1, plan, run_dir)  # the rank group alone: one job, no array
        deadline = time.monotonic() + 180
        while any(executor.state(j).kind != "ended" for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        del os.environ["SLURM_CONF"]
    assert "srun --kill-on-bad-exit=1" in (run_dir / "rank_group_p2.sbatch").read_text()
    group = {r["impl"]: r for r in read_jsonl(run_dir / "records.0of1.jsonl")}
    assert set(group) == {"cp_ring", "dense"} and group["dense"]["status"] == "skipped"  # dense has no ranks
    ring = group["cp_ring"]
    assert ring["status"] == "ok" and ring["params"]["world_size"] == 2, ring
    assert ring["comm"]["topology"]["ranks_per_node"] == [2]
    assert ring["comm"]["by_link"] == ring["comm"]["expected_bytes_by_link"]
