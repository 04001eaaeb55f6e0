"""`bench ab`'s decisions beyond one pair: a verdict per implementation across its cases, and the sequential rule
for adding rounds where a verdict is still open.

Implementation verdict. A change in an implementation's code usually moves all of its cases; each case alone may
lack the rounds to prove it. Across the implementation's interleaved pairs: the signed z of each pair's two-sided
sequential p-value (below; Stouffer: z_i = sign(log ratio_i) * Phi^-1(1 - p_i / 2)), combined as
Z = sum z_i / sqrt(k), and the geometric mean of the pairs' ratios. SLOWER: the combined two-sided p < alpha and
the geometric mean past 1 + threshold; FASTER mirrored; SAME: the geometric mean inside the band and no pair
SLOWER or FASTER; else AMBIGUOUS; and NOISY when a pair of it was timed busy and the rule would call a change.

Sequential rule. A pair is first seen after R rounds; while its verdict is still open (NOISY, AMBIGUOUS, or a
change not yet seen in two trials) bench ab adds a trial of R more rounds on fresh workers, up to --max-rounds
(looks n_1 = R < n_2 = 2R < ... <= n_max) and while the run's time budget lasts. The error rate is held with
Lan-DeMets alpha spending and the O'Brien-Fleming function alpha(t) = 2 - 2 Phi(z_{1-alpha/2} / sqrt(t)),
t = n_k / n_max: look k may reject at the nominal level a_k = alpha(t_k) - alpha(t_{k-1}), the increment spent
there (the a_k add up to alpha, little of it early). Across pairs this becomes one p-value per pair,
p_seq = min_k p_k / w_k with w_k = a_k / alpha (weights adding up to 1): with no change, P(p_seq <= u) <=
sum_k u w_k = u by the union bound over looks, so p_seq is a valid p-value whatever the data made the run stop
at, and Benjamini-Hochberg across pairs takes it like any other. p_seq < alpha is exactly "some look k had
p_k < a_k". (The exact group-sequential boundaries are a little wider at late looks; the increments are the
conservative, closed form.) `tests/test_ab_sequential.py` checks both error rates by simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

from bench.analysis import ab_stats as st
from bench.analysis.stats import benjamini_hochberg


def obf_spent(t: float, alpha: float) -> float:
    """O'Brien-Fleming-type spending: the share of two-sided alpha spent by information fraction t in (0, 1]."""
    if t <= 0:
        return 0.0
    return float(2 - 2 * stats.norm.cdf(stats.norm.ppf(1 - alpha / 2) / math.sqrt(min(t, 1.0))))


def look_levels(looks: Sequence[int], alpha: float) -> list[float]:
    """The nominal two-sided level of each look (rounds so far at each look, increasing; the last is n_max)."""
    n_max = looks[-1]
    spent = [obf_spent(n / n_max, alpha) for n in looks]
    return [s - (spent[i - 1] if i else 0.0) for i, s in enumerate(spent)]


def sequential_p(p_values: Sequence[float], looks: Sequence[int], alpha: float) -> float:
    """The pair's p-value over the looks it had (p_values[k]: the test on every round up to look k)."""
    levels = look_levels(looks, alpha)
    return min(1.0, min((p * alpha / level for p, level in zip(p_values, levels, strict=False)), default=1.0))


def smallest_sequential_p(looks: Sequence[int], alpha: float) -> float:
    """The smallest p_seq a pair can reach: every round of a look the same sign (signed-rank p = 2 / 2^n)."""
    return sequential_p([st.smallest_p(n) for n in looks], looks, alpha)


def sequential_decision(p_values: Sequence[float], looks: Sequence[int], alpha: float) -> int | None:
    """The first look (index) whose p-value is under its level, or None: the verdict stays open."""
    for k, (p, level) in enumerate(zip(p_values, look_levels(looks, alpha), strict=False)):
        if p < level:
            return k
    return None


@dataclass(frozen=True)
class ImplVerdict:
    impl: str
    pairs: int  # interleaved pairs with a test
    ratio: float  # geometric mean of the pairs' NEW / BASE ratios
    p_value: float  # Stouffer's combination, two-sided
    verdict: str
    slower_pairs: int
    faster_pairs: int


