"""`bench ab` beyond one pair: the sequential rule's error rates by simulation (seeded, fast), and a verdict per
implementation across its cases beside the per-pair ones."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from bench.analysis import ab_stats as st
from bench.analysis.ab import compare_ab
from bench.analysis.ab_sequential import look_levels, obf_spent, sequential_decision, sequential_p
from tests.test_ab_stats import measurement

LOOKS = [15, 20, 25, 30]  # rounds at each look: R, then rounds added while the verdict is open


def simulated_p_values(rng: np.random.Generator, effect: float, sims: int, sigma: float = 0.05) -> np.ndarray:
    """(sims, looks) two-sided signed-rank p-values of per-round log ratios seen at each look."""
    d = rng.normal(effect, sigma, size=(sims, LOOKS[-1]))
    return np.array([[stats.wilcoxon(row[:n]).pvalue for n in LOOKS] for row in d])


def test_spending_adds_up_to_alpha_and_spends_little_early():
    levels = look_levels(LOOKS, 0.05)
    assert abs(sum(levels) - 0.05) < 1e-12 and all(lv > 0 for lv in levels)
    assert levels[0] < 0.05 / 2  # O'Brien-Fleming keeps most of alpha for the last look
    assert abs(obf_spent(1.0, 0.05) - 0.05) < 1e-12 and obf_spent(0.5, 0.05) < 0.01


def test_the_false_alarm_rate_over_all_looks_stays_under_alpha():
    rng = np.random.default_rng(20261202)
    p = simulated_p_values(rng, 0.0, 600)
    rejected = np.mean([sequential_decision(row, LOOKS, 0.05) is not None for row in p])
    looking_naively = np.mean((p < 0.05).any(axis=1))  # testing at 5% at every look, for contrast
    assert rejected <= 0.05 + 0.02, rejected  # 0.05 plus ~2.5 standard errors of 600 draws
    assert looking_naively > rejected


def test_a_real_change_is_decided_early_and_almost_always():
    rng = np.random.default_rng(7)
    p = simulated_p_values(rng, np.log(1.10), 200)
    looks = [sequential_decision(row, LOOKS, 0.05) for row in p]
    assert np.mean([k is not None for k in looks]) >= 0.95
    assert np.mean([k == 0 for k in looks]) >= 0.8  # most at the first look: no rounds added


def test_an_implementation_gets_its_own_verdict_across_its_cases():
    ratios = {(f"c{i}", "blocked"): 1.10 for i in range(6)}
    ratios.update({(f"c{i}", "dense"): 1.0 for i in range(6)})
    result = compare_ab(measurement(ratios, seed=11))
    by_impl = {v.impl: v for v in result.impls}
    assert by_impl["blocked"].verdict == st.SLOWER and 1.07 < by_impl["blocked"].ratio < 1.13
    assert by_impl["dense"].verdict == st.SAME
    doc = result.to_json()
    assert {d["impl"]: d["verdict"] for d in doc["impls"]} == {"blocked": "SLOWER", "dense": "SAME"}


def test_a_small_change_no_pair_proves_alone_is_seen_in_the_implementation():
    ratios = {(f"c{i}", "blocked"): 1.07 for i in range(12)}
    result = compare_ab(measurement(ratios, seed=5, n_rounds=8, sigma=0.08))
    (verdict,) = result.impls
    assert verdict.p_value < 0.05 and verdict.ratio > 1.05


def test_the_sequential_p_value_is_valid_when_the_data_decide_the_stopping():
    """No change; each pair stops at the first look whose p-value is under its level (as bench ab stops adding
    rounds): P(p_seq <= u) stays at or under u."""
    rng = np.random.default_rng(12)
    looks = [15, 30, 45]
    p = np.array([[stats.wilcoxon(row[:n]).pvalue for n in looks] for row in rng.normal(0, 0.05, (800, 45))])
    seq = []
    for row in p:
        stop = sequential_decision(row, looks, 0.05)
        seq.append(sequential_p(row[: (stop + 1 if stop is not None else len(looks))], looks, 0.05))
    seq = np.array(seq)
    for u in (0.01, 0.05, 0.2):
        assert np.mean(seq <= u) <= u + 2.5 * np.sqrt(u * (1 - u) / len(seq)), u
    assert sequential_p([0.01], looks, 0.05) == pytest.approx(min(1.0, 0.01 * 0.05 / look_levels(looks, 0.05)[0]))


def test_a_planted_five_percent_is_found_in_most_pairs_with_added_looks():
    """A true +6.5% (what a planted 5% reads as) over a 5% threshold: one trial of 15 rounds rarely proves it,
    looks up to 45 rounds find most; nothing else is flagged."""
    ratios = {(f"c{i}", "blocked"): 1.065 for i in range(20)}
    ratios.update({(f"c{i}", "dense"): 1.0 for i in range(20)})
    one_look = compare_ab(measurement(ratios, seed=21, sigma=0.02, max_rounds=15))
    looked = compare_ab(measurement(ratios, seed=21, sigma=0.02))
    found = [sum(p.verdict == st.SLOWER and p.impl == "blocked" for p in r.pairs) for r in (one_look, looked)]
    assert found[0] == 0 and found[1] >= 12, found
    assert not any(p.verdict in (st.SLOWER, st.FASTER) for p in looked.pairs if p.impl == "dense")
    assert {v.impl: v.verdict for v in looked.impls} == {"blocked": st.SLOWER, "dense": st.SAME}


def test_too_few_rounds_for_one_pair_says_how_many_would_do():
    from bench.analysis.ab_sequential import smallest_sequential_p
    from bench.run.ab.side import planned_looks

    ratios = {(f"c{i}", "dense"): 1.0 for i in range(3)}
    result = compare_ab(measurement(ratios, seed=2, n_rounds=5, max_rounds=5))
    (note,) = [n for n in result.notes if "cannot reach q < 0.05" in n]
    suggested = int(note.split("--max-rounds ")[1].split()[0])
    assert smallest_sequential_p(planned_looks(5, suggested), 0.05) * 3 <= 0.05
    assert smallest_sequential_p(planned_looks(5, suggested - 1), 0.05) * 3 > 0.05
