"""One rank's part of a distributed record: what `bench.measure.ranks.rank.measure_on_rank` returns on each rank, what
the rank sends its runner (in bench.run.messages.RankPartDone) and what `bench.measure.ranks.rank_record` assembles."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bench.results.records import (
    ContentionInfo,
    ErrorInfo,
    FailureKind,
    MemoryInfo,
    SetupTimes,
    TimeStats,
    TimingInfo,
)

_STRICT = ConfigDict(extra="forbid")


class OpCount(BaseModel):
    """One kind of collective on one rank: calls, bytes this rank sent, the op's nccl-tests size; in a timed part,
    op time and its hidden part per step (bench.comm.Communicator.snapshot)."""

    model_config = _STRICT
    calls: int
    bytes_sent: int
    size_bytes: int = 0
    time_s: float = 0.0
    hidden_s: float = 0.0


class LevelCount(BaseModel):
    """The ops one rank counted under a level label (cp_usp: ulysses, ring)."""

    model_config = _STRICT
    calls: int
    bytes_sent: int


class CaseFigures(BaseModel):
    """Rank 0: the case's pattern figures, as a single-process record has them."""

    model_config = _STRICT
    density: float
    block_density: float
    flops: float
    flops_dense: float


class ExpectedComm(BaseModel):
    """Rank 0: the implementation's closed forms (bytes in all, per level, from each rank to each peer)."""

    model_config = _STRICT
    bytes: int | None = None
    by_level: dict[str, int] | None = None
    matrix: list[list[int]] | None = None


class RankPart(BaseModel):
    """One rank's part of a distributed pair; rank 0's also holds the check and the case's figures."""

    model_config = _STRICT
    rank: int
    status: Literal["ok", "skipped", "failed"] = "ok"
    reason: str | None = None
    details: str | None = None
    phase: str | None = None  # a failure's phase
    comm_error: bool = False  # a failure of the communication layer: a consequence of a peer's failure
    failure: FailureKind | None = None
    setup_s: float | None = None
    setup: SetupTimes | None = None
    config: dict[str, Any] = Field(default_factory=dict)  # the implementation's record_extras
    error: ErrorInfo | None = None  # rank 0: the oracle check
    problem: str | None = None  # rank 0: why the output is incorrect
    levels: dict[str, LevelCount] = Field(default_factory=dict)  # bytes per level of one counted step
    comm: dict[str, OpCount] = Field(default_factory=dict)  # per op, with op and hidden time per timed step
    time_s: TimeStats | None = None  # the slowest rank's samples (the same on every rank)
    contention: ContentionInfo | None = None
    timing: TimingInfo | None = None  # rank 0: how the calls were timed and how many of their outputs were checked
    step_s: float | None = None  # this rank's own mean step time
    pairs: int | None = None  # this rank's useful (query head, row, key) triples
    flops: float | None = None
    memory: MemoryInfo | None = None
    device: str | None = None
    threads: int | None = None
    base: CaseFigures | None = None  # rank 0
    expected: ExpectedComm | None = None  # rank 0
    node: str | None = None  # this rank's node (bench.measure.machine.topology)
    peers: dict[str, int] = Field(default_factory=dict)  # bytes sent to each peer in one counted step

    def failed(self, reason: str, details: str | None, phase: str, comm_error: bool, failure: FailureKind
               ) -> RankPart:
        return self.model_copy(update={"status": "failed", "reason": reason, "details": details, "phase": phase,
                                       "comm_error": comm_error, "failure": failure})
