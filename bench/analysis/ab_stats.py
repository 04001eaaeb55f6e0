"""The statistics behind `bench ab`: one (case, impl) measured in R interleaved rounds, BASE and NEW per round.

Round i times one block of calls on each side, back to back in a random order, so whatever the machine does
at that moment falls on both. The round's ratio r_i = min(NEW block) / min(BASE block) is paired: drift between
rounds cancels in it. A block's fastest call (`block_time`) rather than its median: on a loaded machine other
processes only ever add time to a call, and with a few runnable processes per core most calls of a block are
cut by a time slice. Measured on the shared 2-core machine (load 8), the spread of the per-round log ratios of
an A/A pair was 0.10-0.16 with block medians and 0.024-0.027 with block minima. With d_i = log r_i:

- effect: the median of d_i (reported as the ratio exp(median) - a 1.12 is 12% slower);
- interval: the percentile bootstrap interval (95%) of that median (scipy.stats.bootstrap, seeded per pair, so a
  verdict repeats exactly for the same samples);
- significance: the two-sided Wilcoxon signed-rank test of d_i against 0 (scipy.stats.wilcoxon, exact for the
  round counts used here); p-values of all pairs are corrected with Benjamini-Hochberg
  (bench.analysis.stats.benjamini_hochberg), so the expected share of false discoveries stays at alpha;
- noise: sigma = 1.4826 MAD(d) (a standard deviation that ignores a round hit by a burst), and the median's
  standard error SE = sqrt(pi/2) sigma / sqrt(R);
- minimum detectable effect (MDE): the smallest true slowdown this pair would be called SLOWER for with
  probability 0.8, at the noise measured: log(1 + MDE) = log(1 + threshold) + (z(1 - alpha/2) + z(0.8)) SE.
  It shrinks towards the threshold as rounds are added.

Verdicts, with t = log(1 + threshold) and [lo, hi] the interval of the median of d:

- SLOWER: q < alpha and lo > t - significant, and the whole interval past the threshold;
- FASTER: q < alpha and hi < -t;
- SAME: [lo, hi] within [-t, t]: whatever changed is within the threshold;
- NOISY: none of these, and the noise alone hides a change of the threshold's size ((z + z) SE > t): the
  verdict says so instead of guessing;
- AMBIGUOUS: none of these either (a real change whose size straddles the threshold, or too few rounds).

A/A-like noise therefore gives SAME, NOISY or AMBIGUOUS, never SLOWER unless the noise itself is paired with one
side for a whole pair. That does happen: a state that favours one worker process for seconds (where the scheduler
put it, its memory layout) read as +20% to +50% in a few consecutive pairs of A/A runs on the shared 2-core
machine. So a pair whose verdict is still open after its R rounds - a change seen once included - gets more
trials of R rounds on fresh workers after all the others (bench.analysis.ab_sequential: the looks, the error rate
held over them); its verdict comes from every trial's rounds together, and SLOWER or FASTER stands only if two
trials on their own read past the threshold the same way (`trials_past`). A real change repeats; a transient
state of one process does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from bench.analysis.stats import interval_verdict

SLOWER, FASTER, SAME, NOISY, AMBIGUOUS = "SLOWER", "FASTER", "SAME", "NOISY", "AMBIGUOUS"
VERDICTS = (SLOWER, FASTER, SAME, NOISY, AMBIGUOUS)
MIN_ROUNDS = 5  # below this the signed-rank test cannot reach p < 0.05 at all (2 / 2^4 = 0.125)
CONFIDENCE = 0.95
POWER = 0.8
N_RESAMPLES = 2000
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
MEDIAN_SE = math.sqrt(math.pi / 2)  # standard error of a median over that of a mean, for normal data


@dataclass(frozen=True)
class PairedTest:
    """One interleaved pair before the multiple-testing correction. Ratios NEW / BASE."""

    rounds: int
    ratio: float  # exp(median of the log ratios)
    ci_low: float  # bootstrap interval of that ratio
    ci_high: float
    p_value: float  # two-sided Wilcoxon signed-rank; 1.0 when there is nothing to test
    sigma: float  # robust standard deviation of the per-round log ratios
    se: float  # standard error of their median
    median_base: float  # seconds: the median over rounds of BASE's block times
    median_new: float
    note: str | None = None  # why no test could be made


def block_time(samples: Sequence[float]) -> float:
    """What one block says about its side: its fastest call (seconds)."""
    return min(samples)


def round_log_ratios(rounds: Sequence[tuple[Sequence[float], Sequence[float]]]) -> np.ndarray:
    """log(block_time(NEW) / block_time(BASE)) per round; rounds with an empty or non-positive block dropped."""
    out = []
    for base, new in rounds:
        b = [x for x in base if math.isfinite(x) and x > 0]
        n = [x for x in new if math.isfinite(x) and x > 0]
        if b and n:
            out.append(math.log(block_time(n) / block_time(b)))
    return np.asarray(out, dtype=float)


def _median_log(d: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(d, axis=axis)


def z_sum(alpha: float, power: float = POWER) -> float:
    """z(1 - alpha/2) + z(power): how many standard errors separate a detectable effect from the threshold."""
    return float(stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power))


def paired_test(rounds: Sequence[tuple[Sequence[float], Sequence[float]]], seed: int,
                confidence: float = CONFIDENCE) -> PairedTest:
    """The effect, its interval, the signed-rank p-value and the noise of one pair's rounds."""
    d = round_log_ratios(rounds)
    medians_b = [block_time(b) for b, n in rounds if b and n]
    medians_n = [block_time(n) for b, n in rounds if b and n]
    med_b = float(np.median(medians_b)) if medians_b else math.nan
    med_n = float(np.median(medians_n)) if medians_n else math.nan
    if len(d) < MIN_ROUNDS:
        ratio = math.exp(float(np.median(d))) if len(d) else math.nan
        return PairedTest(len(d), ratio, math.nan, math.nan, 1.0, math.nan, math.nan, med_b, med_n,
                          note=f"too few rounds ({len(d)}; need {MIN_ROUNDS})")
    center = float(np.median(d))
    sigma = MAD_TO_SIGMA * float(np.median(np.abs(d - center)))
    se = MEDIAN_SE * sigma / math.sqrt(len(d))
    if np.all(d == d[0]):  # no spread at all: the interval is the point, and the test has nothing to rank
        lo = hi = center
    else:
        boot = stats.bootstrap((d,), _median_log, vectorized=True, method="percentile", n_resamples=N_RESAMPLES,
                               confidence_level=confidence, rng=np.random.default_rng(seed))
        lo, hi = float(boot.confidence_interval.low), float(boot.confidence_interval.high)
    p = signed_rank_p(d)
    return PairedTest(len(d), math.exp(center), math.exp(lo), math.exp(hi), p, sigma, se, med_b, med_n)


