"""`bench ab`'s decisions beyond one pair: a verdict per implementation across its cases, and the sequential rule
for adding rounds where a verdict is still open.

Implementation verdict. A change in an implementation's code usually moves all of its cases; each case alone may
lack the rounds to prove it. Across the implementation's interleaved pairs: the signed z of each pair's two-sided
p-value (Stouffer: z_i = sign(log ratio_i) * Phi^-1(1 - p_i / 2)), combined as Z = sum z_i / sqrt(k), and the
geometric mean of the pairs' ratios. SLOWER: the combined two-sided p < alpha and the geometric mean past 1 +
threshold; FASTER mirrored; SAME: the geometric mean inside the band and no pair SLOWER or FASTER; else AMBIGUOUS;
and NOISY when a pair of it was timed busy and the rule would call a change.

Sequential rule (looks at rounds n_1 < n_2 < ... <= n_max): Lan-DeMets alpha spending with the O'Brien-Fleming
function alpha(t) = 2 - 2 Phi(z_{1-alpha/2} / sqrt(t)), t = n_k / n_max. Look k may reject at the nominal level
alpha(t_k) - alpha(t_{k-1}) (the increment spent there); by the union bound over looks the chance that any look
rejects a true null is at most alpha(1) = alpha. (The exact group-sequential boundaries are a little wider at late
looks; the increments are the conservative, closed form.) `tests/test_ab_sequential.py` checks both error rates by
simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

from bench.analysis import ab_stats as st


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


def impl_verdict(impl: str, tests: Sequence[tuple[st.PairedTest, str | None, bool]], threshold: float,
                 alpha: float) -> ImplVerdict | None:
    """The verdict of one implementation from (its pairs' tests, their verdicts, busy) ; None without tests."""
    usable = [(t, v, busy) for t, v, busy in tests if t.note is None and t.ratio > 0 and math.isfinite(t.ratio)]
    if not usable:
        return None
    logs = [math.log(t.ratio) for t, _, _ in usable]
    zs = [math.copysign(float(stats.norm.isf(min(max(t.p_value, 1e-300), 1.0) / 2)), lg)
          for (t, _, _), lg in zip(usable, logs, strict=True)]
    z = sum(zs) / math.sqrt(len(zs))
    p = float(2 * stats.norm.sf(abs(z)))
    mean_log = sum(logs) / len(logs)
    slower = sum(v == st.SLOWER for _, v, _ in usable)
    faster = sum(v == st.FASTER for _, v, _ in usable)
    band = math.log1p(threshold)
    if p < alpha and mean_log > band:
        verdict = st.SLOWER
    elif p < alpha and mean_log < -band:
        verdict = st.FASTER
    elif abs(mean_log) <= band and not slower and not faster:
        verdict = st.SAME
    else:
        verdict = st.AMBIGUOUS
    if verdict in (st.SLOWER, st.FASTER) and any(busy for _, _, busy in usable):
        verdict = st.NOISY
    return ImplVerdict(impl, len(usable), math.exp(mean_log), p, verdict, slower, faster)
