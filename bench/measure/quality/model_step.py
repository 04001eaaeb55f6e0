"""A model case's model step, after the kernel's measurement of the same record: the model scored (bench.measure.
quality.evaluate) and, with `train`, trained (bench.measure.quality.train) with the case's attention and with the
reference. A step that raises gives its block with `error`, so that the kernel's measurement stands."""

from __future__ import annotations

from collections.abc import Callable

from bench.measure.case.steps import describe_failure
from bench.measure.quality.evaluate import evaluate_quality, quality_failure
from bench.measure.quality.train import train_against_dense
from bench.results.quality_records import QualityInfo, TrainingInfo
from bench.spec.case import Case


def score_model(case: Case, impl_name: str, phase: Callable[[str], None]) -> tuple[QualityInfo, TrainingInfo | None]:
    """A model case's `quality` and, with `train`, its `training`; a step that raises gives its block with `error`
    (the reason), so that the kernel's measurement of the same record stands."""
    phase("quality")
    try:
        quality = evaluate_quality(case, impl_name)
    except Exception as exc:
        quality = quality_failure(case, describe_failure("quality", exc)[0])
    if case.train is None:
        return quality, None
    phase("training")
    try:
        return quality, train_against_dense(case, impl_name)
    except Exception as exc:
        return quality, TrainingInfo(steps=case.train.steps, lr=case.train.lr,
                                     error=describe_failure("training", exc)[0])
