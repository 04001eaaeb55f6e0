"""Change points in a benchmark series: a weighted L1 piecewise-constant fit, as asv's step detection does.

The series y_1..y_m (one median per commit) is modelled as piecewise constant plus Laplace noise whose
relative amplitude per point is known (weight w_i = 1 / width of that median's confidence interval). For each
number of segments k the exact best fit

    S_k = min over segmentations into k pieces of  sum_r sum_{i in r} w_i |y_i - mu_r|   (mu_r: weighted median)

is found by dynamic programming over all intervals, and k is chosen by the Schwarz-type criterion that asv
uses (Friedrich et al. 2008, Yao 1988; see asv/step_detect.py):

    beta * k + ln(sigma_0 + S_k),    beta = 4 ln(m) / m,

with the noise floor sigma_0 = 0.1 * the smallest jump between fitted levels (0.001 * the smallest level for
one or two segments), which stops the fit from explaining every point by its own segment. asv solves the fixed-
penalty problem approximately and also fits an AR(1) noise correlation; our series are short (one point per
commit with a stored run), so we solve exactly and leave autocorrelation out.

Cost: O(m^2) intervals, each a weighted median; fine for the hundreds of commits a results store holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

MAX_SEGMENTS = 64  # more levels than this in one series is noise, not history


@dataclass(frozen=True)
class Segment:
    """Points [start, stop) share one level: their weighted median `value`.

    `spread` is the weighted mean absolute deviation from it (asv's error estimate of the level).
    """

    start: int
    stop: int
    value: float
    spread: float


def weighted_median(y: np.ndarray, w: np.ndarray) -> float:
    """The value minimising sum w_i |y_i - mu|; exactly at the weight midpoint, the mean of the two neighbours."""
    return float(_prefix_medians(np.asarray(y, float), np.asarray(w, float))[0][-1])


def _prefix_medians(y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mu, cost) for every prefix y[:p], p = 1..L, vectorised: mu[p-1] its weighted median, cost[p-1] the L1 cost.

    Works in sorted order with a (prefix, sorted position) inclusion matrix, O(L^2) memory.
    """
    n = len(y)
    order = np.argsort(y, kind="stable")
    ys, ws = y[order], w[order]
    included = order[None, :] < np.arange(1, n + 1)[:, None]  # [p-1, j]: sorted element j lies in y[:p]
    cum = np.cumsum(np.where(included, ws, 0.0), axis=1)
    half = cum[:, -1:] / 2
    idx = np.argmax(cum >= half * (1 - 1e-12), axis=1)  # first sorted position holding half the weight
    mu = ys[idx]
    at_midpoint = np.isclose(cum[np.arange(n), idx], half[:, 0])
    counts = np.cumsum(included, axis=1)
    nxt = np.argmax(counts >= counts[np.arange(n), idx][:, None] + 1, axis=1)  # next included element
    has_next = counts[:, -1] > counts[np.arange(n), idx]
    mu = np.where(at_midpoint & has_next, (mu + ys[nxt]) / 2, mu)
    cost = np.sum(np.where(included, ws * np.abs(ys[None, :] - mu[:, None]), 0.0), axis=1)
    return mu, cost


def normalized_weights(weights: Sequence[float | None] | None, n: int) -> np.ndarray:
    """Missing, zero or non-finite weights become the median weight; all are scaled by that median."""
    if weights is None:
        return np.ones(n)
    w = np.array([x if x is not None and math.isfinite(x) and x > 0 else np.nan for x in weights], dtype=float)
    valid = w[np.isfinite(w)]
    median = float(np.median(valid)) if len(valid) else 1.0
    w[~np.isfinite(w)] = median
    return w / median


def interval_costs(y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cost, level): cost[l, r] = min_mu sum_{l<=i<r} w_i |y_i - mu|, level[l, r] the minimising mu."""
    n = len(y)
    cost = np.full((n + 1, n + 1), np.inf)
    level = np.full((n + 1, n + 1), np.nan)
    for left in range(n):
        mu, c = _prefix_medians(y[left:], w[left:])
        level[left, left + 1:] = mu
        cost[left, left + 1:] = c
    return cost, level


def best_segmentations(cost: np.ndarray, max_segments: int) -> list[tuple[float, list[int]]]:
    """For k = 1..max_segments: (S_k, boundaries [0, b_1, ..., m]) of the exact best k-piece fit."""
    n = cost.shape[0] - 1
    best = cost[0].copy()  # best[r]: best cost of y[:r] in k pieces
    back: list[np.ndarray] = []
    out = [(float(best[n]), [0, n])]
    for _ in range(2, min(max_segments, n) + 1):
        total = best[:, None] + cost  # [l, r]: best of y[:l] in k-1 pieces, then one piece [l, r)
        back.append(np.argmin(total, axis=0))
        best = np.min(total, axis=0)
        bounds = [n]
        for table in reversed(back):
            bounds.append(int(table[bounds[-1]]))
        bounds.append(0)
        out.append((float(best[n]), bounds[::-1]))
    return out


def fit_levels(y: Sequence[float], weights: Sequence[float | None] | None = None,
               max_segments: int = MAX_SEGMENTS) -> list[Segment]:
    """The piecewise-constant levels of a series, with the number of levels chosen automatically."""
    values = np.asarray(y, dtype=float)
    n = len(values)
    if n == 0:
        return []
    w = normalized_weights(weights, n)
    cost, level = interval_costs(values, w)
    beta = 4 * math.log(n) / n if n > 1 else 0.0
    best_obj, best_bounds = math.inf, [0, n]
    for total, bounds in best_segmentations(cost, max_segments):
        levels = [level[a, b] for a, b in pairwise(bounds)]
        if any(a == b for a, b in pairwise(levels)):
            continue  # two equal neighbours: the (k-1)-piece fit is as good; and sigma_0 would be 0
        if len(levels) > 2:
            sigma0 = 0.1 * min(abs(b - a) for a, b in pairwise(levels))
        else:
            sigma0 = 0.001 * min(abs(v) for v in levels)
        objective = beta * len(levels) + math.log(max(sigma0, 1e-300) + total)
        if objective < best_obj - 1e-12:  # ties keep the fewer segments
            best_obj, best_bounds = objective, bounds
    segments = []
    for a, b in pairwise(best_bounds):
        segments.append(Segment(a, b, float(level[a, b]), float(cost[a, b] / (b - a))))
    return segments


def significant_steps(segments: Sequence[Segment], threshold: float) -> list[int]:
    """Indices i such that the jump from segments[i - 1] to segments[i] is real and larger than `threshold`.

    A jump counts when it exceeds both levels' spreads and `threshold` (a fraction) of the lower level.
    """
    out = []
    for i in range(1, len(segments)):
        before, after = segments[i - 1], segments[i]
        jump = abs(after.value - before.value)
        if jump > max(before.spread, after.spread, threshold * min(before.value, after.value)):
            out.append(i)
    return out
