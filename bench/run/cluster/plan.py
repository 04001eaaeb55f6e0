"""submit.json: what `bench submit` started, so that `bench submit --attach` can follow it from another process.

A model, validated when read: a file of another version or a broken one is named with the field that is wrong
(exit 2), never half-read into a KeyError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bench.errors import BadInput

SUBMIT_JSON = "submit.json"
PLAN_VERSION = 1


class ShardJob(BaseModel):
    """One job that ran (or runs) a shard: the executor's id (a local pid, a Slurm job id), where and when."""

    model_config = ConfigDict(extra="forbid")
    id: str
    started_at: str
    host: str | None = None  # local: the machine whose process it is
    log: str | None = None  # local: the shard's log file

    @field_validator("id", mode="before")
    @classmethod
    def _pid_as_text(cls, value: object) -> object:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value  # older files


class ExecutorSettings(BaseModel):
    """What the executor was made with (Slurm's partition, GPUs per shard, time limit)."""

    model_config = ConfigDict(extra="forbid")
    partition: str | None = None
    gpus: int = 0
    time_limit: str | None = None


class SubmitPlan(BaseModel):
    """A submitted run: the suite, the executor, the shards (rank groups first) and each shard's jobs, oldest
    first (a shard resubmitted for its missing pairs has several)."""

    model_config = ConfigDict(extra="forbid")
    version: int = PLAN_VERSION
    suite_file: str
    executor: Literal["local", "slurm"]
    shards: int = Field(ge=1)
    rank_groups: list[int] = Field(default_factory=list)  # the world sizes run as shards 0..G-1
    nodes_per_rank_group: int = Field(1, ge=1)
    impls: list[str] = Field(default_factory=list)
    out: str
    run_id: str
    settings: ExecutorSettings = Field(default_factory=ExecutorSettings)
    jobs: dict[str, list[ShardJob]] = Field(default_factory=dict)  # by shard index
    submitted_at: str

    def jobs_of(self, index: int) -> list[ShardJob]:
        return self.jobs.setdefault(str(index), [])

    def write(self, run_dir: Path) -> None:
        from bench.results.store import write_json_atomic

        write_json_atomic(run_dir / SUBMIT_JSON, self.model_dump(mode="json"))


def read_plan(run_dir: Path) -> SubmitPlan:
    """The run's submit.json, validated; BadInput naming the file and the field when it is missing or broken."""
    path = run_dir / SUBMIT_JSON
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        raise BadInput("not a submitted run (no submit.json); `bench submit` writes it", file=str(run_dir),
                       field="--attach") from None
    except json.JSONDecodeError as exc:
        raise BadInput(f"not valid JSON: {exc}", file=str(path), field="--attach") from None
    try:
        return SubmitPlan.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise BadInput(f"{where}: {err['msg']}; this submit.json is not one this version of `bench submit` wrote "
                       f"(version {PLAN_VERSION}): watch it with the version that submitted it, or resume its run "
                       f"with `bench run SUITE --resume {run_dir}`", file=str(path), field="--attach") from None
