"""What a worker or a rank is asked to measure: one (case, impl) with the suite's measurement settings.

It crosses process boundaries as JSON (bench.run.messages), so it is a pydantic model: the case with its device
resolved, the parameters as the suite wrote them (the record's `params`), the implementation, and how to measure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from bench.results.environment import Calibration

if TYPE_CHECKING:
    from bench.spec.case import Case

_STRICT = ConfigDict(extra="forbid", frozen=True)


class MeasureSettings(BaseModel):
    """The suite's `measure:` section, plus the calibration the run measured or found."""

    model_config = _STRICT
    warmup: int = 2
    repeat: int = 10
    max_time_s: float = 2.0
    timeout_s: float = 300.0
    check: bool = True
    calibrate: bool = False
    memory: Literal["fresh", "worker"] = "fresh"  # where CPU memory is read (bench.run.forkserver)
    attention_stats: bool = False  # the records carry the attention statistics of the case's inputs
    wait_for_quiet_s: float = 0.0  # before timing, wait up to this long for the CPU pressure to fall
    numerics: Literal["report", "strict"] = "report"  # strict: worse than the same-dtype reference is incorrect
    cache: Literal["cold", "warm"] = "cold"  # cold: caches evicted before every timed call (bench.measure.cold)
    rotate: bool = True  # inputs refreshed in place from seeded sets between timed calls
    calibration: Calibration | None = None


class Task(BaseModel):
    model_config = _STRICT
    case: dict[str, Any]  # every case field, device resolved (auto -> cpu | cuda)
    case_id: str
    params: dict[str, Any]  # as written in the suite: the record's `params`
    impl: str
    measure: MeasureSettings

    @classmethod
    def of(cls, case: Case, impl: str, measure: MeasureSettings | dict[str, Any] | None = None,
           written: Case | None = None) -> Task:
        """The task of measuring `impl` on `case` (its device resolved); `written`: the case as the suite
        wrote it (device auto), whose id and params the record keeps. Default: `case` itself."""
        settings = measure if isinstance(measure, MeasureSettings) else MeasureSettings(**(measure or {}))
        written = written or case
        return cls(case=case.params(), case_id=written.case_id, params=written.params(), impl=impl,
                   measure=settings)
