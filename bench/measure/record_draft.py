"""What a pair session learns of its record before the record's status is known."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from bench.inputs import InputsInfo
from bench.results.records import (
    AttentionStats,
    ErrorInfo,
    FidelityInfo,
    QualityInfo,
    SelectionInfo,
    SetupTimes,
    TimingInfo,
    TrainingInfo,
)


class RecordDraft(BaseModel):
    """The record's fields a pair session learns as it goes, before its status is known (the same names and
    types as Record's)."""

    model_config = ConfigDict(validate_assignment=False)

    device: str | None = None
    density: float | None = None
    block_density: float | None = None
    flops: float | None = None
    flops_dense: float | None = None
    bytes: int | None = None
    inputs: InputsInfo | None = None
    attention_stats: AttentionStats | None = None
    setup_s: float | None = None
    setup: SetupTimes | None = None
    config: dict[str, Any] | None = None
    interpreter: bool = False
    check_s: float | None = None
    memory_s: float | None = None
    error: ErrorInfo | None = None
    fidelity: FidelityInfo | None = None
    selection: SelectionInfo | None = None
    quality: QualityInfo | None = None
    training: TrainingInfo | None = None
    time_fwd_s: float | None = None
    time_bwd_s: float | None = None
    flops_bwd: float | None = None
    timing: TimingInfo | None = None
