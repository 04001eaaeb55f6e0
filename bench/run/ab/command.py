"""`bench ab BASE NEW SUITE`: two checkouts measured side by side, in interleaved short blocks per pair.

Each side runs its own code: a worker started in that checkout's directory with the checkout on PYTHONPATH
loads the side's own suite file (`LoadSuite`, bench.run.ab.suite), so its cases, tasks, plugins and environment
are that side's. Then, for every (case, impl) both sides have:

1. both workers open the pair at once (prepare, first call, oracle check, warm-up; `Open`), since nothing is
   timed yet;
2. R rounds: in each, one block of the pair on each side (`Block`: at least `block_calls` calls and
   `block_s` seconds), back to back, in an order drawn at random with as many BASE-first as NEW-first rounds
   (randomized multiple interleaved trials, Abedi & Brecht 2017): drift of the machine falls on both sides of
   every round alike, and the analysis compares sides within rounds;
3. both close the pair (`Close`: memory, and the record whose time_s holds every block's samples);
4. after every pair: where a pair's verdict is still open, more looks - a trial of R more rounds on fresh
   workers - up to --max-rounds and while the time budget lasts (bench.analysis.ab_sequential holds the error
   rate over the looks).

Pairs timed through the Triton interpreter (correctness only on CPU) get one block per side, and distributed
pairs (world_size > 1: fresh rank processes per measurement, started by that side's worker, `MeasureRanks`) one
ordinary measurement per side: their deterministic figures are compared, their times are not interleaved.
A pair on one side only is measured the way `bench run` does, so each side's run is complete.

Both sides' records go to the results store as ordinary runs (run.json + records.jsonl through
bench.results.store), so compare, history and the dashboards read them. Worktrees are removed on every way out
(bench.run.ab.worktrees, with its janitor for SIGKILL). The statistics are bench.analysis.ab's.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.errors import BadInput
from bench.results.records import RunInfo, SuiteInfo
from bench.results.store import RECORDS, RUN_JSON, RecordWriter, create_run_dir, utc_now, write_json_atomic
from bench.run import messages
from bench.run.ab.pairs import measure_pairs, round_orders
from bench.run.ab.side import (
    BUDGET_FACTOR,
    DEFAULT_BLOCK_CALLS,
    DEFAULT_BLOCK_S,
    DEFAULT_MAX_ROUNDS_FACTOR,
    DEFAULT_ROUNDS,
    DEFAULT_THREADS,
    DISTRIBUTED,
    ENDED,
    INTERLEAVED,
    INTERPRETER,
    LOAD_TIMEOUT_S,
    ONE_SIDE,
    ABMeasurement,
    ABOptions,
    PairMeasurement,
    Side,
    SideRun,
    worker_cpus,
)
from bench.run.ab.worktrees import Checkout, Worktrees, check_revision, checkout_dir, repo_root, suite_relative
from bench.run.identity import record_git

__all__ = ["BUDGET_FACTOR", "DEFAULT_BLOCK_CALLS", "DEFAULT_BLOCK_S", "DEFAULT_MAX_ROUNDS_FACTOR", "DEFAULT_ROUNDS",
           "DEFAULT_THREADS", "DISTRIBUTED", "ENDED", "INTERLEAVED", "INTERPRETER", "ONE_SIDE", "ABMeasurement",
           "ABOptions", "Interrupted", "PairMeasurement", "SideRun", "measure_ab", "round_orders"]


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) during `bench ab`: unwinds like Ctrl-C so that every worktree is removed."""


# --- the run -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Interrupted (a KeyboardInterrupt) in the main thread, so `finally` blocks clean up."""
    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def measure_ab(options: ABOptions, console: Console, describe: Callable[[PairMeasurement], str] | None = None,
               open_keys: Callable[[list[PairMeasurement], list[int]], set[tuple[str, str]]] | None = None
               ) -> ABMeasurement:
    """Measure both sides; raises BadInput for bad input (nothing left behind), Interrupted/KeyboardInterrupt
    when stopped (worktrees removed, records so far kept, runs left without finished_at)."""
    options.check()
    started = time.perf_counter()
    cwd = (options.cwd or Path.cwd()).resolve()
    repo = repo_root(cwd)
    suite_rel = suite_relative(options.suite, cwd, repo)
    worktrees: Worktrees | None = None
    sides: list[Side] = []
    completed = False
    with _terminate_as_interrupt():
        try:
            specs = (("BASE", options.base), ("NEW", options.new))
            # Every revision is checked before anything is made: bad input leaves nothing behind.
            commits = {role: check_revision(role, spec, cwd, repo, suite_rel)
                       for role, spec in specs if not (cwd / spec).is_dir()}
            checkouts: list[Checkout] = []
            for role, spec in specs:
                if role in commits:
                    if worktrees is None:
                        assert repo is not None
                        worktrees = Worktrees(repo)
                    path = worktrees.add(role.lower(), commits[role])
                    checkouts.append(Checkout(role, spec, path, commits[role], worktree=True))
                else:
                    checkouts.append(checkout_dir(role, spec, cwd / spec))
            for co in checkouts:
                if not Path(suite_rel).is_absolute() and not (co.path / suite_rel).is_file():
                    raise BadInput(f"{co.title}: no suite file {suite_rel} in that checkout; bench ab runs each "
                                   "side's own suite file, so it must exist on both sides")
            _check_names([_suite_name(co.path / suite_rel) for co in checkouts], suite_rel)
            logs = worktrees.tmp if worktrees is not None else Path(tempfile.mkdtemp(prefix="bench-ab-logs-"))
            cpus = worker_cpus(options.threads)
            sides = [Side(co, logs / f"{co.role.lower()}-worker.log", options.out, options.worker_env(), cpus)
                     for co in checkouts]
            _start_and_load(sides, options, suite_rel)
            measurement = measure_pairs(sides, options, console, describe, open_keys, started)
            measurement.wall_s = time.perf_counter() - started
            completed = True
            return measurement
        finally:
            previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop cleanup
            try:
                for side in sides:
                    side.close() if completed else side.kill()
                    _finish_run(side, completed)
                if worktrees is not None:
                    worktrees.close()
                elif sides:
                    shutil.rmtree(sides[0].log.parent, ignore_errors=True)
            finally:
                signal.signal(signal.SIGINT, previous_int)


