"""`bench ab`'s pieces shared by the run (bench.run.ab.command) and the pair measurement (bench.run.ab.pairs): the
options, one side's worker (`Side`), and what a measurement produces (`SideRun`, `PairMeasurement`,
`ABMeasurement`).

Both sides' workers are pinned to the same CPUs (with --threads N > 0: the last N CPUs this process may use).
Within a round the two blocks then run back to back on the same cores, so whatever else the machine runs falls
on both alike; unpinned, the scheduler can leave one worker beside another busy process for seconds, which on
the shared 2-core machine read as a 40% "difference" between two copies of the same commit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.errors import BadInput
from bench.results.environment import Environment
from bench.results.records import FailureKind, Record
from bench.results.store import RecordWriter
from bench.run import messages
from bench.run.ab.worktrees import Checkout
from bench.run.child import STARTUP_TIMEOUT_S
from bench.run.worker import WorkerProcess, WorkerStartError

DEFAULT_ROUNDS = 15
# Rounds are added to a pair whose verdict is still open, one trial of R rounds at a time on fresh workers, up to
# this many times R (--max-rounds) and while the run has not taken BUDGET_FACTOR times its first pass (--budget-s).
DEFAULT_MAX_ROUNDS_FACTOR = 3
BUDGET_FACTOR = 1.75
# A block is at least this long and this many calls: long enough that its median ignores a call or two cut by
# the scheduler (a time slice is a few ms; 5 ms blocks of 1 ms calls gave per-round ratios from 0.1 to 5 on the
# loaded 2-core machine), short enough that the rounds of a pair lie within a second or two.
DEFAULT_BLOCK_S = 0.02
DEFAULT_BLOCK_CALLS = 5
WARM_BLOCKS = 4  # untimed warm-up per side before the rounds, in block lengths
# Intra-op threads per worker (--threads; 0: torch's default, one per core). One: an op on two threads runs at
# the speed of the slower thread, and where the OS puts each thread beside other load differs between the two
# workers and persists for seconds; on the shared 2-core machine that made the two sides of an A/A run differ by
# up to 50% per pair with two threads, and by a few percent with one.
DEFAULT_THREADS = 1
# With two warm workers the idle one's OpenMP threads would spin (libgomp's default wait policy) on the cores the
# other is being timed on; passive waiting on both sides, unless the caller's environment chose a policy.
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
LOAD_TIMEOUT_S = 600.0  # importing plugins and expanding a suite
RANKS_SLACK_S = STARTUP_TIMEOUT_S + 60.0  # a distributed pair's ranks start, then run the case's timeout_s
Key = tuple[str, str]  # (case_id, impl)

# How a pair was measured (PairMeasurement.mode)
INTERLEAVED, INTERPRETER, DISTRIBUTED, ENDED, ONE_SIDE = "interleaved", "interpreter", "distributed", "ended", \
    "one_side"


@dataclass
class ABOptions:
    base: str
    new: str
    suite: str
    rounds: int = DEFAULT_ROUNDS
    impls: list[str] = field(default_factory=list)
    out: Path = Path("results")
    device: str | None = None
    block_s: float = DEFAULT_BLOCK_S
    block_calls: int = DEFAULT_BLOCK_CALLS
    seed: int = 0
    threads: int = DEFAULT_THREADS  # intra-op threads per worker; 0: torch's default
    cwd: Path | None = None  # default: the current directory
    max_rounds: int | None = None  # default: DEFAULT_MAX_ROUNDS_FACTOR x rounds
    budget_s: float | None = None  # no look is added past this wall time; default: BUDGET_FACTOR x the first pass

    def check(self) -> None:
        if not 2 <= self.rounds <= 10_000:
            raise BadInput(f"got {self.rounds}; rounds from 2 to 10000 (each round times both sides once)",
                           field="--rounds")
        if self.max_rounds is not None and not self.rounds <= self.max_rounds <= 100_000:
            raise BadInput(f"got {self.max_rounds}; at least --rounds ({self.rounds}) and at most 100000",
                           field="--max-rounds")
        if self.budget_s is not None and not self.budget_s >= 0:
            raise BadInput(f"got {self.budget_s:g}; seconds >= 0", field="--budget-s")
        if not 0 <= self.block_s <= 60:
            raise BadInput(f"got {self.block_s * 1e3:g} ms; a block length from 0 to 60000 ms", field="--block-ms")
        if not 1 <= self.block_calls <= 1_000_000:
            raise BadInput(f"got {self.block_calls}; at least 1 call per block", field="--block-calls")
        if not 0 <= self.threads <= 4096:
            raise BadInput(f"got {self.threads}; a thread count >= 1, or 0 for torch's default", field="--threads")

    def looks(self) -> list[int]:
        return planned_looks(self.rounds, self.max_rounds if self.max_rounds is not None
                             else DEFAULT_MAX_ROUNDS_FACTOR * self.rounds)

    def worker_env(self) -> dict[str, str]:
        """What both sides' workers get on top of this process's environment (besides PYTHONPATH)."""
        env = {k: v for k, v in WORKER_ENV.items() if k not in os.environ}
        if self.threads > 0:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        return env


@dataclass
class SideRun:
    """One side after the run: where its code ran, what its suite was, its run directory and records."""

    checkout: Checkout
    suite_name: str
    suite_file: str | None
    root: str
    run_dir: Path
    run_id: str
    env: Environment
    records: dict[Key, Record] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # case_id -> short label, as this side's code wrote it
    unknown_impls: list[str] = field(default_factory=list)


@dataclass
class PairMeasurement:
    """One (case, impl) of both sides (or of one side: `mode` one_side)."""

    case_id: str
    impl: str
    label: str
    mode: str
    base: Record | None
    new: Record | None
    rounds: list[tuple[list[float], list[float]]] = field(default_factory=list)  # (BASE, NEW) samples per round
    orders: list[str] = field(default_factory=list)  # per round: "BN" (BASE first) or "NB"
    note: str | None = None
    # later trials (fresh workers, after every pair), one per look added while the pair's verdict was open
    more_trials: list[list[tuple[list[float], list[float]]]] = field(default_factory=list)
    more_orders: list[list[str]] = field(default_factory=list)
    # each later trial's (BASE, NEW) records as its close returned them: not written, read for their contention
    more_records: list[tuple[Record | None, Record | None]] = field(default_factory=list)

    def trials(self) -> list[list[tuple[list[float], list[float]]]]:
        return [self.rounds, *self.more_trials] if self.rounds else []

    @property
    def key(self) -> Key:
        return (self.case_id, self.impl)


@dataclass
class ABMeasurement:
    base: SideRun
    new: SideRun
    pairs: list[PairMeasurement]  # in both sides
    only_base: list[PairMeasurement]
    only_new: list[PairMeasurement]
    rounds: int
    block_s: float
    block_calls: int
    wall_s: float
    threads: int = DEFAULT_THREADS
    cpus: list[int] | None = None  # the CPUs both workers were pinned to (None: not pinned)
    looks: list[int] = field(default_factory=list)  # rounds at each planned look; default [rounds]
    budget_s: float | None = None  # the wall time past which no look was added
    left_open: int = 0  # pairs whose verdict was still open when the budget ran out

    def planned_looks(self) -> list[int]:
        return self.looks or [self.rounds]


def planned_looks(rounds: int, max_rounds: int) -> list[int]:
    """Rounds seen at each look: R, 2R, ... below max_rounds, then max_rounds (just [R] when max_rounds <= R)."""
    looks = list(range(rounds, max_rounds, rounds)) or [rounds]
    if max_rounds > looks[-1]:
        looks.append(max_rounds)
    return looks


# --- one side's worker ---------------------------------------------------------------------------------------


class Side:
    """A checkout's worker, restarted after a crash or a timeout, plus its run directory once the suite is known."""

    def __init__(self, checkout: Checkout, log: Path, out: Path, env: dict[str, str],
                 cpus: list[int] | None = None) -> None:
        self.checkout, self.log, self.out, self.env, self.cpus = checkout, log, out, env, cpus
        self.plugins: list[tuple[str, str | None]] = []
        self.worker: WorkerProcess | None = None
        self.start_failure: str | None = None
        self.loaded: messages.SuiteLoaded | None = None
        self.writer: RecordWriter | None = None
        self.run: SideRun | None = None

    def start(self) -> WorkerProcess | None:
        """The warm worker (started if needed), or None with `start_failure` set."""
        if self.worker is None and self.start_failure is None:
            self.spawn()
            self.ready()
        return self.worker

    def spawn(self) -> None:
        """Start the worker process without waiting for it (`ready()` waits): both sides start at once."""
        env = {**self.env, "PYTHONPATH": str(self.checkout.path)}
        self.worker = WorkerProcess(self.plugins, self.log, cwd=self.checkout.path, env=env, wait=False)
        if self.cpus:  # before torch starts its threads (they inherit the main thread's affinity)
            try:
                os.sched_setaffinity(self.worker.pid, self.cpus)
            except OSError:  # not allowed here (a container's limits): unpinned, as with --threads 0
                self.cpus = None

    def ready(self) -> None:
        assert self.worker is not None
        try:
            self.worker.wait_ready()
        except WorkerStartError as exc:
            self.start_failure = exc.reason
            self.worker = None

    def lost(self) -> None:
        """The worker was killed (timeout) or died: the next pair gets a fresh one."""
        self.worker = None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def kill(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker = None

    @property
    def timeout_s(self) -> float:
        return self.loaded.timeout_s if self.loaded is not None else 300.0

    def write(self, record: Record) -> None:
        assert self.writer is not None and self.run is not None
        self.writer.append(record)
        self.run.records[(record.case_id, record.impl)] = record


def failed_record(pair: messages.SuitePair, reason: str, kind: FailureKind, started: str) -> Record:
    return Record(case_id=pair.case_id, impl=pair.impl, params=pair.task.get("params", {}), status="failed",
                  reason=reason, started_at=started, failure=kind)


def read_record(side: Side, obj: dict[str, Any]) -> Record:
    try:
        return Record.model_validate(obj)
    except ValueError as exc:
        raise BadInput(f"{side.checkout.title}: its worker sent a record this bench cannot read ({exc}); run "
                       "bench ab from the newer of the two checkouts") from None


def worker_cpus(threads: int) -> list[int] | None:
    """The CPUs both sides' workers are pinned to: the last `threads` this process may use (None: not pinned)."""
    if threads <= 0 or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[-threads:] if len(allowed) > threads else None
