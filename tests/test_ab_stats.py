"""`bench ab`'s statistics and report on synthetic interleaved rounds: no processes, no clocks.

Rounds are generated as bench.run.ab.command measures them: per round one block of samples per side, both multiplied by
a drift common to the round (the machine's load changing between rounds, much larger than the effects), and the
NEW side by the true ratio. A pair whose verdict is still open gets more trials, as `measure_pairs` does.
"""

from __future__ import annotations

import io
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from bench.analysis import ab_stats as st
from bench.analysis.ab import ABResult, compare_ab
from bench.analysis.ab_report import markdown, print_ab
from bench.analysis.ab_sequential import PairTime, open_pairs, time_verdict
from bench.analysis.stats import seed_for
from bench.results.environment import Environment
from bench.run.ab.command import ABMeasurement, PairMeasurement, SideRun, round_orders
from bench.run.ab.side import planned_looks
from bench.run.ab.worktrees import Checkout
from tests.synthetic import record

LABEL = "local_w16 N=128 B1H2D32 fp32 fwd"


def rounds_for(rng: np.random.Generator, ratio: float, n_rounds: int = 15, sigma: float = 0.03,
               drift: float = 0.3, base_s: float = 1e-4, calls: int = 9
               ) -> list[tuple[list[float], list[float]]]:
    out = []
    for _ in range(n_rounds):
        common = base_s * rng.lognormal(0.0, drift)
        base = list(common * rng.lognormal(0.0, sigma, calls))
        new = list(common * ratio * rng.lognormal(0.0, sigma, calls))
        out.append((base, new))
    return out


def side(role: str) -> SideRun:
    co = Checkout(role, "HEAD", Path(f"/tmp/{role}"), "a" * 40, worktree=True)
    return SideRun(co, "smoke", "suites/smoke.yaml", str(co.path), Path(f"/results/{role}"), f"run-{role}",
                   Environment.model_validate({"fingerprint": "f00d", "git": {"dirty": False}}))


def measurement(ratios: dict[tuple[str, str], float], *, seed: int = 0, later_ratio: dict | None = None,
                threshold: float = 0.05, alpha: float = 0.05, max_rounds: int = 45, **kw) -> ABMeasurement:
    """Pairs with the given true ratios; while a pair's verdict is open it gets another trial (its true ratio
    from `later_ratio`, default the same), up to max_rounds - what bench.run.ab.pairs.measure_pairs does."""
    rng = np.random.default_rng(seed)
    n_rounds = kw.get("n_rounds", 15)
    looks = planned_looks(n_rounds, max_rounds)
    pairs = []
    for (case_id, impl), ratio in ratios.items():
        rec = record(case_id, impl, [1e-4] * 5)
        pm = PairMeasurement(case_id, impl, f"{case_id} {LABEL}", "interleaved", rec, rec, rounds_for(rng, ratio, **kw))
        pairs.append(pm)
    for look in range(1, len(looks)):
        flags = open_pairs([pm.trials() for pm in pairs], [seed_for(f"{pm.case_id}|{pm.impl}", 0) for pm in pairs],
                           looks, threshold, alpha)
        for pm, flag in zip(pairs, flags, strict=True):
            if flag and len(pm.trials()) == look:
                again = (later_ratio or {}).get((pm.case_id, pm.impl), ratios[pm.key])
                pm.more_trials.append(rounds_for(rng, again, **{**kw, "n_rounds": looks[look] - looks[look - 1]}))
    return ABMeasurement(side("BASE"), side("NEW"), pairs, [], [], n_rounds, 0.005, 3, 12.0, looks=looks)


def test_aa_is_quiet_over_many_pairs_and_seeds():
    """A/A: 0 SLOWER and 0 FASTER over 2 x 60 pairs whose rounds drift by 30% - and exit 0."""
    for seed in range(2):
        ratios = {(f"c{i}", impl): 1.0 for i in range(30) for impl in ("dense", "blocked")}
        result = compare_ab(measurement(ratios, seed=seed))
        counts = result.verdict_counts()
        assert counts[st.SLOWER] == counts[st.FASTER] == 0, counts
        assert result.exit_code == 0 and not result.regressions()


def test_planted_ten_percent_is_found_and_nothing_else():
    ratios = {(f"c{i}", "blocked"): 1.10 for i in range(20)}
    ratios.update({(f"c{i}", "dense"): 1.0 for i in range(20)})
    result = compare_ab(measurement(ratios, seed=7))
    slower = [p for p in result.pairs if p.verdict == st.SLOWER]
    assert sum(p.impl == "blocked" for p in slower) >= 18  # >= 90% of the planted pairs
    assert all(p.impl == "blocked" for p in slower)
    assert not any(p.verdict == st.FASTER for p in result.pairs)
    assert result.exit_code == 1
    for p in slower:  # the interval lies past the threshold, and the MDE is stated
        assert p.test is not None and p.test.ci_low > 1.05 and p.mde is not None and 0.05 < p.mde < 0.2
        assert len(p.trials) >= 2 and st.trials_past(st.SLOWER, p.trials, 0.05) >= 2


