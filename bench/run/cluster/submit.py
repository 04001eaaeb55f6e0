"""`bench submit`: a suite's shards run by an executor (local processes, or a Slurm job array), watched to the end.

The run directory is made here (its id fixed before any shard starts) and `submit.json` in it says how the shards
run: the suite file, the executor, N, each shard's jobs. Every shard is `bench run SUITE --shard I/N --run-id ID`.
While it waits, a line summarises the shards (pending, running, done, failed) whenever it changes. A shard whose
job ended with pairs of its part still missing (killed, cancelled, out of time, a node lost) is submitted again,
for those pairs only, up to MAX_ATTEMPTS jobs in all; after that its missing pairs are written as `failed`
records naming the shard and its jobs, so every pair ends with a record. `--no-wait` returns once the shards are
submitted; `bench submit --attach RUN_DIR` watches (and finishes) a run later, from submit.json. The exit code is
`bench run`'s for the whole run: 0, or 1 when a record is failed or incorrect.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from bench.errors import BadInput
from bench.measure.machine.env import git_info
from bench.results.store import (
    RecordWriter,
    create_run_dir,
    read_run_info,
    read_run_records,
    utc_now,
)
from bench.run.cluster import executors
from bench.run.cluster.plan import SubmitPlan, read_plan
from bench.run.cluster.shards import PartLock, ShardSpec, split, split_rank_groups
from bench.run.identity import record_git
from bench.run.runner import Pair, failed_record, select_impls
from bench.spec.suite import Suite, load_suite

UNKNOWN_REPORT_AFTER = 3  # polls in a row a job's state could not be read before it is reported
MAX_ATTEMPTS = 3  # jobs per shard: the first and two resubmissions of its missing pairs
POLL_S = 1.0


@dataclass
class SubmitOptions:
    suite: Path | None
    executor: str = "local"
    shards: int = 2
    partition: str | None = None
    gpus_per_shard: int = 0
    time_limit: str | None = None
    nodes_per_rank_group: int = 1
    out: Path = Path("results")
    no_wait: bool = False
    attach: Path | None = None
    impls: list[str] = field(default_factory=list)


def submit(options: SubmitOptions, console: Console) -> int:
    if options.attach is not None:
        return watch(options.attach, console)
    if options.suite is None:
        raise BadInput("give SUITE.yaml, or --attach RUN_DIR", field="SUITE")
    if options.executor not in executors.NAMES:
        raise BadInput(f"got {options.executor!r}; executors: {', '.join(executors.NAMES)}", field="--executor")
    if options.shards < 1:
        raise BadInput(f"got {options.shards}; at least 1 shard", field="--shards")
    if options.nodes_per_rank_group < 1:
        raise BadInput(f"got {options.nodes_per_rank_group}; at least 1 node", field="--nodes-per-rank-group")
    if options.nodes_per_rank_group > 1 and options.executor != "slurm":
        raise BadInput(f"got {options.nodes_per_rank_group} with --executor {options.executor}: rank groups across "
                       "nodes need --executor slurm (local shards run on this machine)", field="--nodes-per-rank-group")
    suite_path = options.suite.resolve()
    suite = load_suite(suite_path)
    select_impls(suite, options.impls)
    rank_groups = _rank_groups(suite, options) if options.nodes_per_rank_group > 1 else []
    executor = executors.make(options.executor, partition=options.partition, gpus=options.gpus_per_shard,
                              time_limit=options.time_limit)  # BadInput without sbatch on PATH
    run_id, run_dir = create_run_dir(options.out, suite.name, git_info().commit or "nogit")
    plan = SubmitPlan(suite_file=str(suite_path), executor=options.executor,
                      shards=options.shards + len(rank_groups), rank_groups=rank_groups,
                      nodes_per_rank_group=options.nodes_per_rank_group, impls=options.impls,
                      out=str(options.out.resolve()), run_id=run_id, settings=executor.settings(),
                      submitted_at=utc_now())
    for index, job in enumerate(executor.start_all(plan.shards, plan, run_dir)):
        plan.jobs[str(index)] = [job]
    plan.write(run_dir)
    groups = f" (rank groups P={rank_groups} across {options.nodes_per_rank_group} nodes each)" if rank_groups else ""
    console.print(f"submitted {plan.shards} shards{groups} of {suite.name} ({options.executor}): {run_dir}")
    if options.no_wait:
        console.print(f"watch or finish it with: bench submit --attach {run_dir}")
        return 0
    return watch(run_dir, console)


def _rank_groups(suite: Suite, options: SubmitOptions) -> list[int]:
    """The world sizes above 1, ascending: each a rank-group shard of P tasks over K nodes."""
    k = options.nodes_per_rank_group
    sizes = sorted({c.world_size for c in suite.cases if c.world_size > 1})
    uneven = [p for p in sizes if p % k or p < k]
    if uneven:
        raise BadInput(f"got {k} nodes per rank group; world sizes {uneven} do not split evenly over {k} nodes",
                       field="--nodes-per-rank-group")
    return sizes


def shard_pairs(suite: Suite, impls: list[str], count: int, rank_groups: bool = False) -> list[list[Pair]]:
    pairs = [Pair(case, impl) for case in suite.cases for impl in select_impls(suite, impls)]
    splitter = split_rank_groups if rank_groups else split
    return [[pairs[i] for i in part] for part in splitter([p.case.world_size for p in pairs], count)]


def watch(run_dir: Path, console: Console, sleep: Callable[[float], None] = time.sleep) -> int:
    """Follow every shard to its end, resubmitting the ones that died; the run's exit code."""
    run_dir = run_dir.resolve()
    plan = read_plan(run_dir)
    suite = load_suite(Path(plan.suite_file))
    if (run_dir / "run.json").exists():
        info = read_run_info(run_dir)
        if info.suite.name != suite.name or info.suite.content != suite.content:
            raise BadInput(f"{plan.suite_file} no longer holds the suite this run was made from (its shards would "
                           "refuse it); restore it, or submit the new suite as a new run", file=str(run_dir),
                           field="--attach")
    executor = executors.make(plan.executor, **plan.settings.model_dump())
    count = plan.shards
    parts = shard_pairs(suite, plan.impls, count, bool(plan.rank_groups))
    last = ""
    unknown: dict[int, int] = {}  # shard -> polls in a row its job's state could not be read
    while True:
        held = {(r.case_id, r.impl) for r in read_run_records(run_dir).records}
        states: dict[str, int] = {"pending": 0, "running": 0, "unknown": 0, "done": 0, "failed": 0}
        active = False
        for index in range(count):
            jobs = plan.jobs_of(index)
            state = executor.state(jobs[-1])
            missing = [p for p in parts[index] if p.key not in held]
            unknown[index] = unknown.get(index, 0) + 1 if state.kind == "unknown" else 0
            if state.kind == "unknown":  # asked again next poll, never taken for ended
                if unknown[index] == UNKNOWN_REPORT_AFTER:
                    console.print(f"[yellow]shard {index}/{count}:[/] the state of job {jobs[-1].id} could not be "
                                  f"read {unknown[index]} times in a row ({state.why}); still waiting for it")
                states["unknown"] += 1
                active = True
            elif state.kind in ("pending", "running"):
                states[state.kind] += 1
                active = True
            elif not missing:
                states["done"] += 1
            elif len(jobs) < MAX_ATTEMPTS:
                console.print(f"shard {index}/{count}: job {jobs[-1].id} ended with {len(missing)} pairs "
                              f"missing; submitting it again ({len(jobs) + 1} of {MAX_ATTEMPTS})")
                jobs.append(executor.start(ShardSpec(index, count), plan, run_dir))
                plan.write(run_dir)
                states["pending"] += 1
                active = True
            else:
                states["failed"] += 1
        line = ", ".join(f"{n} {name}" for name, n in states.items())
        if line != last:
            console.print(f"{time.strftime('%H:%M:%S')} shards: {line}")
            last = line
        if not active:
            break
        sleep(POLL_S)
    _record_lost_pairs(run_dir, plan, parts, console)
    records = read_run_records(run_dir).records
    bad = [r for r in records if r.status in ("failed", "incorrect")]
    console.print(f"{len(records)} records, {len(bad)} failed or incorrect: {run_dir}")
    return 1 if bad else 0


def _record_lost_pairs(run_dir: Path, plan: SubmitPlan, parts: list[list[Pair]], console: Console) -> None:
    """A `failed` record for each pair no job of its shard measured (into that shard's part, under its lock)."""
    held = {(r.case_id, r.impl) for r in read_run_records(run_dir).records}
    count = len(parts)
    for index, pairs in enumerate(parts):
        missing = [p for p in pairs if p.key not in held]
        if not missing:
            continue
        shard = ShardSpec(index, count)
        jobs = ", ".join(j.id for j in plan.jobs_of(index))
        reason = (f"shard {shard.label} was not measured: its {len(plan.jobs_of(index))} jobs ({jobs}) ended "
                  f"without it; logs in {run_dir}")
        lock = PartLock(run_dir, shard)
        try:
            stored = read_run_info(run_dir).env
            with RecordWriter(run_dir / shard.part, record_git(stored.git), stored.code) as writer:
                for pair in missing:
                    writer.append(failed_record(pair, reason, utc_now(), "died"))
        finally:
            lock.release()
        console.print(f"[red]shard {shard.label}:[/] {len(missing)} pairs recorded as failed ({reason})")
