"""`bench run`: sweep a suite's (case, impl) pairs, each measured in an isolated worker, records to disk.

Isolation: a worker process measures pairs one after another; when one times out or kills its process, the
runner records it as failed, kills the worker's process group and starts a fresh worker for the next pair. A
worker that cannot start at all (a plugin that fails to import inside it) gives a `failed` record with that
cause for each pair it was to measure. Every record is appended to records.jsonl and fsynced as soon as it
exists, so a run killed at any moment keeps everything measured so far, and `--resume` measures only what is
missing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from bench import registry
from bench.errors import BadInput
from bench.measure.machine.contention import machine_load
from bench.measure.machine.env import capture, git_info, measured_code
from bench.measure.task import MeasureSettings, Task
from bench.results.environment import RunLoad
from bench.results.records import Record, RunInfo, SuiteInfo
from bench.results.store import (
    RECORDS,
    RUN_JSON,
    RecordWriter,
    create_run_dir,
    drop_torn_tail,
    read_run_info,
    read_run_records,
    utc_now,
    write_json_atomic,
)
from bench.run import calibration, torchrun
from bench.run.cluster import shards
from bench.run.cluster.shards import PartLock, ShardSpec
from bench.run.console import Reporter, print_summary
from bench.run.identity import check_run_id, check_same_run, record_git
from bench.run.preflight import check_new_run_id, check_out, plan_pairs, print_preflight
from bench.run.ranks import run_pair, simulated_ranks_per_node
from bench.run.tasks import Pair, backend_of, failed_record, plugin_specs, select_impls, task_for
from bench.run.worker import WorkerProcess, WorkerStartError
from bench.spec.case import resolve_device
from bench.spec.suite import Suite, load_suite


@dataclass
class RunOptions:
    suite: Path | Suite  # a suite file, or one parsed already (bench.api.run)
    impls: list[str] = field(default_factory=list)  # --impl: only these of the suite's implementations
    add_impls: list[str] = field(default_factory=list)  # --add-impl: implementations outside the suite, added
    device: str | None = None  # --device: overrides every case's device
    out: Path = Path("results")
    resume: Path | None = None
    dry_run: bool = False
    shard: ShardSpec | None = None  # --shard I/N: this process measures that part of the pairs
    run_id: str | None = None  # --run-id: the run the shards share
    rank_group_shards: bool = False  # --rank-group-shards: each world size above 1 a shard of its own, first


# CUDA errors after which the process's context is unusable: every later kernel launch fails with the same error.
STICKY_DEVICE_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                        "misaligned address", "illegal instruction", "an illegal address")


def breaks_the_device(reason: str | None) -> bool:
    """Whether a failed pair's reason is a CUDA error that leaves its worker's context broken."""
    return reason is not None and any(words in reason for words in STICKY_DEVICE_ERRORS)


class PairMeasurer:
    """Measures single-process pairs in one warm worker, replacing it after a crash or a timeout."""

    def __init__(self, plugins: list[tuple[str, str | None]], log_path: Path | None, timeout_s: float) -> None:
        self.plugins, self.log_path, self.timeout_s = plugins, log_path, timeout_s
        self.worker: WorkerProcess | None = None
        self.start_failure: str | None = None  # the cause, once a worker could not start: the same for the rest

    def measure(self, pair: Pair, task: Task, started: str) -> Record:
        if self.start_failure is not None:
            return failed_record(pair, self.start_failure, started, "startup")
        if self.worker is None:
            try:
                self.worker = WorkerProcess(self.plugins, self.log_path)
            except WorkerStartError as exc:
                self.start_failure = exc.reason
                return failed_record(pair, exc.reason, started, "startup")
        outcome = self.worker.run(task, self.timeout_s)
        if outcome.record is not None:
            record = Record.model_validate(outcome.record)
            if record.status == "failed" and breaks_the_device(record.reason):
                self.worker.close()  # every later call in its CUDA context would fail the same way
                self.worker = None
            return record
        self.worker = None  # it was killed; the next pair gets a fresh one
        return failed_record(pair, outcome.failure or "worker failed", started, outcome.kind)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def run(options: RunOptions, console: Console, on_record: Callable[[Record], None] | None = None) -> int:
    """Run a suite; returns the exit code (0 all ok or skipped, 1 any failed or incorrect)."""
    suite = load_suite(options.suite) if isinstance(options.suite, Path) else options.suite
    impls = select_impls(suite, options.impls, options.add_impls)
    pairs = [Pair(case, impl) for case in suite.cases for impl in impls]
    every_pair = {p.key for p in pairs}
    if options.shard is not None:
        splitter = shards.split_rank_groups if options.rank_group_shards else shards.split
        chosen = splitter([p.case.world_size for p in pairs], options.shard.count)[options.shard.index]
        pairs = [pairs[i] for i in chosen]
    # Everything a run may refuse, refused before anything is written, and the same under --dry-run
    simulated_ranks_per_node()  # a bad BENCH_RANKS_PER_NODE
    check_out(options.out)
    if options.run_id is not None and options.shard is None:  # a plain run makes a new run of its id
        check_new_run_id(options.out, options.run_id)
    elif options.run_id is not None:  # shards join the run of their id
        check_run_id(options.run_id)
    if options.resume is not None:
        _check_resume_target(options, suite)
    if options.dry_run:
        return _dry_run(options, suite, impls, pairs, console)

    session = torchrun.Session(suite.measure.timeout_s, backend_of(suite, options.device) == "cuda") \
        if torchrun.launched() else None
    if session is not None and not session.leader:
        return session.follow()  # the leader (rank 0) announces each pair and writes every record

    target = _open_target(options, suite, console)
    mine = {p.key for p in pairs}
    done = {(r.case_id, r.impl) for r in target.existing}
    todo = [p for p in pairs if p.key not in done]
    existing = [r for r in target.existing if (r.case_id, r.impl) in mine]  # a shard reports on its own pairs
    _build_ahead(impls, todo, options.device, console)
    try:
        new_records = _measure_pairs(todo, suite, options, target, session, console, on_record)
    finally:
        if session is not None:
            session.finish()
        if target.lock is not None:
            target.lock.release()
    _finish(target.run_dir, every_pair if options.shard is not None else None)
    all_records = existing + new_records
    print_summary(console, all_records, {c.case_id: c.label for c in suite.cases}, impls)
    console.print(f"results: {target.run_dir}")
    return 1 if any(r.status in ("failed", "incorrect") for r in all_records) else 0


@dataclass
class _Target:
    """Where a run's records go: the run directory, the records file (a shard's part), the records the run held
    already, and a shard's lock on its part."""

    run_dir: Path
    records_file: str
    existing: list[Record]
    lock: PartLock | None = None


