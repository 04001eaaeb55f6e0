"""Where `bench submit`'s shards run: processes on this machine, or a Slurm job array.

An executor starts a shard's job (`bench run SUITE --shard I/N --run-id ID --out DIR`) and tells its state:
pending, running or ended (how it ended is read from the run's records: a shard whose pairs are all there is
done, whatever its exit status), or unknown when it cannot tell (squeue failed): an unknown job is asked again,
never counted as ended. Jobs (`ShardJob`) are kept in the run's submit.json (bench.run.cluster.plan), so that
`bench submit --attach` can follow them from another process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from bench.errors import BadInput
from bench.results.store import utc_now
from bench.run.child import start_detached
from bench.run.cluster.plan import ExecutorSettings, ShardJob, SubmitPlan
from bench.run.cluster.shards import ShardSpec

NAMES = ("local", "slurm")
PROJECT_ROOT = Path(__file__).resolve().parents[3]  # the checkout: bench/run/cluster/ -> /
Kind = Literal["pending", "running", "ended", "unknown"]


@dataclass(frozen=True)
class State:
    kind: Kind
    why: str | None = None  # unknown: why the executor could not tell


class Executor(Protocol):
    def settings(self) -> ExecutorSettings: ...
    def start_all(self, count: int, plan: SubmitPlan, run_dir: Path) -> list[ShardJob]: ...
    def start(self, shard: ShardSpec, plan: SubmitPlan, run_dir: Path) -> ShardJob: ...
    def state(self, job: ShardJob) -> State: ...


def make(name: str, partition: str | None = None, gpus: int = 0, time_limit: str | None = None) -> Executor:
    if name == "local":
        return LocalExecutor()
    if name == "slurm":
        return SlurmExecutor(partition, gpus, time_limit)
    raise BadInput(f"got {name!r}; executors: {', '.join(NAMES)}", field="--executor")


def shard_command(shard_arg: str, plan: SubmitPlan, module: str = "bench") -> list[str]:
    command = [sys.executable, "-m", module, "run", plan.suite_file, "--shard", shard_arg, "--run-id",
               plan.run_id, "--out", plan.out]
    if plan.rank_groups:
        command.append("--rank-group-shards")
    for impl in plan.impls:
        command += ["--impl", impl]
    return command


class LocalExecutor:
    """Shards as processes of this machine, in their own sessions (they outlive `bench submit --no-wait`)."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}

    def settings(self) -> ExecutorSettings:
        return ExecutorSettings()

    def start_all(self, count: int, plan: SubmitPlan, run_dir: Path) -> list[ShardJob]:
        return [self.start(ShardSpec(i, count), plan, run_dir) for i in range(count)]

    def start(self, shard: ShardSpec, plan: SubmitPlan, run_dir: Path) -> ShardJob:
        log = run_dir / f"shard{shard.index}of{shard.count}.{utc_now()[:19].replace(':', '')}.log"
        proc = start_detached(shard_command(shard.label, plan), PROJECT_ROOT, log)
        self.procs[proc.pid] = proc
        return ShardJob(id=str(proc.pid), host=os.uname().nodename, log=str(log), started_at=utc_now())

    def state(self, job: ShardJob) -> State:
        pid = int(job.id)
        if pid in self.procs:  # ours: reap it
            return State("running" if self.procs[pid].poll() is None else "ended")
        if job.host != os.uname().nodename:
            raise BadInput(f"shard process {pid} ran on {job.host}; attach from that machine", field="--attach")
        try:  # started by another `bench submit`: alive while /proc shows it running our shard
            status = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return State("ended")
        return State("running" if status != "Z" and b"--shard" in cmdline else "ended")


