"""What a record says of a model with its attention swapped ([R4 2/6]) and of a training run with it ([R4 3/6])."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

_STRICT = ConfigDict(extra="forbid", frozen=True)


class QualityInfo(BaseModel):
    """The model scored with the case's attention and with the reference (sdpa under the base pattern), on the
    same samples (bench.measure.quality): accuracy with its interval, the paired sign test, the KL of the
    next-token distributions, and each arm's median forward time of one sample."""

    model_config = _STRICT
    model: str  # a built-in's name, or the model directory
    model_sha256: str
    task: str | dict[str, str | None]  # as the case's params write it
    samples: int
    tokens: int  # tokens per sample
    layers: list[int] | None  # the swapped layers (None: all)
    metric: Literal["accuracy", "ppl"]
    value: float | None = None
    dense_value: float | None = None
    delta: float | None = None  # value - dense_value
    ci95: list[float] | None = None  # of value: percentile bootstrap over samples
    dense_ci95: list[float] | None = None
    p_value: float | None = None  # exact two-sided paired sign test over the samples that differ (accuracy)
    kl_mean: float | None = None  # KL(reference || swapped), nats, over the scored positions
    kl_p95: float | None = None
    model_time_s: float | None = None  # median forward of one sample, swapped
    model_time_dense_s: float | None = None  # the reference arm's
    scored: int | None = None  # positions scored per sample (accuracy: the queries)
    min_detectable_loss: float | None = None  # the smallest accuracy loss these samples can call at 5%
    values: list[float] | None = None  # per sample: the swapped arm's score (accuracy share, or mean NLL)
    dense_values: list[float] | None = None
    error: str | None = None  # why the model could not be scored with this attention (its reason)


class TrainingInfo(BaseModel):
    """A training run from the same weights on the same seeded batches with the case's attention and with the
    reference ([R4 3/6]): the loss of each step and the mean of the last ten."""

    model_config = _STRICT
    steps: int
    lr: float
    loss: float | None = None  # mean of the last 10 steps' losses
    loss_dense: float | None = None
    delta: float | None = None  # loss - loss_dense
    curve: list[float] | None = None  # every step's loss
    curve_dense: list[float] | None = None
    batch: int | None = None  # sequences per step
    time_s: float | None = None  # wall time of the swapped run
    time_dense_s: float | None = None
    error: str | None = None  # why there is no run with this attention (no backward on this device...)