def _open_target(options: RunOptions, suite: Suite, console: Console) -> _Target:
    """A new run, a resumed one, or a shard's part of a shared one (each checked for the same identity)."""
    if options.shard is not None:
        run_dir = _join_shard_run(options, suite, console)
        lock = PartLock(run_dir, options.shard)  # refused while another process writes this part
        return _Target(run_dir, options.shard.part, _read_existing(run_dir, options.shard.part, console), lock)
    if options.resume is not None:
        run_dir, existing = _open_for_resume(options, suite, console)
        return _Target(run_dir, RECORDS, existing)
    return _Target(_create_run(options, suite, console), RECORDS, [])


def _measure_pairs(todo: list[Pair], suite: Suite, options: RunOptions, target: _Target,
                   session: torchrun.Session | None, console: Console,
                   on_record: Callable[[Record], None] | None) -> list[Record]:
    """Measure each pair (a worker for single-process pairs, fresh ranks or torchrun's for distributed ones),
    each record appended to disk as soon as it exists."""
    run_dir = target.run_dir
    info = read_run_info(run_dir)
    labels = {c.case_id: c.label for c in suite.cases}
    plugins = plugin_specs(suite)
    settings = MeasureSettings(**suite.measure.model_dump(), calibration=info.env.calibration)
    reporter = Reporter(len(todo), console)
    previous_run_dir = os.environ.get(registry.RUN_DIR_ENV)
    os.environ[registry.RUN_DIR_ENV] = str(run_dir)  # children inherit it: logs they write belong to the run
    new_records: list[Record] = []
    measurer = PairMeasurer(plugins, run_dir / "worker.log", suite.measure.timeout_s)
    try:
        with RecordWriter(run_dir / target.records_file, record_git(info.env.git), info.env.code) as writer:
            for pair in todo:
                task = task_for(pair, options.device, settings)
                reporter.start(labels[pair.case.case_id], pair.impl)
                started = utc_now()
                # Under torchrun the launcher's ranks measure it; None: a single-process pair, for the worker.
                record = session.measure(task) if session is not None else None
                if record is None and task.case["world_size"] > 1:
                    record = run_pair(task, plugins, suite.measure.timeout_s, run_dir / "ranks.log")
                elif record is None:
                    record = measurer.measure(pair, task, started)
                writer.append(record)
                new_records.append(record)
                reporter.finish(labels[pair.case.case_id], record)
                if on_record is not None:
                    on_record(record)
    finally:
        reporter.close()
        measurer.close()
        if previous_run_dir is None:
            os.environ.pop(registry.RUN_DIR_ENV, None)
        else:
            os.environ[registry.RUN_DIR_ENV] = previous_run_dir
    return new_records


