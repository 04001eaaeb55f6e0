"""A rank group's failure carries its kind as a worker's does (startup, timeout, died, out_of_memory), not
always `error`: the launcher's view (`_watch`) and the ranks' own parts (`assemble_record`), with stand-in ranks."""

from __future__ import annotations

import os

import pytest

from bench.measure.ranks.rank_part import RankPart
from bench.measure.ranks.rank_record import assemble_record
from bench.measure.task import Task
from bench.run import ranks
from bench.spec.case import Case


class StandInChild:
    """What `_watch` reads of a rank's Child: its pipe, whether it closed, its exit."""

    def __init__(self, closed: bool = False) -> None:
        self.fd, self._write = os.pipe()  # never written: select() times out
        self.closed = closed

    def wait(self, timeout: float) -> int:
        return -9

    def read_available(self) -> bool:
        return False


def rank(i: int, *, ready: bool = True, closed: bool = False, start_error: str | None = None) -> ranks._Rank:
    return ranks._Rank(i, StandInChild(closed), ready=ready, start_error=start_error)  # type: ignore[arg-type]


@pytest.mark.parametrize(("group", "kind", "reason"), [
    ([rank(0), rank(1, ready=False, start_error="ImportError: x")], "startup", "rank 1 could not start"),
    ([rank(0), rank(1, closed=True)], "died", "rank 1 died during start (killed by SIGKILL)"),
    ([rank(0), rank(1)], "timeout", "timed out after 0.2 s: rank 0, 1 during start"),
])
def test_the_launcher_names_the_kind_of_failure(group, kind, reason):
    got = ranks._watch(group, 0.2)
    assert got is not None and got[1] == kind and got[0].startswith(reason), got


def task() -> Task:
    return Task.of(Case(heads=2, head_dim=16, seq_len=64, world_size=2, device="cpu"), "cp_ring")


@pytest.mark.parametrize("kind", ["out_of_memory", "error"])
def test_a_rank_that_ran_out_of_memory_gives_an_out_of_memory_record(kind):
    parts = [RankPart(rank=0, status="failed", reason="a peer's error", phase="first call", comm_error=True,
                      failure="error"),
             RankPart(rank=1, status="failed", reason="OutOfMemoryError during first call", phase="first call",
                      comm_error=False, failure=kind)]
    record = assemble_record(task(), parts, "gloo", "2026-01-01T00:00:00Z", 1.0)
    assert record.status == "failed" and record.failure == kind and record.reason.startswith("rank 1: ")
