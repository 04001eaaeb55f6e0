"""Fresh processes for CPU memory measurement: a fork server started by the worker before its first task.

On CPU a call's peak is read from the process's resident high-water mark (`bench.measure.memory`). In a worker
that has measured other cases that figure moves with what they left behind: glibc serves a request from a free
heap chunk that fits before it maps new memory, so the measured call reused chunks earlier calls had freed (the
same call of csr read 13.5 to 23 MB from one worker to the next). So the worker forks, before it measures
anything, a server process that has imported everything and run nothing; for each memory measurement the server
forks a fresh process from that clean state, which tracks allocations from its start, builds the case again,
makes its first call (and in fwd_bwd one more step) and measures the next. No earlier case can move the figure,
and a crash there costs only the figure.

The server is forked before any parallel region has run (GNU OpenMP's thread pool does not survive a fork), and
before CUDA is initialised: it is used for CPU cases only. Fork is cheap (pages are shared until written); each
measurement pays the case's setup and first call once more: for flex its compilation again (about as long as
the first one, 1 s on the smoke suite's shapes, 10 s at N=4096 in float32 on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from bench.run.child import describe_exit, die_with_parent

Request = dict[str, Any]  # a job's JSON request (the worker's: a Task)
Job = Callable[[Request], Any]  # returns a pydantic model or a JSON value


class ForkReply(BaseModel):
    """What a fresh process sent back: its job's answer (JSON), or why there is none (and its traceback)."""

    answer: Any = None
    error: str | None = None
    details: str | None = None


def _exit_status(status: int) -> str:
    return describe_exit(os.waitstatus_to_exitcode(status))


def _run_fresh(job: Job, request: Request) -> ForkReply:
    """Fork one process for `request`; its answer, or the error when it ended without one."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fresh process
        os.close(read_fd)
        die_with_parent()
        try:
            answer = job(request)
            reply = ForkReply(answer=answer.model_dump(mode="json") if isinstance(answer, BaseModel) else answer)
        except BaseException as exc:  # reported to the worker, never raised here
            reply = ForkReply(error=f"{type(exc).__name__}: {exc}", details=traceback.format_exc()[-4000:])
        try:
            os.write(write_fd, reply.model_dump_json().encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    with os.fdopen(read_fd, "rb") as pipe:
        while chunk := pipe.read(1 << 16):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    try:
        return ForkReply.model_validate_json(b"".join(chunks))
    except ValueError:
        return ForkReply(error=f"the fresh process ended without an answer ({_exit_status(status)})")


def _serve(job: Job, requests: int, answers: int) -> None:
    with os.fdopen(requests, "r", encoding="utf-8") as lines:
        for line in lines:
            os.write(answers, (_run_fresh(job, json.loads(line)).model_dump_json() + "\n").encode())


class ForkServer:
    """A server process forked from this one now; `run(request)` runs `job(request)` in a fresh fork of it.

    `close_fds`: descriptors of this process the server must not hold open (the worker's pipes to the runner,
    whose end the runner watches to tell that the worker died).
    """

    def __init__(self, job: Job, close_fds: tuple[int, ...] = ()) -> None:
        request_read, self._requests = os.pipe()
        self._answers, answer_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the server
            code = 1
            try:
                for fd in (self._requests, self._answers, *close_fds):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                die_with_parent()
                _serve(job, request_read, answer_write)
                code = 0
            finally:
                os._exit(code)
        os.close(request_read)
        os.close(answer_write)
        self.pid = pid
        self._buffer = b""
        self.broken: str | None = None

    def run(self, request: Request, timeout_s: float | None = None) -> ForkReply:
        """The fresh process's answer, or the error saying why there is none."""
        if self.broken:
            return ForkReply(error=self.broken)
        try:
            os.write(self._requests, (json.dumps(request) + "\n").encode())
        except OSError as exc:
            return self._break(f"the fork server is gone ({exc.strerror})")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._answers], [], [], wait)
            if not ready:
                self.close()
                return self._break(f"no answer from the fresh process within {timeout_s:g} s")
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                return self._break("the fork server died")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return ForkReply.model_validate_json(line)

    def _break(self, why: str) -> ForkReply:
        self.broken = why
        return ForkReply(error=why)

    def close(self) -> None:
        """End the server (and a fresh process still running: it dies with it)."""
        for fd in (self._requests, self._answers):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.kill(self.pid, 9)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, 0)