def _build_ahead(impls: list[str], todo: list[Pair], device: str | None, console: Console) -> None:
    """Let each implementation compile its extensions before the first pair starts its timeout."""
    for name in impls:
        devices = {resolve_device(device or p.case.device) for p in todo if p.impl == name}
        if devices:
            started = time.monotonic()
            registry.get(name).build_ahead(devices)
            if time.monotonic() - started > 5:
                console.print(f"{name}: built its extensions in {time.monotonic() - started:.0f} s "
                              "(before the first pair; cached for later runs)")


def _finish(run_dir: Path, every_pair: set[tuple[str, str]] | None) -> None:
    """Set finished_at: at once for a whole run; for a shard once every part together holds every pair."""
    with shards.run_lock(run_dir):
        if every_pair is not None:
            held = {(r.case_id, r.impl) for r in read_run_records(run_dir).records}
            if not every_pair <= held:
                return
        info = read_run_info(run_dir)
        start = info.env.load.start if info.env.load else None
        env = info.env.model_copy(update={"load": RunLoad(start=start, end=machine_load())})
        finished = info.model_copy(update={"env": env}).model_dump(mode="json", by_alias=True)
        write_json_atomic(run_dir / RUN_JSON, {**finished, "finished_at": utc_now()})


def _join_shard_run(options: RunOptions, suite: Suite, console: Console) -> Path:
    """The shards' shared run directory: made by the first shard (run.json under the run's lock), checked by
    the others against the suite."""
    if options.resume is not None:
        run_dir = options.resume
        if not (run_dir / RUN_JSON).is_file():
            raise BadInput("not a run directory (no run.json)", file=str(run_dir), field="--resume")
    else:
        env_commit = git_info().commit if options.run_id is None else None
        run_id = check_run_id(options.run_id) if options.run_id is not None \
            else shards.derived_run_id(suite.name, env_commit)
        run_dir = options.out / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
    with shards.run_lock(run_dir):
        if not (run_dir / RUN_JSON).exists():
            _write_run_info(options, suite, console, run_dir.name, run_dir)
    _check_same_run(run_dir, suite, options.device, "--run-id" if options.resume is None else "--resume")
    return run_dir


