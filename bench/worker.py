"""Worker processes: measurements run in a child the runner can kill and replace.

Both sides of the protocol live here. The runner starts `python -m bench.worker` in a new session (so its
whole process group can be killed), with two pipes: tasks go down one as JSON lines, and the worker sends
back `ready`, `phase` (what it is doing, for timeout messages) and `record` messages on the other. No
pickle crosses the pipes. The worker dies with its parent (PR_SET_PDEATHSIG), so a killed runner leaves
no orphan behind; its stdout and stderr go to the run's worker.log.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from bench.memory import WORKER_MALLOC_ENV

# Inductor compiles in a subprocess pool by default; one thread keeps every process inside the worker.
WORKER_ENV = {**WORKER_MALLOC_ENV, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STARTUP_TIMEOUT_S = 300.0


@dataclass
class Outcome:
    """What came back for one task: a record (JSON object), or why none did."""

    record: dict[str, Any] | None
    failure: str | None = None  # set when the worker timed out or died
    phase: str | None = None


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


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit code {returncode}"


class WorkerProcess:
    """The runner's handle on one worker process."""

    def __init__(self, plugins: list[tuple[str, str | None]], log_path: Path | None = None) -> None:
        task_read, self._task_write = os.pipe()
        self._result_read, result_write = os.pipe()
        log: TextIO | int = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        cmd = [sys.executable, "-m", "bench.worker", "--task-fd", str(task_read), "--result-fd",
               str(result_write), "--parent-pid", str(os.getpid()), "--plugins", json.dumps(plugins)]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(task_read, result_write), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True,
                                         env={**os.environ, **WORKER_ENV})
        finally:
            os.close(task_read)
            os.close(result_write)
            if not isinstance(log, int):
                log.close()
        self._buffer = b""
        ready = self._receive(time.monotonic() + STARTUP_TIMEOUT_S, None)
        if ready is None or ready.get("type") != "ready" or ready.get("error"):
            status = describe_exit(self.proc.poll())
            self.kill()
            detail = ready.get("error") if ready else None
            raise RuntimeError(f"worker process failed to start ({status})" + (f": {detail}" if detail else ""))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, task: dict[str, Any], timeout_s: float) -> Outcome:
        """Send one task; wait for its record at most timeout_s. On timeout or death the worker is killed."""
        try:
            os.write(self._task_write, (json.dumps(task) + "\n").encode())
        except BrokenPipeError:
            self.kill()
            return Outcome(None, f"worker process died before the task started ({describe_exit(self.proc.poll())})")
        deadline = time.monotonic() + timeout_s
        phase = "start"
        while True:
            message = self._receive(deadline, phase)
            if message is None:
                if self.proc.poll() is None:
                    self.kill()
                    return Outcome(None, f"timed out after {timeout_s:g} s during {phase}; worker killed", phase)
                code = self.proc.returncode
                self.kill()
                return Outcome(None, f"worker process died during {phase} ({describe_exit(code)})", phase)
            if message.get("type") == "phase":
                phase = message.get("phase", phase)
            elif message.get("type") == "record":
                return Outcome(message["record"], None, phase)

    def _receive(self, deadline: float, phase: str | None) -> dict[str, Any] | None:
        """Next JSON message, or None on timeout or end of stream."""
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self._result_read], [], [], min(remaining, 1.0))
            if not ready:
                continue
            chunk = os.read(self._result_read, 1 << 20)
            if not chunk:
                self.proc.wait()
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        """SIGKILL the worker's whole process group and reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        self._close_fds()

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not within a few seconds."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.write(self._task_write, b'{"type": "exit"}\n')
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        self.kill()

    def _close_fds(self) -> None:
        for fd in (self._task_write, self._result_read):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._task_write = self._result_read = -1


# --- the worker side ---------------------------------------------------------------------------------------


def _send(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.worker")
    parser.add_argument("--task-fd", type=int, required=True)
    parser.add_argument("--result-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--plugins", default="[]")
    args = parser.parse_args(argv)
    die_with_parent()
    if os.getppid() != args.parent_pid:  # the parent died before PDEATHSIG was armed
        return 1
    out = args.result_fd
    try:
        from bench.measure import CaseCache, Task, measure_task
        from bench.plugins import load_plugin
        from bench.registry import names

        for spec, base in json.loads(args.plugins):
            load_plugin(spec, base_dir=Path(base) if base else None, file="plugin", field=spec)
        names()  # import the built-in implementations once, before the first task's clock starts
        # Everything imported so far lives as long as the worker: keep it out of the collections that
        # memory measurement triggers (a full gc over torch's objects costs ~0.5 s per pair).
        gc.freeze()
    except Exception as exc:
        _send(out, {"type": "ready", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _send(out, {"type": "ready"})
    cache = CaseCache()
    with os.fdopen(args.task_fd, "r", encoding="utf-8") as tasks:
        for line in tasks:
            message = json.loads(line)
            if message.get("type") == "exit":
                break
            task = Task.from_json(message)
            record = measure_task(task, cache, phase=lambda p: _send(out, {"type": "phase", "phase": p}))
            _send(out, {"type": "record", "record": json.loads(record.to_json())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
