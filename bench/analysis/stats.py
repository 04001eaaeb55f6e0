"""The statistics behind `bench compare`: is NEW slower than BASE for one (case, impl), and how sure are we?

For two sets of timing samples (seconds per call):

- effect size: the ratio of medians NEW / BASE, with a percentile-bootstrap confidence interval of its
  logarithm (both sides resampled independently; scipy.stats.bootstrap, seeded per (case, impl) so that a
  verdict is reproducible run to run). When a side pools several runs of its commit, the bootstrap resamples
  runs and then samples within runs, so the run-to-run variation widens the interval;
- significance: the two-sided Mann-Whitney U test (scipy.stats.mannwhitneyu), which assumes nothing about
  the shape of the timing distribution;
- multiplicity: p-values of all (case, impl) pairs of one comparison are corrected with Benjamini-Hochberg
  (scipy.stats.false_discovery_control), so that among many cases the expected share of false alarms stays
  at `alpha`.

Verdicts, with t = log(1 + threshold) and [lo, hi] the interval of log(NEW / BASE):

- SLOWER: significant after correction (q < alpha) and lo > t: slower, and by more than the threshold;
- FASTER: q < alpha and hi < -t;
- SAME: the whole interval lies within [-t, t]: whatever changed is within the threshold;
- AMBIGUOUS: anything else - too noisy to tell, or a real change whose size straddles the threshold.

Noise therefore makes a verdict AMBIGUOUS, never SLOWER.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from bench.results.records import Record

SLOWER, FASTER, SAME, AMBIGUOUS, NOISY = "SLOWER", "FASTER", "SAME", "AMBIGUOUS", "NOISY"
PATH = "PATH"  # the sides ran different code (a fallback, another path): reported as such, never a change of speed
VERDICTS = (SLOWER, FASTER, SAME, AMBIGUOUS, NOISY, PATH)
MIN_SAMPLES = 3  # per side; below this neither the interval nor the test means anything
N_RESAMPLES = 2000  # bootstrap resamples: the interval's ends move by < 1% of its width between seeds
CONFIDENCE = 0.95


@dataclass(frozen=True)
class TimeTest:
    """One (case, impl) before the multiple-testing correction. Times in seconds, ratios NEW / BASE."""

    n_base: int  # samples, pooled over runs
    n_new: int
    median_base: float
    median_new: float
    ratio: float  # median_new / median_base
    ci_low: float  # confidence interval of the ratio (from the log-ratio interval)
    ci_high: float
    p_value: float  # two-sided Mann-Whitney U; 1.0 when there is nothing to test
    note: str | None = None  # why the test could not be made (too few samples, ...)
    runs_base: int = 1
    runs_new: int = 1


def seed_for(key: str, base_seed: int = 0) -> int:
    """A stable 64-bit seed from a string (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{base_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _log_ratio_of_medians(base: np.ndarray, new: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.log(np.median(new, axis=axis)) - np.log(np.median(base, axis=axis))


def _clean(samples: Sequence[float]) -> np.ndarray:
    x = np.asarray(samples, dtype=float)
    return x[np.isfinite(x) & (x > 0)]


def _bootstrap_cells(n: int) -> int:
    """Resamples per vectorised batch so that one batch holds about 4M floats (32 MB), whatever n is."""
    return max(1, 4_000_000 // max(n, 1))


def hierarchical_medians(runs: list[np.ndarray], n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap distribution of the pooled median, resampling runs and then the samples within each run.

    Two-level resampling puts the run-to-run variation (machine load, clocks, memory layout of a process)
    into the interval, which resampling pooled samples alone would hide.
    """
    sizes = np.array([len(r) for r in runs])
    n_runs, n_max = len(runs), int(sizes.max())
    padded = np.full((n_runs, n_max), np.nan)
    for i, r in enumerate(runs):
        padded[i, :len(r)] = r
    out = np.empty(n_resamples)
    batch = _bootstrap_cells(n_runs * n_max)
    for start in range(0, n_resamples, batch):
        b = min(batch, n_resamples - start)
        chosen = rng.integers(0, n_runs, size=(b, n_runs))  # (b, R): runs drawn with replacement
        n_chosen = sizes[chosen]
        within = (rng.random((b, n_runs, n_max)) * n_chosen[..., None]).astype(np.int64)  # (b, R, n_max)
        values = padded[chosen[..., None], within]
        values[np.arange(n_max)[None, None, :] >= n_chosen[..., None]] = np.nan  # past a short run's end
        out[start:start + b] = np.nanmedian(values.reshape(b, -1), axis=1)
    return out


def compare_samples(base: Sequence[float], new: Sequence[float], seed: int,
                    confidence: float = CONFIDENCE) -> TimeTest:
    """Ratio of medians, its bootstrap interval and the Mann-Whitney p-value for two sample sets (one run each)."""
    return compare_runs([base], [new], seed, confidence)


def compare_runs(base_runs: Sequence[Sequence[float]], new_runs: Sequence[Sequence[float]], seed: int,
                 confidence: float = CONFIDENCE) -> TimeTest:
    """As compare_samples, for sides that pool several runs each (the CI's interleaved rounds).

    One run per side: scipy's percentile bootstrap of the log-ratio of medians. Several: the two-level
    bootstrap of `hierarchical_medians` on each side. The Mann-Whitney test compares the pooled samples.
    """
    b_runs = [r for r in (_clean(x) for x in base_runs) if len(r)]
    n_runs = [r for r in (_clean(x) for x in new_runs) if len(r)]
    b = np.concatenate(b_runs) if b_runs else np.empty(0)
    n = np.concatenate(n_runs) if n_runs else np.empty(0)
    med_b = float(np.median(b)) if len(b) else math.nan
    med_n = float(np.median(n)) if len(n) else math.nan
    ratio = med_n / med_b if len(b) and len(n) else math.nan
    runs_base, runs_new = len(b_runs), len(n_runs)
    if len(b) < MIN_SAMPLES or len(n) < MIN_SAMPLES:
        return TimeTest(len(b), len(n), med_b, med_n, ratio, math.nan, math.nan, 1.0, runs_base=runs_base,
                        runs_new=runs_new,
                        note=f"too few samples ({len(b)} and {len(n)}; need {MIN_SAMPLES} on each side)")
    rng = np.random.default_rng(seed)
    if len(b_runs) == 1 and len(n_runs) == 1:
        boot = stats.bootstrap((b, n), _log_ratio_of_medians, vectorized=True, paired=False, method="percentile",
                               n_resamples=N_RESAMPLES, confidence_level=confidence, rng=rng,
                               batch=_bootstrap_cells(len(b) + len(n)))
        lo, hi = float(boot.confidence_interval.low), float(boot.confidence_interval.high)
    else:
        log_ratios = (np.log(hierarchical_medians(n_runs, N_RESAMPLES, rng))
                      - np.log(hierarchical_medians(b_runs, N_RESAMPLES, rng)))
        tail = (1 - confidence) / 2 * 100
        lo, hi = (float(x) for x in np.percentile(log_ratios, [tail, 100 - tail]))
    p = float(stats.mannwhitneyu(n, b, alternative="two-sided").pvalue)
    if not math.isfinite(p):  # every sample equal on both sides: no evidence of any difference
        p = 1.0
    return TimeTest(len(b), len(n), med_b, med_n, ratio, math.exp(lo), math.exp(hi), p, runs_base=runs_base,
                    runs_new=runs_new)


def benjamini_hochberg(p_values: Sequence[float]) -> list[float]:
    """BH-adjusted p-values (q-values), in the input order."""
    if not len(p_values):
        return []
    return [float(q) for q in stats.false_discovery_control(np.asarray(p_values, dtype=float), method="bh")]


def verdict(test: TimeTest, q_value: float, threshold: float, alpha: float) -> str:
    """SLOWER / FASTER / SAME / AMBIGUOUS for one pair; `threshold` is a fraction (0.1 = 10%)."""
    return interval_verdict(test.ci_low, test.ci_high, test.note, q_value, threshold, alpha)


def interval_verdict(ci_low: float, ci_high: float, note: str | None, q_value: float, threshold: float,
                     alpha: float) -> str:
    """The rule both `bench compare` and `bench ab` judge by, from a ratio's interval and its q-value: SLOWER
    needs significance and the whole interval past 1 + threshold; FASTER mirrored; SAME inside the band."""
    if note is not None or not math.isfinite(ci_low):
        return AMBIGUOUS
    t = math.log1p(threshold)
    lo, hi = math.log(ci_low), math.log(ci_high)
    significant = q_value < alpha
    if significant and lo > t:
        return SLOWER
    if significant and hi < -t:
        return FASTER
    if -t <= lo and hi <= t:
        return SAME
    return AMBIGUOUS


def busy_side(sides: Sequence[tuple[str, Sequence[Record | None]]]) -> str | None:
    """Why a time change cannot be called: `BASE timed on a busy machine (CPU pressure 63% (>= 20%))` for the first
    side with a record measured busy (bench.measure.machine.contention), else None."""
    for name, records in sides:
        for r in records:
            if r is not None and r.busy and r.contention is not None:
                return f"{name} timed on a busy machine ({r.contention.reason})"
    return None


def refuse_busy(verdict: str, busy: str | None) -> str:
    """The one rule of `bench compare` and `bench ab`: a change (SLOWER, FASTER) from a busy side is NOISY."""
    return NOISY if busy is not None and verdict in (SLOWER, FASTER) else verdict


def _describe_path(records: Sequence[Record | None]) -> str:
    paths = sorted({r.code_path for r in records if r is not None})
    return " / ".join(", ".join(part for part in path if part) or "default" for path in paths)


def path_change(base: Sequence[Record | None], new: Sequence[Record | None]) -> str | None:
    """`different code paths: BASE kernel, NEW gather, fallback` where the sides' records ran different code
    (Record.code_path), else None."""
    b = {r.code_path for r in base if r is not None}
    n = {r.code_path for r in new if r is not None}
    if not b or not n or b == n:
        return None
    return f"different code paths: BASE {_describe_path(base)}, NEW {_describe_path(new)}; not compared"


def above_roof(sides: Sequence[tuple[str, Sequence[Record | None]]]) -> str | None:
    """`NEW above the roof (...)` for the first side with a record whose figure passes a roof, else None."""
    for name, records in sides:
        for r in records:
            if r is not None and r.peak is not None and r.peak.above_roof:
                return f"{name} above the roof ({r.peak.above_roof_reason})"
    return None


def judge(verdict: str, busy: str | None, path: str | None, roof: str | None) -> str:
    """The rules `bench compare` and `bench ab` share past the statistics: different code paths are PATH, never a
    change; a change from a busy side is NOISY; no gain is claimed from a record above the roof (AMBIGUOUS)."""
    if path is not None:
        return PATH
    verdict = refuse_busy(verdict, busy)
    return AMBIGUOUS if roof is not None and verdict == FASTER else verdict
