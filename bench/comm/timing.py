"""Time of a rank's counted ops, and of transfers started without waiting (`bench.comm`'s counters).

Overlap. A blocking op's time is all exposed: the rank waits for it. `Communicator.start_batch_isend_irecv`
(bench.comm) posts the transfers and returns a `Pending` at once; the rank computes, then calls
`Pending.wait()`. Per started op:

    t_issue   just before the transfers are posted      t_post   when posting returns
    t_ready   when wait() is called (the compute of the block in between has ended)
    t_done    when wait() returns                        t_complete  when the transfers completed
    comm_s    = t_complete - t_issue                      (the transfers' time in flight)
    exposed_s = (t_post - t_issue) + (t_done - t_ready)   (the rank blocked in the op)
    hidden_s  = max(0, comm_s - exposed_s)                (in flight while the rank computed)

On CPU (gloo) t_complete is observed by a waiter thread that blocks in the transfers' wait() (gloo's
point-to-point works have no completion callback and report completion only when waited on) and reads the
clock when it returns; t_done is when the rank has joined that thread. On CUDA (nccl) the transfers run on
nccl's stream and their completion is not observable apart: events on the compute stream at issue, ready and
done give comm_s = done - issue, an upper bound of the time in flight, and hidden_s = ready - issue, the
compute inside it. Per op kind the stats keep time_s (comm_s summed) and hidden_s; a rank's overlap fraction
is sum hidden_s / sum time_s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OpStats:
    """One op kind on one rank: calls, bytes sent (ring accounting), nccl-tests size, seconds.

    time_s: the op's time (blocking ops: the call; started ops: comm_s, the time in flight); hidden_s: the
    part of it that overlapped the rank's compute (module docstring, "Overlap").
    """

    calls: int = 0
    bytes_sent: int = 0
    size_bytes: int = 0  # nccl-tests' "size" summed over calls; algbw = size / time
    time_s: float = 0.0
    hidden_s: float = 0.0
    pending: list[tuple[Any, Any]] = field(default_factory=list)  # CUDA events not yet read
    pending_started: list[tuple[Any, Any, Any]] = field(default_factory=list)  # (issue, ready, done) events

    def resolve(self) -> None:
        for start, end in self.pending:
            end.synchronize()
            self.time_s += start.elapsed_time(end) / 1e3  # ms -> s
        self.pending.clear()
        for issue, ready, done in self.pending_started:
            done.synchronize()
            self.time_s += issue.elapsed_time(done) / 1e3
            self.hidden_s += issue.elapsed_time(ready) / 1e3
        self.pending_started.clear()


@dataclass
class LevelStats:
    """Ops counted under one level label on one rank."""

    calls: int = 0
    bytes_sent: int = 0


_WAITERS: ThreadPoolExecutor | None = None
_WAITERS_LOCK = threading.Lock()


def start_waiter(works: Sequence[Any]) -> Future[float]:
    """A waiter thread blocking in the works' wait(); its result is the clock when they completed."""
    return _waiters().submit(_wait_all, works)


def _waiters() -> ThreadPoolExecutor:
    """Threads that block in started transfers' wait() to see when they complete (CPU)."""
    global _WAITERS
    with _WAITERS_LOCK:
        if _WAITERS is None:
            _WAITERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="bench-comm-wait")
        return _WAITERS


def _wait_all(works: Sequence[Any]) -> float:
    for work in works:
        work.wait()
    return time.perf_counter()


class Pending:
    """Transfers started by `Communicator.start_batch_isend_irecv`: call `wait()` before reading what they
    receive (or reusing what they send). Waiting twice is harmless."""

    def __init__(self, works: Sequence[Any], stats: OpStats | None = None, *, t_issue: float = 0.0,
                 t_post: float = 0.0, waiter: Future[float] | None = None,
                 events: tuple[Any, Any] | None = None) -> None:
        self._works = list(works)
        self._stats = stats
        self._t_issue, self._t_post = t_issue, t_post
        self._waiter = waiter
        self._events = events  # CUDA: (issue, post) events on the compute stream
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        stats = self._stats
        if stats is None:  # uncounted
            _wait_all(self._works)
            return
        if self._events is not None:
            import torch

            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
            _wait_all(self._works)  # the compute stream waits for nccl's
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            stats.pending_started.append((self._events[0], ready, done))
            return
        t_ready = time.perf_counter()
        assert self._waiter is not None
        t_complete = self._waiter.result()
        t_done = time.perf_counter()
        comm_s = max(0.0, t_complete - self._t_issue)
        exposed = (self._t_post - self._t_issue) + max(0.0, t_done - t_ready)
        stats.time_s += comm_s
        stats.hidden_s += max(0.0, comm_s - exposed)