def impl_verdict(impl: str, tests: Sequence[tuple[st.PairedTest, float, str | None, bool]], threshold: float,
                 alpha: float) -> ImplVerdict | None:
    """The verdict of one implementation from (its pairs' pooled tests, sequential p-values, verdicts, busy);
    None without tests."""
    usable = [(t, p, v, busy) for t, p, v, busy in tests
              if t.note is None and t.ratio > 0 and math.isfinite(t.ratio)]
    if not usable:
        return None
    logs = [math.log(t.ratio) for t, _, _, _ in usable]
    zs = [math.copysign(float(stats.norm.isf(min(max(p, 1e-300), 1.0) / 2)), lg)
          for (_, p, _, _), lg in zip(usable, logs, strict=True)]
    z = sum(zs) / math.sqrt(len(zs))
    p = float(2 * stats.norm.sf(abs(z)))
    mean_log = sum(logs) / len(logs)
    slower = sum(v == st.SLOWER for _, _, v, _ in usable)
    faster = sum(v == st.FASTER for _, _, v, _ in usable)
    band = math.log1p(threshold)
    if p < alpha and mean_log > band:
        verdict = st.SLOWER
    elif p < alpha and mean_log < -band:
        verdict = st.FASTER
    elif abs(mean_log) <= band and not slower and not faster:
        verdict = st.SAME
    else:
        verdict = st.AMBIGUOUS
    if verdict in (st.SLOWER, st.FASTER) and any(busy for _, _, _, busy in usable):
        verdict = st.NOISY
    return ImplVerdict(impl, len(usable), math.exp(mean_log), p, verdict, slower, faster)


# --- one pair over its trials ----------------------------------------------------------------------------------

Rounds = Sequence[tuple[Sequence[float], Sequence[float]]]


@dataclass(frozen=True)
class PairTime:
    """One interleaved pair seen over its trials (trial 1: the first R rounds; each later trial: one more look,
    on fresh workers)."""

    pooled: st.PairedTest  # every round of every trial
    trials: tuple[st.PairedTest, ...]  # each trial alone
    p_sequential: float  # sequential_p over the looks taken


def pair_time(trials: Sequence[Rounds], seed: int, looks: Sequence[int], alpha: float) -> PairTime:
    pooled_rounds: list[tuple[Sequence[float], Sequence[float]]] = []
    p_at_looks = []
    for trial in trials:
        pooled_rounds.extend(trial)
        d = st.round_log_ratios(pooled_rounds)  # the test at this look (paired_test's p, without its bootstrap)
        p_at_looks.append(st.signed_rank_p(d) if len(d) >= st.MIN_ROUNDS else 1.0)
    pooled = st.paired_test(pooled_rounds, seed)
    return PairTime(pooled, tuple(st.paired_test(t, seed) for t in trials), sequential_p(p_at_looks, looks, alpha))


def time_verdict(pt: PairTime, q_value: float, threshold: float, alpha: float) -> tuple[str, bool]:
    """(verdict, not_repeated). The pooled rounds give the verdict (ab_stats.verdict); SLOWER or FASTER also
    needs two trials, each on its own past the threshold that way: a state favouring one worker process for
    seconds fakes a change in one trial, not in two on different processes. Else AMBIGUOUS, not_repeated."""
    verdict = st.verdict(pt.pooled, q_value, threshold, alpha)
    if verdict in (st.SLOWER, st.FASTER) and st.trials_past(verdict, pt.trials, threshold) < 2:
        return st.AMBIGUOUS, True
    return verdict, False


@dataclass(frozen=True)
class TimeJudgement:
    q_value: float | None  # BH over the sequential p of every pair with a test; None without one
    verdict: str
    not_repeated: bool


def judge(times: Sequence[PairTime], threshold: float, alpha: float) -> list[TimeJudgement]:
    """Every pair's time verdict, its sequential p corrected with all the others' (Benjamini-Hochberg): what
    compare_ab reports, and what open_pairs asks of the pairs so far between looks."""
    tested = [i for i, pt in enumerate(times) if pt.pooled.note is None]
    q_values = dict(zip(tested, benjamini_hochberg([times[i].p_sequential for i in tested]), strict=True))
    return [TimeJudgement(q_values.get(i), *time_verdict(pt, q_values.get(i, 1.0), threshold, alpha))
            for i, pt in enumerate(times)]


def open_pairs(trials: Sequence[Sequence[Rounds]], seeds: Sequence[int], looks: Sequence[int], threshold: float,
               alpha: float) -> list[bool]:
    """For each pair (its trials so far), would another look help? Its verdict, with the BH q-value of its
    sequential p among every pair's so far (what the final verdict will use), is NOISY or AMBIGUOUS - a change
    seen in one trial only included - and it has looks left. SAME and a change seen in two trials are decided."""
    times = [pair_time(t, seed, looks, alpha) for t, seed in zip(trials, seeds, strict=True)]
    return [len(pair_trials) < len(looks) and judged.verdict in (st.NOISY, st.AMBIGUOUS)
            for pair_trials, judged in zip(trials, judge(times, threshold, alpha), strict=True)]