def test_planted_improvement_is_faster_and_not_a_regression():
    result = compare_ab(measurement({("c0", "blocked"): 0.8, ("c1", "dense"): 1.0}, seed=3))
    assert result.pairs[0].verdict == st.FASTER and result.exit_code == 0
    assert result.improvements() and not result.regressions()


def test_a_change_later_trials_do_not_repeat_is_not_a_verdict():
    """One worker favoured for a few seconds: +30% in the first trial, nothing on fresh workers."""
    ratios = {("c0", "dense"): 1.3, ("c1", "dense"): 1.3, ("c2", "dense"): 1.0}
    result = compare_ab(measurement(ratios, seed=1, later_ratio={("c0", "dense"): 1.0, ("c1", "dense"): 1.0}))
    transient = result.pairs[:2]
    assert all(len(p.trials) >= 2 for p in transient)  # open after the first trial: looked at again
    assert not any(p.verdict in (st.SLOWER, st.FASTER) for p in result.pairs)
    assert result.exit_code == 0
    assert len(result.pairs[2].trials) == 1  # SAME after its first trial: no rounds added
    doc = result.to_json()
    assert [len(p["time"]["trials"]) for p in doc["pairs"]] == [len(p.trials) for p in result.pairs]
    assert sum("got more trials on fresh workers" in n for n in result.notes) == 1


def test_slower_needs_two_trials_past_the_threshold_on_their_own():
    """The rule behind SLOWER beside the pooled test: a pooled reading past the threshold with one trial past it
    alone is AMBIGUOUS (not_repeated); with two it stands."""
    rng = np.random.default_rng(3)
    far, near = rounds_for(rng, 1.3), rounds_for(rng, 1.02)
    pooled = st.paired_test(far, 1)  # as if every round had read +30%
    one = PairTime(pooled, (st.paired_test(far, 1), st.paired_test(near, 1)), 1e-6)
    two = PairTime(pooled, (st.paired_test(far, 1), st.paired_test(rounds_for(rng, 1.3), 1)), 1e-6)
    assert time_verdict(one, 1e-6, 0.05, 0.05) == (st.AMBIGUOUS, True)
    assert time_verdict(two, 1e-6, 0.05, 0.05) == (st.SLOWER, False)


def test_without_a_second_trial_nothing_is_slower():
    """SLOWER needs the change repeated: a measurement with no look after the first cannot fail on time."""
    rng = np.random.default_rng(5)
    rec = record("c0", "dense", [1e-4] * 5)
    pm = PairMeasurement("c0", "dense", LABEL, "interleaved", rec, rec, rounds_for(rng, 1.5))
    result = compare_ab(ABMeasurement(side("BASE"), side("NEW"), [pm], [], [], 15, 0.005, 3, 1.0))
    assert result.pairs[0].verdict == st.AMBIGUOUS and result.pairs[0].not_repeated and result.exit_code == 0


def test_noise_too_large_for_the_threshold_says_so_with_its_mde():
    result = compare_ab(measurement({("c0", "dense"): 1.0, ("c1", "dense"): 1.02}, seed=2, sigma=0.5))
    assert {p.verdict for p in result.pairs} == {st.NOISY}
    assert all(p.mde is not None and p.mde > 0.15 for p in result.pairs)
    assert sum("too noisy for the 5% threshold" in n for n in result.notes) == 1  # one note for both pairs


def test_mde_shrinks_towards_the_threshold_with_rounds():
    rng = np.random.default_rng(4)
    few = st.paired_test(rounds_for(rng, 1.0, n_rounds=10), seed=1)
    many = st.paired_test(rounds_for(rng, 1.0, n_rounds=160), seed=1)
    assert st.mde(many, 0.05, 0.05) < st.mde(few, 0.05, 0.05)
    assert 0.05 < st.mde(many, 0.05, 0.05) < 0.08
    assert st.mde(few, 0.05, 0.05) == pytest.approx(
        math.expm1(math.log1p(0.05) + st.z_sum(0.05) * few.se))


