"""Child processes: the one place that starts, talks to and kills them (workers, ranks, calibration).

A child is `python -m MODULE ...` in a session of its own (so its whole process group can be killed), with its
stdout and stderr appended to a log file, a JSON-lines pipe from the child (`--result-fd`) and, when asked, one
to it (`--task-fd`). No pickle crosses the pipes: messages are the pydantic models of `bench.run.messages`.
The child dies with its parent (PR_SET_PDEATHSIG), so a killed runner leaves no orphan behind; the one
exception is `bench ab`'s janitor (bench.run.ab.janitor), whose job is to clean up after a parent killed outright.

Both sides live here: `Child` is the parent's handle; `ChildSide` is what the child's `main` uses to arm the
parent-death signal and to send its messages.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel

from bench.measure.memory import WORKER_MALLOC_ENV

# Inductor compiles in a subprocess pool by default; one thread keeps every process inside the child's group.
CHILD_ENV = {**WORKER_MALLOC_ENV, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STARTUP_TIMEOUT_S = 300.0  # imports and plugins, before a task's own timeout starts


def describe_exit(returncode: int | None) -> str:
    """`exit code 1`, `killed by SIGKILL`, or `still running`."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit code {returncode}"


class Child:
    """The parent's handle on one child process."""

    def __init__(self, module: str, args: list[str], *, env: dict[str, str] | None = None,
                 log_path: Path | None = None, with_tasks: bool = False, cwd: Path | None = None) -> None:
        self._result_read, result_write = os.pipe()
        fds = [result_write]
        cmd = [sys.executable, "-m", module, "--result-fd", str(result_write), "--parent-pid", str(os.getpid())]
        task_read = -1
        self._task_write = -1
        if with_tasks:
            task_read, self._task_write = os.pipe()
            fds.append(task_read)
            cmd += ["--task-fd", str(task_read)]
        log: BinaryIO | int = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen([*cmd, *args], pass_fds=tuple(fds), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, start_new_session=True, cwd=cwd,
                                         env={**os.environ, **CHILD_ENV, **(env or {})})
        finally:
            for fd in fds:
                os.close(fd)
            if not isinstance(log, int):
                log.close()
        self._buffer = b""
        self.closed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def fd(self) -> int:
        """The pipe this child writes to (for `select` over several children)."""
        return self._result_read

    def send(self, message: BaseModel) -> bool:
        """Write one typed message (bench.run.messages) down the task pipe; False when the child is gone."""
        data = message.model_dump_json()
        try:
            os.write(self._task_write, (data + "\n").encode())
            return True
        except (BrokenPipeError, OSError):
            return False

    def receive(self, deadline: float) -> dict[str, Any] | None:
        """The next message (a JSON object), or None on timeout or when the child closed its pipe."""
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.closed:
                return None
            ready, _, _ = select.select([self._result_read], [], [], min(remaining, 1.0))
            if ready and not self.read_available():
                return None
        return self.next_message()

    def read_available(self) -> bool:
        """Read what the pipe holds now (call when select says it is readable); False at end of stream."""
        try:
            chunk = os.read(self._result_read, 1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            self.closed = True
            return False
        self._buffer += chunk
        return True

    def next_message(self) -> dict[str, Any] | None:
        """A complete message already read, if any."""
        if b"\n" not in self._buffer:
            return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout=timeout)
        return None

    def kill(self) -> None:
        """SIGKILL the child's whole process group and reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        for fd in (self._task_write, self._result_read):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._task_write = self._result_read = -1

    def close(self, exit_message: BaseModel | None = None, grace_s: float = 10.0) -> None:
        """Ask the child to leave (an exit message, if it takes tasks), wait `grace_s`, then kill its group."""
        if self.proc.poll() is None and exit_message is not None and self._task_write >= 0:
            self.send(exit_message)
        if grace_s > 0:
            self.wait(grace_s)
        self.kill()


# --- the child's side --------------------------------------------------------------------------------------


def start_detached(argv: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """A process in a session of its own that outlives its parent (no parent-death signal): a local shard of
    `bench submit`, which `--no-wait` leaves running. Output to `log`; killed as a group by its pid."""
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans if the runner is killed)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


class ChildSide:
    """The child's end: call `start()` first; it returns False when the parent is already gone."""

    def __init__(self, result_fd: int, parent_pid: int, task_fd: int | None = None) -> None:
        self.result_fd, self.parent_pid, self.task_fd = result_fd, parent_pid, task_fd

    @staticmethod
    def add_arguments(parser: Any) -> None:
        parser.add_argument("--result-fd", type=int, required=True)
        parser.add_argument("--parent-pid", type=int, required=True)
        parser.add_argument("--task-fd", type=int, default=None)

    @classmethod
    def from_args(cls, args: Any) -> ChildSide:
        return cls(args.result_fd, args.parent_pid, args.task_fd)

    def start(self, outlive_parent: bool = False) -> bool:
        """Arm the parent-death signal (unless this child must outlive its parent: the `bench ab` janitor)."""
        if not outlive_parent:
            die_with_parent()
        return os.getppid() == self.parent_pid  # False: the parent died before PDEATHSIG was armed

    def send(self, message: BaseModel) -> None:
        data = message.model_dump_json()
        os.write(self.result_fd, (data + "\n").encode())

    def tasks(self) -> Any:
        """The lines of the task pipe, as JSON objects, until it closes."""
        assert self.task_fd is not None
        with os.fdopen(self.task_fd, "r", encoding="utf-8") as lines:
            for line in lines:
                yield json.loads(line)
