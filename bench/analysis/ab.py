"""`bench ab BASE NEW SUITE`: the verdicts of an interleaved A/B run (measured by bench.run.ab.command).

For every (case, impl) both sides ran:

- deterministic figures (status, FLOPs, density, correctness numbers, communication bytes, CUDA peak memory) are
  compared exactly with `bench compare`'s own comparison (bench.analysis.figures.figure_changes);
- interleaved pairs get a time verdict from their paired per-round ratios over every trial they had
  (bench.analysis.ab_stats), each pair's sequential p-value over its looks (bench.analysis.ab_sequential)
  corrected with all the others' (Benjamini-Hochberg), and a minimum detectable effect each;
- pairs whose time is not interleaved (Triton interpreter, distributed, a side that ended early) say why.

Regressions (exit 1): a SLOWER verdict, a pair that became failed or incorrect, more communication bytes.
`compare_ab` is pure given the measurement (the bootstrap is seeded per pair), so it is tested with synthetic
rounds; `run_ab` measures and compares.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from bench.analysis import ab_stats as st
from bench.analysis.ab_sequential import (
    ImplVerdict,
    PairTime,
    impl_verdict,
    judge,
    open_pairs,
    pair_time,
    smallest_sequential_p,
)
from bench.analysis.figures import Change, figure_changes
from bench.analysis.stats import above_roof, busy_side, path_change, seed_for
from bench.analysis.stats import judge as judge_pair
from bench.console.format import format_duration
from bench.errors import BadInput
from bench.results.records import Record
from bench.run.ab.command import (
    DISTRIBUTED,
    ENDED,
    INTERLEAVED,
    INTERPRETER,
    ABMeasurement,
    ABOptions,
    PairMeasurement,
    SideRun,
    measure_ab,
)
from bench.run.ab.side import planned_looks

DEFAULT_THRESHOLD_PCT = 5.0  # with the interval past it, a 10% slowdown is caught at this machine's noise
DEFAULT_ALPHA = 0.05
SCHEMA = "bench-ab/1"


@dataclass
class ABPair:
    case_id: str
    impl: str
    label: str
    mode: str
    base_status: str
    new_status: str
    test: st.PairedTest | None = None  # every trial's rounds pooled
    p_sequential: float | None = None  # over the looks taken (bench.analysis.ab_sequential.sequential_p)
    q_value: float | None = None
    verdict: str | None = None  # the time verdict; None where time was not interleaved
    time_note: str | None = None  # why there is no time verdict
    mde: float | None = None  # a fraction (0.12 = 12%)
    changes: list[Change] = field(default_factory=list)
    reason: str | None = None  # NEW's reason (or BASE's) when a side did not run ok
    round_medians: list[tuple[float, float]] = field(default_factory=list)  # (BASE, NEW) block times per round
    orders: list[str] = field(default_factory=list)  # per round: "BN" (BASE first) or "NB"
    trials: list[st.PairedTest] = field(default_factory=list)  # each trial alone (the first, then one per look)
    trial_rounds: list[int] = field(default_factory=list)  # rounds in each trial
    not_repeated: bool = False  # the rounds read SLOWER or FASTER, but not two trials on their own
    busy: str | None = None  # a side timed on a busy machine: a change is NOISY, not SLOWER or FASTER
    path: str | None = None  # the sides ran different code (a fallback, another path): PATH, never a change
    above_roof: str | None = None  # a side's figure passes a roof: no gain is claimed from it

    @property
    def regression(self) -> bool:
        return self.verdict == st.SLOWER or any(c.kind == "regression" for c in self.changes)

    @property
    def improvement(self) -> bool:
        return not self.regression and (self.verdict == st.FASTER
                                        or any(c.kind == "improvement" for c in self.changes))


@dataclass
class ABResult:
    measurement: ABMeasurement
    threshold_pct: float
    alpha: float
    pairs: list[ABPair]
    only_base: list[tuple[str, str, str]]  # (case_id, impl, status)
    only_new: list[tuple[str, str, str]]
    notes: list[str]
    impls: list[ImplVerdict] = field(default_factory=list)  # a verdict per implementation across its cases

    @property
    def base(self) -> SideRun:
        return self.measurement.base

    @property
    def new(self) -> SideRun:
        return self.measurement.new

    def regressions(self) -> list[ABPair]:
        return [p for p in self.pairs if p.regression]

    def improvements(self) -> list[ABPair]:
        return [p for p in self.pairs if p.improvement]

    def verdict_counts(self) -> dict[str, int]:
        return {v: sum(p.verdict == v for p in self.pairs) for v in st.VERDICTS}

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions() else 0

    def mdes(self) -> list[float]:
        return [p.mde for p in self.pairs if p.mde is not None and math.isfinite(p.mde)]

    def to_json(self) -> dict[str, Any]:
        """The machine-readable result (`bench ab --json`); NaN and infinity become null."""
        m = self.measurement
        mdes = self.mdes()
        return {
            "schema": SCHEMA,
            "base": _side_json(m.base), "new": _side_json(m.new),
            "settings": {"rounds": m.rounds, "looks": m.planned_looks(), "budget_s": _num(m.budget_s),
                         "left_open": m.left_open, "block_ms": m.block_s * 1e3, "block_calls": m.block_calls,
                         "threads": m.threads, "cpus": m.cpus, "threshold_pct": self.threshold_pct, "alpha": self.alpha,
                         "confidence": st.CONFIDENCE, "power": st.POWER},
            "pairs": [_pair_json(p) for p in self.pairs],
            "impls": [{"impl": v.impl, "pairs": v.pairs, "ratio": _num(v.ratio), "p_value": _num(v.p_value),
                       "verdict": v.verdict, "slower_pairs": v.slower_pairs, "faster_pairs": v.faster_pairs}
                      for v in self.impls],
            "only_base": [{"case_id": c, "impl": i, "status": s} for c, i, s in self.only_base],
            "only_new": [{"case_id": c, "impl": i, "status": s} for c, i, s in self.only_new],
            "notes": self.notes,
            "summary": {**self.verdict_counts(), "pairs": len(self.pairs),
                        "time_compared": sum(p.verdict is not None for p in self.pairs),
                        "changes": sum(len(p.changes) for p in self.pairs),
                        "regressions": len(self.regressions()), "improvements": len(self.improvements()),
                        "mde_median_pct": _num(statistics.median(mdes) * 100) if mdes else None,
                        "mde_max_pct": _num(max(mdes) * 100) if mdes else None},
            "wall_s": m.wall_s,
            "exit_code": self.exit_code,
        }


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def _side_json(side: SideRun) -> dict[str, Any]:
    co = side.checkout
    return {"spec": co.spec, "commit": co.commit, "path": None if co.worktree else str(co.path),
            "worktree": co.worktree, "run_id": side.run_id, "run_dir": str(side.run_dir), "suite": side.suite_name,
            "fingerprint": side.env.fingerprint, "dirty": side.env.git.dirty}


def _pair_json(p: ABPair) -> dict[str, Any]:
    time = None
    if p.test is not None:
        # per round: BASE's and NEW's block times (ab_stats.block_time: what the verdict is computed from) and
        # the order drawn
        t = p.test
        time = {"rounds": t.rounds, "ratio": _num(t.ratio), "ci_low": _num(t.ci_low), "ci_high": _num(t.ci_high),
                "p_value": _num(t.p_value), "q_value": _num(p.q_value), "sigma_log": _num(t.sigma),
                "se_log": _num(t.se), "mde_pct": _num(p.mde * 100) if p.mde is not None else None,
                "median_base_s": _num(t.median_base), "median_new_s": _num(t.median_new), "note": t.note,
                "p_sequential": _num(p.p_sequential), "looks": len(p.trials),
                "round_values_s": [[_num(b), _num(n)] for b, n in p.round_medians], "orders": p.orders,
                "trials": [{"rounds": n, "ratio": _num(t.ratio)} for t, n in zip(p.trials, p.trial_rounds,
                                                                                  strict=True)],
                "not_repeated": p.not_repeated}
    return {"case_id": p.case_id, "impl": p.impl, "label": p.label, "mode": p.mode, "base_status": p.base_status,
            "new_status": p.new_status, "verdict": p.verdict, "time": time, "time_note": p.time_note,
            "changes": [{"figure": c.figure, "base": c.base, "new": c.new, "kind": c.kind} for c in p.changes],
            "regression": p.regression, "improvement": p.improvement, "reason": p.reason, "busy": p.busy,
            "path": p.path, "above_roof": p.above_roof}


# --- the comparison ------------------------------------------------------------------------------------------

_MODE_NOTES = {
    INTERPRETER: "{n} pairs ran through the Triton interpreter (correctness only on CPU, not kernel speed): their "
                 "deterministic figures are compared, their times are not interleaved and get no verdict",
    DISTRIBUTED: "{n} distributed pairs (world_size > 1) use fresh rank processes per measurement: each side was "
                 "measured once, deterministic figures (bytes included) compared, times not interleaved",
    ENDED: "{n} pairs ended on a side before or during the rounds (skipped or failed): statuses compared, no time "
           "verdict",
}


def _status(record: Record | None) -> str:
    return record.status if record is not None else "missing"


def compare_ab(measurement: ABMeasurement, *, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
               alpha: float = DEFAULT_ALPHA, seed: int = 0) -> ABResult:
    """Verdicts for a measurement; pure given it (the bootstrap is seeded per (case, impl) from `seed`)."""
    check_levels(threshold_pct, alpha)
    threshold = threshold_pct / 100
    looks = measurement.planned_looks()
    timed: dict[int, PairTime] = {}
    pairs: list[ABPair] = []
    for pm in measurement.pairs:
        pair = _pair(pm)
        if pair.trial_rounds:
            timed[len(pairs)] = pt = pair_time(pm.trials(), seed_for(f"{pm.case_id}|{pm.impl}", seed), looks, alpha)
            pair.test, pair.trials, pair.p_sequential = pt.pooled, list(pt.trials), pt.p_sequential
        pairs.append(pair)
    for (i, pt), judged in zip(timed.items(), judge(list(timed.values()), threshold, alpha), strict=True):
        pair, pm = pairs[i], measurement.pairs[i]
        pair.q_value, pair.verdict, pair.not_repeated = judged.q_value, judged.verdict, judged.not_repeated
        pair.mde = st.mde(pt.pooled, threshold, alpha)
        base_records = [pm.base, *(b for b, _ in pm.more_records)]
        new_records = [pm.new, *(n for _, n in pm.more_records)]
        pair.busy = busy_side([("BASE", base_records), ("NEW", new_records)])
        pair.path = path_change(base_records, new_records)
        pair.above_roof = above_roof([("BASE", base_records), ("NEW", new_records)])
        pair.verdict = judge_pair(pair.verdict, pair.busy, pair.path, pair.above_roof)
    only_base = [(p.case_id, p.impl, _status(p.base)) for p in measurement.only_base]
    only_new = [(p.case_id, p.impl, _status(p.new)) for p in measurement.only_new]
    notes = _notes(measurement, pairs, threshold, alpha, sum(pt.pooled.note is None for pt in timed.values()))
    impls = [v for name in dict.fromkeys(p.impl for p in pairs)
             if (v := impl_verdict(name, [(p.test, p.p_sequential, p.verdict, p.busy is not None) for p in pairs
                                          if p.impl == name and p.test is not None and p.p_sequential is not None],
                                   threshold, alpha)) is not None]
    return ABResult(measurement, threshold_pct, alpha, pairs, only_base, only_new, notes, impls)


def check_levels(threshold_pct: float, alpha: float) -> None:
    if not threshold_pct >= 0:
        raise BadInput(f"got {threshold_pct}; a percentage >= 0", field="--threshold")
    if not 0 < alpha < 1:
        raise BadInput(f"got {alpha}; a level strictly between 0 and 1", field="--alpha")


def _pair(pm: PairMeasurement) -> ABPair:
    """The pair's statuses, figure changes and rounds; its time verdict is compare_ab's."""
    pair = ABPair(pm.case_id, pm.impl, pm.label, pm.mode, _status(pm.base), _status(pm.new))
    if pm.base is not None and pm.new is not None:
        pair.changes = figure_changes([pm.base], [pm.new])
    for record in (pm.new, pm.base):
        if record is not None and record.status != "ok" and record.reason and pair.reason is None:
            pair.reason = record.reason
    if _timed(pm):
        pair.trial_rounds = [len(trial) for trial in pm.trials()]
        pair.round_medians = [m for trial in pm.trials() for m in _medians(trial)]
        pair.orders = [o for orders in (pm.orders, *pm.more_orders) for o in orders]
    else:
        pair.time_note = pm.note or ("a side did not run ok" if pm.mode == INTERLEAVED else pm.mode)
    return pair


def _timed(pm: PairMeasurement) -> bool:
    """Does this pair get a time verdict: interleaved rounds, both sides ok."""
    return pm.mode == INTERLEAVED and _status(pm.base) == "ok" and _status(pm.new) == "ok" and bool(pm.rounds)


def _medians(rounds: list[tuple[list[float], list[float]]]) -> list[tuple[float, float]]:
    return [(st.block_time(b), st.block_time(n)) for b, n in rounds if b and n]


def _notes(m: ABMeasurement, pairs: list[ABPair], threshold: float, alpha: float, n_tested: int) -> list[str]:
    """One note per kind, never one per pair."""
    notes: list[str] = []
    for mode, text in _MODE_NOTES.items():
        n = sum(p.mode == mode for p in pairs)
        if n:
            notes.append(text.format(n=n))
    transient = [p for p in pairs if p.not_repeated]
    if transient:
        notes.append(f"{len(transient)} pair(s) read SLOWER or FASTER over their rounds but not in two trials on "
                     "their own (each trial on fresh workers): possibly a transient state of one side's process, "
                     "not called SLOWER or FASTER")
    looked = [p for p in pairs if len(p.trials) > 1]
    if looked:
        notes.append(f"{len(looked)} pair(s) whose verdict was open after {m.rounds} rounds got more trials on fresh "
                     f"workers (looks at {', '.join(map(str, m.planned_looks()))} rounds; O'Brien-Fleming alpha "
                     "spending holds the error rate over the looks)")
    if m.left_open:
        notes.append(f"the time budget ({format_duration(m.budget_s)}) ran out with {m.left_open} pair(s) still open: "
                     "their verdicts are from the rounds they had (--budget-s, --max-rounds)")
    notes += _trust_notes(pairs)
    busy = [p for p in pairs if p.busy is not None]
    if busy:
        notes.append(f"{len(busy)} pair(s) had a side timed on a busy machine (e.g. {busy[0].busy}): a change "
                     "there is NOISY, never SLOWER or FASTER")
    noisy = [p for p in pairs if p.verdict == st.NOISY and p.busy is None]
    if noisy:
        worst = max(p.mde or 0.0 for p in noisy)
        notes.append(f"{len(noisy)} pairs were too noisy for the {threshold:.0%} threshold (MDE up to "
                     f"{_pct(worst)}): more --rounds, longer blocks (--block-ms) or a quieter machine")
    looks = m.planned_looks()
    if n_tested and smallest_sequential_p(looks, alpha) * n_tested > alpha:
        need = looks[-1]
        while smallest_sequential_p(planned_looks(m.rounds, need), alpha) * n_tested > alpha:
            need += 1
        notes.append(f"with at most {looks[-1]} rounds and {n_tested} pairs, a change in one pair alone cannot reach "
                     f"q < {alpha:g} (smallest sequential p {smallest_sequential_p(looks, alpha):.2g}); only changes "
                     f"shared by several pairs can be found. Use --max-rounds {need} or more to catch a single pair")
    fingerprints = {m.base.env.fingerprint, m.new.env.fingerprint}
    if len(fingerprints) > 1:
        notes.append("the two checkouts describe this machine differently (environment fingerprints "
                     f"{m.base.env.fingerprint} and {m.new.env.fingerprint}): their code captures "
                     "the environment differently; both ran here at the same time, so times are compared")
    dirty = [name for name, side in (("BASE", m.base), ("NEW", m.new)) if side.env.git.dirty]
    if dirty:
        notes.append(f"{' and '.join(dirty)} {'is a working tree' if len(dirty) == 1 else 'are working trees'} with "
                     "uncommitted changes: the commit id in the run does not describe the code measured")
    for name, side in (("BASE", m.base), ("NEW", m.new)):
        if side.unknown_impls:
            notes.append(f"--impl {', '.join(side.unknown_impls)}: not registered in {name}; measured on the other "
                         "side only")
    if m.only_base or m.only_new:
        notes.append(f"{len(m.only_base)} pairs only in BASE and {len(m.only_new)} only in NEW (different suite "
                     "content or implementations): measured on their side, not compared")
    return notes


def _trust_notes(pairs: list[ABPair]) -> list[str]:
    """The pairs whose sides ran different code, and those with a record above the roof: one note each."""
    notes = []
    paths = [p for p in pairs if p.path is not None]
    if paths:
        notes.append(f"{len(paths)} pair(s) ran different code on the two sides (e.g. {paths[0].impl}: "
                     f"{paths[0].path}): verdict PATH, never a regression or a gain")
    roofs = [p for p in pairs if p.above_roof is not None]
    if roofs:
        notes.append(f"{len(roofs)} pair(s) have a record above the roof (e.g. {roofs[0].above_roof}): no gain is "
                     "claimed from them")
    return notes


def _pct(fraction: float | None) -> str:
    if fraction is None or not math.isfinite(fraction):
        return "-"
    return f"{fraction * 100:.1f}%"


def run_ab(options: ABOptions, console: Console, *, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
           alpha: float = DEFAULT_ALPHA, describe: Callable[[PairMeasurement], str] | None = None) -> ABResult:
    """Measure (bench.run.ab.command) and compare."""
    check_levels(threshold_pct, alpha)  # before minutes of measuring
    threshold = threshold_pct / 100

    def open_keys(measured: list[PairMeasurement], looks: list[int]) -> set[tuple[str, str]]:
        timed = [pm for pm in measured if _timed(pm)]  # the pairs compare_ab will test, corrected together
        flags = open_pairs([pm.trials() for pm in timed], [seed_for(f"{pm.case_id}|{pm.impl}", options.seed)
                                                           for pm in timed], looks, threshold, alpha)
        return {pm.key for pm, flag in zip(timed, flags, strict=True) if flag}

    measurement = measure_ab(options, console, describe, open_keys)
    return compare_ab(measurement, threshold_pct=threshold_pct, alpha=alpha, seed=options.seed)