def test_verdict_rules_on_intervals():
    def t(lo: float, hi: float) -> st.PairedTest:
        return st.PairedTest(15, math.sqrt(lo * hi), lo, hi, 1e-4, 0.01, 0.003, 1e-4, 1e-4)

    assert st.verdict(t(1.08, 1.2), 0.001, 0.05, 0.05) == st.SLOWER
    assert st.verdict(t(1.08, 1.2), 0.2, 0.05, 0.05) != st.SLOWER  # not significant after BH
    assert st.verdict(t(1.03, 1.2), 0.001, 0.05, 0.05) == st.AMBIGUOUS  # the interval reaches under 5%
    assert st.verdict(t(0.98, 1.03), 0.5, 0.05, 0.05) == st.SAME
    assert st.verdict(t(0.8, 0.9), 0.001, 0.05, 0.05) == st.FASTER
    few = st.paired_test(rounds_for(np.random.default_rng(0), 2.0, n_rounds=3), seed=0)
    assert few.note and "too few rounds" in few.note and st.verdict(few, 0.0, 0.05, 0.05) == st.AMBIGUOUS


def test_round_orders_are_balanced_and_drawn():
    orders = round_orders(15, random.Random(1))
    assert len(orders) == 15 and abs(orders.count("BN") - orders.count("NB")) == 1
    assert round_orders(14, random.Random(1)).count("BN") == 7
    assert round_orders(14, random.Random(1)) != round_orders(14, random.Random(2))


def test_verdicts_repeat_exactly_for_the_same_rounds():
    ratios = {(f"c{i}", "dense"): 1.0 + 0.05 * i for i in range(4)}
    a, b = compare_ab(measurement(ratios, seed=9)), compare_ab(measurement(ratios, seed=9))
    assert a.to_json()["pairs"] == b.to_json()["pairs"]


# --- the report ----------------------------------------------------------------------------------------------


def _mixed() -> ABResult:
    ratios = {(f"case{i}-with-a-rather-long-identifier", impl): r for i, (impl, r) in
              enumerate([("blocked", 1.25), ("triton_block_sparse", 1.3), ("dense", 1.0), ("csr", 0.7),
                         ("naive_loop", 1.0), ("sdpa", 1.0)])}
    m = measurement(ratios, seed=11)
    broken = m.pairs[4]  # a status change (the oracle check failed at open): a regression, no time verdict
    broken.new = record(broken.case_id, broken.impl, None, status="incorrect", rel_l2=0.5,
                        reason="max |err| 0.5 over tolerance 1e-4 " * 3)
    broken.mode, broken.rounds, broken.note = "ended", [], "a side ended before timing (skipped or failed)"
    return compare_ab(m)


def _printed(result: ABResult, **kw) -> list[str]:
    buf = io.StringIO()
    print_ab(result, Console(file=buf, width=100, force_terminal=False, color_system=None), **kw)
    return buf.getvalue().splitlines()


def test_report_regressions_first_fits_100_columns_summary_last():
    result = _mixed()
    lines = _printed(result)
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    text = "\n".join(lines)
    assert text.index("REGRESSIONS (3)") < text.index("IMPROVEMENTS (1)") < text.index("notes:")
    summary = next(i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("REGRESSION in 3 pairs"))
    assert all(line.startswith("  ") for line in lines[summary + 1:])  # the summary (wrapped) comes last
    assert "1 improved" in lines[summary]
    for p in result.pairs:  # every ratio in full, never cut
        if p.verdict in (st.SLOWER, st.FASTER):
            assert f"{(p.test.ratio - 1) * 100:+.1f}%" in text
    assert "every case: local_w16 N=128 B1H2D32 fp32 fwd" in text  # the words every label shares, said once
    assert "MDE" in text and "q " in text
    assert len(_printed(result, show_all=True)) > len(lines)


def test_markdown_job_summary():
    result = _mixed()
    md = markdown(result)
    assert md.startswith("### bench ab `smoke`: 3 regressions, 1 improvement")
    assert "#### Regressions" in md and "| verdict | impl | case |" in md and "<details>" in md
    assert "**Summary:** REGRESSION in 3 pairs" in md
    assert "| ok -&gt; incorrect | naive_loop |" in md  # the status change, its ">" escaped for the page


def test_json_has_no_nan_and_keeps_the_rounds():
    result = _mixed()
    doc = json.loads(json.dumps(result.to_json(), allow_nan=False))
    assert doc["schema"] == "bench-ab/1" and doc["exit_code"] == 1
    timed = [p for p in doc["pairs"] if p["time"]]
    for p in timed:
        t = p["time"]
        assert len(t["round_values_s"]) == sum(x["rounds"] for x in t["trials"]) == 15 * t["looks"]
        assert t["mde_pct"] > 0
    assert doc["settings"]["looks"] == [15, 30, 45]
    assert doc["summary"]["regressions"] == 3 and doc["settings"]["threshold_pct"] == 5.0