def _create_run(options: RunOptions, suite: Suite, console: Console) -> Path:
    if options.run_id is not None:  # a name given by hand: a new run, never a join (that is --resume)
        run_id, run_dir = options.run_id, check_new_run_id(options.out, options.run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_id, run_dir = create_run_dir(options.out, suite.name, git_info().commit or "nogit")
    _write_run_info(options, suite, console, run_id, run_dir)
    (run_dir / RECORDS).touch()
    return run_dir


def _write_run_info(options: RunOptions, suite: Suite, console: Console, run_id: str, run_dir: Path) -> None:
    backend = backend_of(suite, options.device)
    env = capture(backend=backend)
    env = env.model_copy(update={"load": RunLoad(start=machine_load()), "code": _code_of(suite)})
    if suite.measure.calibrate:
        console.print(f"calibrating {backend} (measure.calibrate: true): matmul rates and copy bandwidth")
    # float32 always: the roof of 16-bit dtypes on a CPU that widens them (bench.measure.machine.calibrate.NATIVE_DOT)
    dtypes = sorted({c.dtype for c in suite.cases} | {"float32"})
    calibrated = calibration.for_run(suite.measure.calibrate, backend, dtypes, options.out, env.fingerprint or "")
    if calibrated is not None:
        env = env.model_copy(update={"calibration": calibrated})
        if calibrated.error:
            console.print(f"[yellow]warning:[/] {calibrated.error}; peaks fall back to datasheets")
    suite_file = str(suite.path) if suite.path else None
    info = RunInfo(run_id=run_id, suite=SuiteInfo(name=suite.name, file=suite_file, content=suite.content),
                   started_at=utc_now(), finished_at=None, env=env, command=sys.argv[1:] or None)
    write_json_atomic(run_dir / RUN_JSON, info.model_dump(mode="json", by_alias=True))


def _check_same_run(run_dir: Path, suite: Suite, device: str | None, option: str) -> None:
    """BadInput naming what differs when this process may not add records to the run (bench.run.identity)."""
    here = capture(backend=backend_of(suite, device)).model_copy(update={"code": _code_of(suite)})
    check_same_run(read_run_info(run_dir), suite, here, str(run_dir), option)


def _code_of(suite: Suite) -> dict[str, str] | None:
    """The digests of the suite's measured code outside git (bench.measure.machine.env.measured_code); None when
    none."""
    return measured_code(suite.plugins, suite.path.parent if suite.path else None) or None


def _read_existing(run_dir: Path, own: str, console: Console) -> list[Record]:
    """Every part's records (one per pair), after dropping a torn last line of this process's own part (a torn
    line of another part is a write still under way, and is read as not yet there)."""
    torn = drop_torn_tail(run_dir / own)
    if torn:
        console.print(f"[yellow]warning:[/] {run_dir / own}: dropped a torn last line ({torn} bytes); "
                      "its (case, impl) will be measured again")
    return read_run_records(run_dir).records


def _check_resume_target(options: RunOptions, suite: Suite) -> None:
    """A run directory of this suite, made by this code on this machine (bench.run.identity)."""
    run_dir = options.resume
    assert run_dir is not None
    if not (run_dir / RUN_JSON).is_file():
        raise BadInput("not a run directory (no run.json); --resume takes a run directory to add the missing pairs "
                       "to", file=str(run_dir), field="--resume")
    _check_same_run(run_dir, suite, options.device, "--resume")


def _open_for_resume(options: RunOptions, suite: Suite, console: Console) -> tuple[Path, list[Record]]:
    assert options.resume is not None  # checked by _check_resume_target
    # One record per pair over every part; if an earlier resume raced, the first written wins.
    return options.resume, _read_existing(options.resume, RECORDS, console)


def _dry_run(options: RunOptions, suite: Suite, impls: list[str], pairs: list[Pair], console: Console) -> int:
    """The plan of a run whose options all passed the real run's checks: the pairs it would measure (with
    --resume, the missing ones) and the skips it can predict."""
    done: set[tuple[str, str]] = set()
    if options.resume is not None:
        done = {(r.case_id, r.impl) for r in read_run_records(options.resume).records}
    todo = [p for p in pairs if p.key not in done]
    print_preflight(console, suite, impls, plan_pairs(todo, options.device), device=options.device,
                    already=len(pairs) - len(todo), resume=options.resume,
                    shard_pairs=len(pairs) if options.shard else None, added=options.add_impls)
    return 0
