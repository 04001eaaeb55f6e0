"""The messages between the runner and its children (workers, ranks, calibration), one JSON object per line.

Every message has a `type`; `parse` validates a line into its model, so a child that sends something else is
named instead of half-read. PROTOCOL goes up when a message changes meaning or a worker learns messages an older
one does not know: `bench ab` runs another checkout's worker and must know that it speaks the same protocol.

Protocol 1: Measure, Open, Block, Close, Exit. Protocol 2 adds what `bench ab` needs to run a checkout's own
suite with its own code: LoadSuite (answered by SuiteLoaded), Warm (Samples), Describe (PairInfo) and
MeasureRanks (RecordDone); and the janitor's Watch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from bench.measure.ranks import rank_part
from bench.measure.task import Task
from bench.results.environment import Calibration, Environment

PROTOCOL = 2
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


class RankPartDone(BaseModel):
    """A rank's part of a distributed record (bench.measure.ranks.rank_part)."""

    model_config = _STRICT
    type: Literal["part"] = "part"
    part: rank_part.RankPart


class Result(BaseModel):
    """The calibration child's answer, or why it failed."""

    model_config = _STRICT
    type: Literal["result"] = "result"
    result: Calibration | None = None
    error: str | None = None


class SuitePair(BaseModel):
    """One (case, impl) of a suite as a checkout's own code expands it (part of SuiteLoaded).

    `task` is that checkout's Task as JSON: the parent hands it back to the same checkout's worker unread, so
    two checkouts whose Task models differ can still be measured side by side.
    """

    model_config = _STRICT
    case_id: str
    impl: str
    label: str  # the case's short label (bench.spec.case.Case.label)
    world_size: int
    task: dict[str, Any]


class SuiteLoaded(BaseModel):
    """A/B: the suite file as this worker's checkout reads it, or `error` (the BadInput message) when it cannot.

    `root` is the directory holding the `bench` package this worker imported (the parent checks that each side
    runs its own code); `env` the environment as this checkout captures it (run.json's `env`); `content` the
    suite's parsed content (run.json's `suite.content`); `plugins` the (spec, directory) pairs children load.
    """

    model_config = _STRICT
    type: Literal["suite"] = "suite"
    error: str | None = None
    name: str = ""
    file: str | None = None
    root: str = ""
    content: dict[str, Any] = Field(default_factory=dict)
    env: Environment = Field(default_factory=Environment)
    plugins: list[tuple[str, str | None]] = Field(default_factory=list)
    timeout_s: float = 300.0
    warmup: int = 1
    repeat: int = 10
    pairs: list[SuitePair] = Field(default_factory=list)
    unknown_impls: list[str] = Field(default_factory=list)  # --impl names this checkout does not register


class PairInfo(BaseModel):
    """A/B: what the open pair is (answer to Describe); `interpreter`: timed through the Triton interpreter."""

    model_config = _STRICT
    type: Literal["pair_info"] = "pair_info"
    interpreter: bool = False
    config: dict[str, Any] | None = None


FromChild = Annotated[Ready | PhaseChanged | RecordDone | Opened | Samples | RankPartDone | Result | SuiteLoaded
                      | PairInfo, Field(discriminator="type")]

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


class LoadSuite(BaseModel):
    """A/B: load a suite file with this worker's own code (plugins imported here) and expand it into tasks.

    `suite` is a path relative to the worker's directory (its checkout) or absolute; `impls` restricts the
    implementations (--impl; names this checkout does not know are listed back, not fatal); `device`
    overrides every case's device; `results` is where a stored calibration is looked up. Answered by
    SuiteLoaded.
    """

    model_config = _STRICT
    type: Literal["load_suite"] = "load_suite"
    suite: str
    impls: list[str] = Field(default_factory=list)
    device: str | None = None
    results: str | None = None


class Warm(BaseModel):
    """A/B: run the open pair untimed for `calls` calls and at least `min_s` seconds (nothing is kept: the first
    blocks after an open are slower than the rest); answered by Samples (empty)."""

    model_config = _STRICT
    type: Literal["warm"] = "warm"
    calls: int = 1
    min_s: float = 0.0


class Describe(BaseModel):
    """A/B: describe the open pair; answered by PairInfo."""

    model_config = _STRICT
    type: Literal["describe"] = "describe"


class MeasureRanks(BaseModel):
    """Measure a distributed (world_size > 1) pair over fresh rank processes started by this worker, so that
    they run this worker's checkout; answered by a RecordDone."""

    model_config = _STRICT
    type: Literal["measure_ranks"] = "measure_ranks"
    task: Task
    log: str | None = None  # the ranks' log file


# --- from `bench ab`'s parent: another checkout's task, forwarded unread ---
# The parent cannot validate a task with its own Task model (the other side's may have other fields); these
# serialise exactly as Open, Measure and MeasureRanks, which the worker validates with its own code.


class OpenForwarded(BaseModel):
    model_config = _STRICT
    type: Literal["open"] = "open"
    task: dict[str, Any]
    warmup: int = 1


class MeasureForwarded(BaseModel):
    model_config = _STRICT
    type: Literal["measure"] = "measure"
    task: dict[str, Any]


class MeasureRanksForwarded(BaseModel):
    model_config = _STRICT
    type: Literal["measure_ranks"] = "measure_ranks"
    task: dict[str, Any]
    log: str | None = None


class Watch(BaseModel):
    """To the janitor (bench.run.ab.janitor): when the parent's pipe closes, remove `path` - a git worktree of
    `repo` (`git worktree remove --force`, then `prune`), or a plain directory when `repo` is None."""

    model_config = _STRICT
    type: Literal["watch"] = "watch"
    path: str
    repo: str | None = None


ToWorker = Annotated[Measure | Open | Block | Close | Exit | LoadSuite | Warm | Describe | MeasureRanks,
                     Field(discriminator="type")]

_FROM_CHILD: TypeAdapter[Any] = TypeAdapter(FromChild)
_TO_WORKER: TypeAdapter[Any] = TypeAdapter(ToWorker)


_TO_JANITOR: TypeAdapter[Any] = TypeAdapter(Annotated[Watch | Exit, Field(discriminator="type")])


def from_child(obj: dict[str, Any]) -> (Ready | PhaseChanged | RecordDone | Opened | Samples | RankPartDone | Result
                                        | SuiteLoaded | PairInfo):
    """A child's message, validated (pydantic.ValidationError when it is not one)."""
    return _FROM_CHILD.validate_python(obj)


def to_worker(obj: dict[str, Any]) -> (Measure | Open | Block | Close | Exit | LoadSuite | Warm | Describe
                                       | MeasureRanks):
    return _TO_WORKER.validate_python(obj)


def to_janitor(obj: dict[str, Any]) -> Watch | Exit:
    return _TO_JANITOR.validate_python(obj)