def signed_rank_p(d: np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p-value of d against 0; 1.0 when every d is 0."""
    if not np.any(d != 0):
        return 1.0
    try:
        p = float(stats.wilcoxon(d, alternative="two-sided").pvalue)
    except ValueError:
        return 1.0
    return p if math.isfinite(p) else 1.0


def smallest_p(rounds: int) -> float:
    """The smallest two-sided signed-rank p-value R rounds can give (every round the same sign): 2 / 2^R."""
    return 2.0 / 2.0 ** rounds


def mde(test: PairedTest, threshold: float, alpha: float, power: float = POWER) -> float:
    """The smallest true slowdown (a fraction: 0.12 = 12%) called SLOWER with probability `power` at this noise."""
    if not math.isfinite(test.se):
        return math.inf
    return math.expm1(math.log1p(threshold) + z_sum(alpha, power) * test.se)


def too_noisy(test: PairedTest, threshold: float, alpha: float, power: float = POWER) -> bool:
    """The noise alone hides a change the size of the threshold: (z + z) SE > log(1 + threshold)."""
    return not math.isfinite(test.se) or z_sum(alpha, power) * test.se > math.log1p(threshold)


def verdict(test: PairedTest, q_value: float, threshold: float, alpha: float) -> str:
    """SLOWER / FASTER / SAME / NOISY / AMBIGUOUS for one pair; `threshold` a fraction (0.1 = 10%)."""
    judged = interval_verdict(test.ci_low, test.ci_high, test.note, q_value, threshold, alpha)
    if judged == AMBIGUOUS and test.note is None and math.isfinite(test.ci_low) and too_noisy(test, threshold,
                                                                                              alpha):
        return NOISY
    return judged


def trials_past(direction: str, trials: Sequence[PairedTest], threshold: float) -> int:
    """How many trials, each on its own, read a median ratio past the threshold in `direction` (SLOWER/FASTER)."""
    t = math.log1p(threshold)
    past = 0
    for trial in trials:
        if trial.note is None and math.isfinite(trial.ratio) and trial.ratio > 0:
            d = math.log(trial.ratio)
            past += d > t if direction == SLOWER else d < -t
    return past
