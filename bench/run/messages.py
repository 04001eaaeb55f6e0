"""The messages between the runner and its children (workers, ranks, calibration), one JSON object per line.

Every message has a `type`; `parse` validates a line into its model, so a child that sends something else is
named instead of half-read. PROTOCOL goes up when a message changes meaning: `bench ab` runs another checkout's
worker and must know that it speaks the same protocol.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from bench.measure.task import Task

PROTOCOL = 1
_STRICT = ConfigDict(extra="forbid", frozen=True)


# --- from a child ---


class Ready(BaseModel):
    """The child imported everything (plugins included); `error` says why it could not."""

    model_config = _STRICT
    type: Literal["ready"] = "ready"
    protocol: int = PROTOCOL
    error: str | None = None


class PhaseChanged(BaseModel):
    """What the child is doing now, for timeout messages."""

    model_config = _STRICT
    type: Literal["phase"] = "phase"
    phase: str


class RecordDone(BaseModel):
    """A measured (case, impl): the record, as JSON."""

    model_config = _STRICT
    type: Literal["record"] = "record"
    record: dict[str, Any]


class Opened(BaseModel):
    """A/B: the pair is prepared and checked, ready for blocks; or `record` when it ended before timing."""

    model_config = _STRICT
    type: Literal["opened"] = "opened"
    record: dict[str, Any] | None = None


class Samples(BaseModel):
    """A/B: one block's timed samples (seconds)."""

    model_config = _STRICT
    type: Literal["samples"] = "samples"
    samples: list[float]


class RankPart(BaseModel):
    """A rank's part of a distributed record (bench.measure.rank)."""

    model_config = _STRICT
    type: Literal["part"] = "part"
    part: dict[str, Any]


class Result(BaseModel):
    """A one-shot child's answer (calibration), or why it failed."""

    model_config = _STRICT
    type: Literal["result"] = "result"
    result: dict[str, Any] | None = None
    error: str | None = None


FromChild = Annotated[Ready | PhaseChanged | RecordDone | Opened | Samples | RankPart | Result,
                      Field(discriminator="type")]

# --- to a worker ---


class Measure(BaseModel):
    """Measure one (case, impl) the way `bench run` does, answered by a RecordDone."""

    model_config = _STRICT
    type: Literal["measure"] = "measure"
    task: Task


class Open(BaseModel):
    """A/B: prepare a pair and keep it warm (after `warmup` calls) for blocks; answered by Opened."""

    model_config = _STRICT
    type: Literal["open"] = "open"
    task: Task
    warmup: int = 1


class Block(BaseModel):
    """A/B: time `calls` calls of the open pair (more until `min_s` has passed); answered by Samples."""

    model_config = _STRICT
    type: Literal["block"] = "block"
    calls: int
    min_s: float = 0.0


class Close(BaseModel):
    """A/B: measure the open pair's memory and send its record, with every block's samples; then forget it."""

    model_config = _STRICT
    type: Literal["close"] = "close"


class Exit(BaseModel):
    model_config = _STRICT
    type: Literal["exit"] = "exit"


ToWorker = Annotated[Measure | Open | Block | Close | Exit, Field(discriminator="type")]

_FROM_CHILD: TypeAdapter[Any] = TypeAdapter(FromChild)
_TO_WORKER: TypeAdapter[Any] = TypeAdapter(ToWorker)


def from_child(obj: dict[str, Any]) -> Ready | PhaseChanged | RecordDone | Opened | Samples | RankPart | Result:
    """A child's message, validated (pydantic.ValidationError when it is not one)."""
    return _FROM_CHILD.validate_python(obj)


def to_worker(obj: dict[str, Any]) -> Measure | Open | Block | Close | Exit:
    return _TO_WORKER.validate_python(obj)