class SlurmExecutor:
    """Shards as one Slurm job array (sbatch --array=0-(N-1)); a shard submitted again is an array of one."""

    def __init__(self, partition: str | None, gpus: int, time_limit: str | None) -> None:
        if shutil.which("sbatch") is None or shutil.which("squeue") is None:
            raise BadInput("no sbatch/squeue on PATH: --executor slurm needs Slurm's client commands where "
                           "`bench submit` runs; on one machine use --executor local", field="--executor")
        self.partition, self.gpus, self.time_limit = partition, gpus, time_limit

    def settings(self) -> ExecutorSettings:
        return ExecutorSettings(partition=self.partition, gpus=self.gpus, time_limit=self.time_limit)

    def script(self, plan: SubmitPlan, run_dir: Path) -> Path:
        """The batch script every shard's job runs; the array index is the shard."""
        count = plan.shards
        lines = ["#!/bin/bash", f"#SBATCH --job-name=bench-{Path(plan.suite_file).stem}",
                 f"#SBATCH --output={run_dir}/shard%aof{count}.%A_%a.log", "#SBATCH --ntasks=1"]
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        if self.gpus:
            lines.append(f"#SBATCH --gpus={self.gpus}")
        if self.time_limit:
            lines.append(f"#SBATCH --time={self.time_limit}")
        command = " ".join(_quote(a) for a in shard_command(f"${{SLURM_ARRAY_TASK_ID}}/{count}", plan))
        lines += [f"cd {_quote(str(PROJECT_ROOT))}", f"exec {command}", ""]
        path = run_dir / "shard.sbatch"
        path.write_text("\n".join(lines), encoding="utf-8")
        return path

    def rank_group_script(self, shard: ShardSpec, world_size: int, plan: SubmitPlan, run_dir: Path) -> Path:
        """The batch script of one rank group: P tasks over K nodes (P/K per node), started by srun; task 0's
        node is the rendezvous (torch.distributed's env:// with Slurm's variables, bench.run.cluster.slurm_rank)."""
        nodes = plan.nodes_per_rank_group
        lines = ["#!/bin/bash", f"#SBATCH --job-name=bench-{Path(plan.suite_file).stem}-p{world_size}",
                 f"#SBATCH --output={run_dir}/shard{shard.index}of{shard.count}.%j.log", f"#SBATCH --nodes={nodes}",
                 f"#SBATCH --ntasks={world_size}", f"#SBATCH --ntasks-per-node={world_size // nodes}"]
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        if self.gpus:
            lines.append("#SBATCH --gpus-per-task=1")  # one GPU per rank
        if self.time_limit:
            lines.append(f"#SBATCH --time={self.time_limit}")
        command = " ".join(_quote(a) for a in shard_command(shard.label, plan,
                                                            module="bench.run.cluster.slurm_rank"))
        lines += [f"cd {_quote(str(PROJECT_ROOT))}",
                  'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                  "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
                  f"exec srun --kill-on-bad-exit=1 {command}", ""]
        path = run_dir / f"rank_group_p{world_size}.sbatch"
        path.write_text("\n".join(lines), encoding="utf-8")
        return path

    def _rank_group(self, shard: ShardSpec, plan: SubmitPlan, run_dir: Path) -> ShardJob:
        world_size = plan.rank_groups[shard.index]
        script = self.rank_group_script(shard, world_size, plan, run_dir)
        return ShardJob(id=self._run_sbatch([str(script)], script), started_at=utc_now())

    def _sbatch(self, array: str, plan: SubmitPlan, run_dir: Path) -> str:
        script = self.script(plan, run_dir)
        return self._run_sbatch([f"--array={array}", str(script)], script)

    def _run_sbatch(self, args: list[str], script: Path) -> str:
        proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise BadInput(f"sbatch refused the shards: {proc.stderr.strip() or proc.stdout.strip()}",
                           file=str(script), field="--executor")
        return proc.stdout.strip().split(";")[0]  # "jobid" or "jobid;cluster"

    def start_all(self, count: int, plan: SubmitPlan, run_dir: Path) -> list[ShardJob]:
        groups = len(plan.rank_groups)  # shards 0..G-1: rank groups, each a job of its own
        jobs = [self._rank_group(ShardSpec(g, count), plan, run_dir) for g in range(groups)]
        if count > groups:
            job = self._sbatch(f"{groups}-{count - 1}", plan, run_dir)
            jobs += [ShardJob(id=f"{job}_{i}", started_at=utc_now()) for i in range(groups, count)]
        return jobs

    def start(self, shard: ShardSpec, plan: SubmitPlan, run_dir: Path) -> ShardJob:
        if shard.index < len(plan.rank_groups):
            return self._rank_group(shard, plan, run_dir)
        job = self._sbatch(str(shard.index), plan, run_dir)
        return ShardJob(id=f"{job}_{shard.index}", started_at=utc_now())

    def state(self, job: ShardJob) -> State:
        try:
            proc = subprocess.run(["squeue", "-h", "-j", job.id, "-o", "%T"], capture_output=True, text=True,
                                  timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return State("unknown", f"squeue did not answer: {exc}")
        if proc.returncode != 0:
            # a job Slurm no longer knows (purged after it ended) is an error of squeue's that names it
            if "Invalid job id" in proc.stderr:
                return State("ended")
            return State("unknown", f"squeue failed (exit {proc.returncode}): {proc.stderr.strip()[:200]}")
        state = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
        if state in ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"):
            return State("pending")
        if state in ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"):
            return State("running")
        return State("ended")  # gone from the queue: how it ended shows in the records


def _quote(arg: str) -> str:
    if arg.startswith("${SLURM_ARRAY_TASK_ID}"):
        return arg  # expanded by the shell
    import shlex

    return shlex.quote(arg)