def _start_and_load(sides: list[Side], options: ABOptions, suite_rel: str) -> None:
    """Start both workers at once, check their protocol, load each side's suite, open both runs."""
    for side in sides:
        side.spawn()
    for side in sides:
        side.ready()
    for side in sides:
        worker = side.worker
        if worker is None:
            raise BadInput(f"{side.checkout.title}: its worker could not start ({side.start_failure})"
                           f"{_log_tail(side)}. A checkout older than bench ab's worker (bench/run/worker.py, protocol "
                           f"{messages.PROTOCOL}) cannot be measured by it")
        if worker.protocol != messages.PROTOCOL:
            older = worker.protocol < messages.PROTOCOL
            raise BadInput(f"{side.checkout.title}: its worker speaks protocol {worker.protocol}, this bench ab "
                           f"needs {messages.PROTOCOL}: that checkout is "
                           + ("older than bench ab (it cannot load its own suite for an A/B run)" if older else
                              "newer than this bench; run bench ab from the newer checkout"))
    results = str(options.out.resolve())
    for side in sides:
        assert side.worker is not None
        failed = side.worker.send(messages.LoadSuite(suite=suite_rel, impls=options.impls, device=options.device,
                                                     results=results), "loading the suite")
        if failed is not None:
            raise BadInput(f"{side.checkout.title}: {failed.failure}{_log_tail(side)}")
    for side in sides:
        assert side.worker is not None
        answer, outcome = side.worker.await_answer(LOAD_TIMEOUT_S, messages.SuiteLoaded, "loading the suite")
        if answer is None:
            side.lost()
            raise BadInput(f"{side.checkout.title}: loading its suite failed: {outcome.failure}{_log_tail(side)}")
        if answer.error:
            raise BadInput(f"{side.checkout.title}: {answer.error}")
        side.loaded = answer
        side.plugins = list(answer.plugins)
        expected = side.checkout.path.resolve()
        if Path(answer.root).resolve() != expected:
            raise BadInput(f"{side.checkout.title}: its worker imported bench from {answer.root}, not from the "
                           f"checkout {expected}; an installed copy shadows it (reinstall with `pip install -e`)")
    base, new = (s.loaded for s in sides)
    assert base is not None and new is not None
    _check_names([base.name, new.name], suite_rel)
    unknown_both = [n for n in base.unknown_impls if n in new.unknown_impls]
    if unknown_both:
        raise BadInput(f"got {unknown_both[0]!r}, registered on neither side", field="--impl")
    for side in sides:
        _open_run(side)


def _suite_name(path: Path) -> str | None:
    """The suite's `name:` read without its side's code (to refuse two names before starting any worker), or
    None where the file does not parse: that side's worker then says what is wrong with it."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


def _check_names(names: list[str | None], suite_rel: str) -> None:
    base, new = names
    if base is not None and new is not None and base != new:
        raise BadInput(f"the suite file {suite_rel} is named {base!r} in BASE and {new!r} in NEW; bench ab "
                       "compares one suite, so both sides must give it the same name")


def _log_tail(side: Side, lines: int = 3) -> str:
    try:
        text = side.log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f"; its log ends: {' | '.join(text[-lines:])}" if text else ""


def _open_run(side: Side) -> None:
    loaded = side.loaded
    assert loaded is not None
    commit = loaded.env.git.commit or side.checkout.commit or "nogit"
    run_id, run_dir = create_run_dir(side.out, loaded.name, commit)
    info = RunInfo(run_id=run_id, suite=SuiteInfo(name=loaded.name, file=loaded.file, content=loaded.content),
                   started_at=utc_now(), finished_at=None, env=loaded.env, command=sys.argv[1:] or None)
    write_json_atomic(run_dir / RUN_JSON, info.model_dump(mode="json", by_alias=True))
    (run_dir / RECORDS).touch()
    side.writer = RecordWriter(run_dir / RECORDS, record_git(info.env.git), info.env.code)  # the side's own code
    side.run = SideRun(side.checkout, loaded.name, loaded.file, loaded.root, run_dir, run_id, loaded.env,
                       labels={p.case_id: p.label for p in loaded.pairs}, unknown_impls=list(loaded.unknown_impls))


def _finish_run(side: Side, completed: bool) -> None:
    """Close the records file, stamp finished_at when the run completed (an interrupted run keeps what it wrote
    and says it did not finish), and keep the worker's log beside the run."""
    if side.writer is not None:
        side.writer.close()
        side.writer = None
    run = side.run
    if run is None:
        return
    from bench.results.store import read_run_info

    with contextlib.suppress(OSError, BadInput):
        info = read_run_info(run.run_dir)
        if info.finished_at is None and completed:
            write_json_atomic(run.run_dir / RUN_JSON,
                              {**info.model_dump(mode="json", by_alias=True), "finished_at": utc_now()})
    if side.log.exists():
        with contextlib.suppress(OSError):
            shutil.copyfile(side.log, run.run_dir / "worker.log")
