"""Worker processes: measurements run in a child the runner can kill and replace (`bench.run.child`).

The runner sends `Measure` tasks and gets `PhaseChanged` and `RecordDone` messages back; `bench ab` opens a
pair, asks for short timed `Block`s of it interleaved with another checkout's worker, and `Close`s it for its
record. `bench ab` also has each checkout's worker load that checkout's suite (`LoadSuite`, so cases, tasks and
environment come from its own code), describe an open pair (`Describe`) and measure a distributed pair with rank
processes it starts itself (`MeasureRanks`). A worker that cannot start (a plugin that fails to import, say)
says why in its `Ready` message; the runner then writes a `failed` record with that cause for each pair the
worker was to measure.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from bench.measure.task import Task
from bench.results.records import FailureKind, MemoryInfo
from bench.run import messages
from bench.run.child import STARTUP_TIMEOUT_S, Child, ChildSide, describe_exit
from bench.run.forkserver import ForkServer

if TYPE_CHECKING:
    from bench.measure.fresh_memory import FreshMemory
    from bench.measure.pair import PairSession
    from bench.results.records import Record

WORKER_MODULE = "bench.run.worker"


class WorkerStartError(Exception):
    """The worker could not start; `reason` is the cause (the plugin's error, or how the process ended)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Outcome:
    """What came back for one task: a record (JSON object), or why none did."""

    record: dict[str, Any] | None
    failure: str | None = None
    phase: str | None = None
    kind: FailureKind = "error"  # what happened when there is no record: timeout | died


class WorkerProcess:
    """The runner's handle on one worker: started at construction (raises WorkerStartError), then tasks."""

    def __init__(self, plugins: list[tuple[str, str | None]], log_path: Path | None = None, *,
                 cwd: Path | None = None, env: dict[str, str] | None = None, wait: bool = True) -> None:
        """Start the worker; with `wait` (the default) wait for its Ready message here, else in `wait_ready()`
        (so that several workers start at once; start them from the main thread: a child dies with the thread
        that started it)."""
        import json

        args = ["--plugins", json.dumps(plugins)]
        self.child = Child(WORKER_MODULE, args, env=env, log_path=log_path, with_tasks=True, cwd=cwd)
        self.protocol = 0
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for the Ready message; raises WorkerStartError (the worker killed) when it does not come."""
        first = self.child.receive(time.monotonic() + STARTUP_TIMEOUT_S)
        ready = _parse(first)
        if not isinstance(ready, messages.Ready) or ready.error:
            status = describe_exit(self.child.wait(1.0))
            self.child.kill()
            if isinstance(ready, messages.Ready) and ready.error:
                raise WorkerStartError(f"worker could not start: {ready.error}")
            raise WorkerStartError(f"worker process failed to start ({status}); see the run's worker.log")
        self.protocol = ready.protocol

    @property
    def pid(self) -> int:
        return self.child.pid

    def _ask(self, message: BaseModel, timeout_s: float, want: type, phase: str = "start"
             ) -> tuple[Any, Outcome]:
        """Send `message`; (the answer of type `want`, or None with the Outcome saying why) within timeout_s.

        On a timeout or a death the worker is killed.
        """
        failed = self.send(message, phase)
        if failed is not None:
            return None, failed
        return self.await_answer(timeout_s, want, phase)

    def send(self, message: BaseModel, phase: str = "start") -> Outcome | None:
        """Send one message without waiting (`await_answer` then reads the answer); an Outcome if it died."""
        if self.child.send(message):
            return None
        code = self.child.poll()
        self.child.kill()
        kind = getattr(message, "type", "message")
        return Outcome(None, f"worker process died before the {kind} started ({describe_exit(code)})", phase, "died")

    def await_answer(self, timeout_s: float, want: type, phase: str = "start") -> tuple[Any, Outcome]:
        """The answer of type `want` to the message sent last, as `_ask` returns it."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = _parse(self.child.receive(deadline))
            if answer is None:
                if not self.child.closed:  # still running, silent past the deadline
                    self.child.kill()
                    return None, Outcome(None, f"timed out after {timeout_s:g} s during {phase}; worker killed",
                                         phase, "timeout")
                code = self.child.wait(10.0)  # it closed its pipe: it died (or is dying)
                self.child.kill()
                return None, Outcome(None, f"worker process died during {phase} ({describe_exit(code)})", phase,
                                     "died")
            if isinstance(answer, messages.PhaseChanged):
                phase = answer.phase
            elif isinstance(answer, want):
                return answer, Outcome(getattr(answer, "record", None), None, phase)

    def run(self, task: Task, timeout_s: float) -> Outcome:
        """Measure one task; wait for its record at most timeout_s."""
        return self._ask(messages.Measure(task=task), timeout_s, messages.RecordDone)[1]

    # --- A/B: a pair kept open between blocks ---

    def open(self, task: Task, timeout_s: float, warmup: int = 1) -> tuple[bool, Outcome]:
        """Prepare a pair and keep it warm: (open, outcome); not open: the outcome has the record (skipped,
        failed) or why there is none."""
        answer, outcome = self._ask(messages.Open(task=task, warmup=warmup), timeout_s, messages.Opened)
        return answer is not None and answer.record is None, outcome

    def block(self, calls: int, min_s: float, timeout_s: float) -> list[float] | Outcome:
        """One block's samples, or the Outcome saying why there are none (the worker was killed)."""
        answer, outcome = self._ask(messages.Block(calls=calls, min_s=min_s), timeout_s, messages.Samples, "timing")
        return answer.samples if answer is not None else outcome

    def close_pair(self, timeout_s: float) -> Outcome:
        """The open pair's record (memory measured, every block's samples)."""
        return self._ask(messages.Close(), timeout_s, messages.RecordDone, "memory")[1]

    # --- A/B across checkouts (protocol 2): the task is the other checkout's Task as JSON, passed on unread ---

    def load_suite(self, suite: str, impls: list[str], device: str | None, results: str | None,
                   timeout_s: float) -> messages.SuiteLoaded | Outcome:
        """The suite as this worker's checkout expands it (SuiteLoaded, maybe with an error), or why none came."""
        request = messages.LoadSuite(suite=suite, impls=impls, device=device, results=results)
        answer, outcome = self._ask(request, timeout_s, messages.SuiteLoaded, "loading the suite")
        return answer if answer is not None else outcome

    def open_json(self, task: dict[str, Any], timeout_s: float, warmup: int = 1) -> tuple[bool, Outcome]:
        """As `open`, for a task given as JSON (another checkout's Task)."""
        answer, outcome = self._ask(messages.OpenForwarded(task=task, warmup=warmup), timeout_s, messages.Opened)
        return answer is not None and answer.record is None, outcome

    def warm(self, calls: int, min_s: float, timeout_s: float) -> Outcome | None:
        """Untimed calls of the open pair (nothing kept); an Outcome if the worker was lost."""
        answer, outcome = self._ask(messages.Warm(calls=calls, min_s=min_s), timeout_s, messages.Samples, "warm-up")
        return None if answer is not None else outcome

    def describe(self, timeout_s: float) -> messages.PairInfo | Outcome:
        answer, outcome = self._ask(messages.Describe(), timeout_s, messages.PairInfo, "describing the pair")
        return answer if answer is not None else outcome

    def measure_json(self, task: dict[str, Any], timeout_s: float) -> Outcome:
        """As `run`, for a task given as JSON."""
        return self._ask(messages.MeasureForwarded(task=task), timeout_s, messages.RecordDone)[1]

    def measure_ranks_json(self, task: dict[str, Any], timeout_s: float, log: Path | None = None) -> Outcome:
        """A distributed pair measured by rank processes this worker starts (so they run its checkout)."""
        message = messages.MeasureRanksForwarded(task=task, log=str(log) if log else None)
        return self._ask(message, timeout_s, messages.RecordDone, "ranks")[1]

    def kill(self) -> None:
        self.child.kill()

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not within a few seconds."""
        self.child.close(messages.Exit())


def _parse(obj: dict[str, Any] | None) -> Any:
    if obj is None:
        return None
    try:
        return messages.from_child(obj)
    except ValueError:
        return messages.PhaseChanged(phase=f"sending a message this runner cannot read: {str(obj)[:200]}")


# --- the worker side ---------------------------------------------------------------------------------------


def _open_pair(session: PairSession, warmup: int) -> tuple[PairSession | None, Record | None]:
    """Open one side of an A/B pair and warm it up: the open session, or None and the record that ends it."""
    final = session.open()
    if final is None:
        try:
            session.warm_up(warmup)
        except Exception as exc:
            final = session.failed(exc)
    if final is not None:
        return None, final
    session.waiting()
    return session, None


def serve(side: ChildSide, plugins: list[tuple[str, str | None]] | None = None,
          fresh: FreshMemory | None = None) -> int:
    """Answer the runner's messages until Exit or the end of the task pipe; `fresh` measures CPU memory."""
    from bench.measure.pair import CaseCache, PairSession, measure_task

    cache = CaseCache()
    session: PairSession | None = None
    loaded = list(plugins or [])  # what rank processes started from here must import too

    def phase(name: str) -> None:
        side.send(messages.PhaseChanged(phase=name))

    for obj in side.tasks():
        message = messages.to_worker(obj)
        if isinstance(message, messages.Exit):
            break
        if isinstance(message, messages.Measure):
            record = measure_task(message.task, cache, phase, fresh)
            side.send(messages.RecordDone(record=record.model_dump(mode="json")))
        elif isinstance(message, messages.Open):
            session, final = _open_pair(PairSession(message.task, cache, phase, fresh=fresh), message.warmup)
            side.send(messages.Opened(record=None if final is None else final.model_dump(mode="json")))
        elif isinstance(message, messages.Block):
            assert session is not None, "a block without an open pair"
            side.send(messages.Samples(samples=session.block(message.calls, message.min_s)))
        elif isinstance(message, messages.Close):
            assert session is not None, "close without an open pair"
            side.send(messages.RecordDone(record=session.close_blocks().model_dump(mode="json")))
            session = None
        elif isinstance(message, messages.LoadSuite):
            from bench.run.ab.suite import load_for_ab

            loaded_suite = load_for_ab(message)
            loaded = list(dict.fromkeys([*loaded, *loaded_suite.plugins]))
            side.send(loaded_suite)
        elif isinstance(message, messages.Warm):
            assert session is not None, "warm without an open pair"
            start, calls = time.perf_counter(), 0
            while calls < message.calls or time.perf_counter() - start < message.min_s:
                session.warm_up(1)
                calls += 1
            side.send(messages.Samples(samples=[]))
        elif isinstance(message, messages.Describe):
            assert session is not None, "describe without an open pair"
            side.send(messages.PairInfo(interpreter=session.draft.interpreter, config=session.draft.config))
        elif isinstance(message, messages.MeasureRanks):
            from bench.run.ranks import run_pair

            log = Path(message.log) if message.log else None
            record = run_pair(message.task, loaded, message.task.measure.timeout_s, log)
            side.send(messages.RecordDone(record=record.model_dump(mode="json")))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=WORKER_MODULE)
    ChildSide.add_arguments(parser)
    parser.add_argument("--plugins", default="[]")
    args = parser.parse_args(argv)
    side = ChildSide.from_args(args)
    if not side.start():
        return 1
    try:
        import json

        from bench.registry import names
        from bench.spec.plugins import load_plugin

        for spec, base in json.loads(args.plugins):
            load_plugin(spec, base_dir=Path(base) if base else None, file="plugin", field=spec)
        names()  # import the built-in implementations once, before the first task's clock starts
        # Everything imported so far lives as long as the worker: keep it out of the collections that
        # memory measurement triggers (a full gc over torch's objects costs ~0.5 s per pair).
        gc.freeze()
    except Exception as exc:
        from bench.errors import BadInput

        detail = exc.detail if isinstance(exc, BadInput) else f"{type(exc).__name__}: {exc}"
        side.send(messages.Ready(error=detail))
        return 1
    server = _fork_server(side)
    side.send(messages.Ready())
    try:
        return serve(side, [(str(spec), base) for spec, base in json.loads(args.plugins)],
                     None if server is None else partial(fresh_memory, server))
    finally:
        if server is not None:
            server.close()


def fresh_memory(server: ForkServer, task: Task, selection_file: str | None = None) -> MemoryInfo:
    """The task's memory figure measured in a process the server forks for it (with a reference selection's
    file); FreshMemoryFailed saying why not."""
    from bench.measure.fresh_memory import FreshMemoryFailed, FreshRequest

    request = FreshRequest(task=task, selection_file=selection_file)
    reply = server.run(request.model_dump(mode="json"), task.measure.timeout_s)
    if reply.error is not None or reply.answer is None:
        raise FreshMemoryFailed(reply.error or "the fresh process sent no figure")
    return MemoryInfo.model_validate(reply.answer)


def _fork_server(side: ChildSide) -> ForkServer | None:
    """The server that forks a fresh process per CPU memory measurement (bench.run.forkserver): forked now,
    before any task has run; None where this system cannot fork (memory is then measured in the worker)."""
    if not hasattr(os, "fork"):
        return None
    from bench.measure.fresh_memory import memory_alone

    return ForkServer(memory_alone, close_fds=tuple(fd for fd in (side.result_fd, side.task_fd) if fd is not None))


if __name__ == "__main__":
    sys.exit(main())
