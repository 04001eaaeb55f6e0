"""The statistics of a model's quality with one attention against the reference's, on the same samples.

Samples are the unit: a sample's score is its share of queries answered (accuracy) or its mean next-token NLL
(perplexity), so the queries or tokens of one sequence, which are not independent, count once together.

- `ci95` of the mean over samples: a percentile bootstrap over samples (seeded, BOOTSTRAP resamples); for
  perplexity, of exp(mean NLL).
- `p_value`: the exact two-sided paired sign test (scipy's binomtest) over the samples whose scores differ
  between the arms; 1.0 when none differ. It assumes nothing about the scores' distribution. Null for perplexity
  (its per-sample NLLs differ almost always by rounding; the interval and the KL say more).
- `kl_mean`, `kl_p95`: KL(reference || swapped) of the next-token distributions at every scored position
  (accuracy: the query positions; perplexity: every predicted token), in nats.
- `min_detectable_loss`: the smallest accuracy loss the sign test can call at alpha with these samples, when every
  sample that differs goes the same way by 1/queries: the fewest discordant samples k with 2 * 0.5**k < alpha
  (6 at 5%), times the smallest step a sample's score can take (1/queries per sample) over the samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import binomtest
from torch import Tensor

BOOTSTRAP = 2000
SEED = 20261203


def bootstrap_ci(values: np.ndarray, transform: str = "mean") -> tuple[float, float]:
    """95% percentile bootstrap of the mean of `values` over resampled samples (exp of it for `exp_mean`)."""
    if values.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(SEED)
    means = values[rng.integers(0, values.size, size=(BOOTSTRAP, values.size))].mean(axis=1)
    if transform == "exp_mean":
        means = np.exp(means)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def sign_test(swapped: np.ndarray, reference: np.ndarray) -> tuple[float, int, int]:
    """(two-sided exact p, samples better swapped, samples better with the reference) over differing samples."""
    diff = swapped - reference
    better, worse = int((diff > 0).sum()), int((diff < 0).sum())
    if better + worse == 0:
        return 1.0, 0, 0
    return float(binomtest(better, better + worse, 0.5).pvalue), better, worse


def min_detectable_loss(samples: int, queries: int, alpha: float = 0.05) -> float:
    """The smallest mean accuracy loss the sign test calls significant at `alpha` with `samples` samples of
    `queries` queries each (every differing sample one query worse)."""
    k = 1
    while 2 * 0.5**k >= alpha:
        k += 1
    return k / max(samples, 1) / max(queries, 1) if k <= samples else math.inf


def kl_divergence(reference_logits: Tensor, swapped_logits: Tensor) -> Tensor:
    """KL(reference || swapped) per position, in nats, from logits (..., V), computed in float64."""
    p = torch.log_softmax(reference_logits.double(), dim=-1)
    q = torch.log_softmax(swapped_logits.double(), dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1)


@dataclass(frozen=True)
class Summary:
    """Two arms compared: the swapped arm's figure, the reference's, their intervals, the sign test, the KL."""

    value: float
    dense_value: float
    ci95: tuple[float, float]
    dense_ci95: tuple[float, float]
    p_value: float | None
    kl_mean: float | None
    kl_p95: float | None

    @property
    def delta(self) -> float:
        return self.value - self.dense_value


def summary_of(metric: str, swapped: np.ndarray, reference: np.ndarray, kl: np.ndarray) -> Summary:
    """The comparison of two arms' per-sample scores (accuracy shares, or mean NLLs for perplexity)."""
    kl_mean = float(kl.mean()) if kl.size else None
    kl_p95 = float(np.percentile(kl, 95)) if kl.size else None
    if metric == "accuracy":
        return Summary(float(swapped.mean()), float(reference.mean()), bootstrap_ci(swapped),
                       bootstrap_ci(reference), sign_test(swapped, reference)[0], kl_mean, kl_p95)
    return Summary(math.exp(float(swapped.mean())), math.exp(float(reference.mean())),
                   bootstrap_ci(swapped, "exp_mean"), bootstrap_ci(reference, "exp_mean"), None, kl_mean, kl_p95)
