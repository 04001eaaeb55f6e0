"""`bench compare BASE NEW`: which (case, impl) pairs changed between two sets of runs, decided with statistics.

Each side is one run or several runs of one commit (their records are pooled per (case, impl)). A side pools only
runs made alike: the whole-suite runs of its commit when it has any; the side of a `bench ab` or a run filtered by
`--impl` is never pooled with them, and every run set aside is named in a note. For every pair on both sides:

- time: ratio of medians, bootstrap interval, Mann-Whitney p, Benjamini-Hochberg q and a verdict
  (bench.analysis.stats);
- deterministic figures (status, FLOPs, density, correctness numbers, communication bytes, CUDA peak memory) with a
  tolerance where the figure is a float (FIGURE_TOLERANCE); every difference past it is listed.

What exits 1 (a regression): a pair that became failed or incorrect; more communication bytes; the numerics
verdict turning worse than the same-dtype reference; and a SLOWER time verdict only where the time can gate: both
environments alike, and either each side pools at least two whole-suite runs, or the two sides are the two runs of
one `bench ab`. Otherwise time verdicts are advisory (shown, never failing): drift between two whole runs on a
shared machine is larger than the regressions to catch. A pair whose code path differs between the sides is a PATH
change, never a regression or a gain. Modelled records are set aside. Bad input (nothing in common between the
sides, an option that does not apply) is exit 2.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.analysis import stats as cs
from bench.analysis.figures import Change, disagreements, figure_changes, pooled_status
from bench.errors import BadInput
from bench.results.index import ORDINARY, describe_kind, resolve, run_commit, run_fingerprint, run_kind
from bench.results.records import Record
from bench.results.store import Run

DEFAULT_THRESHOLD_PCT = 10.0
DEFAULT_ALPHA = 0.05
Key = tuple[str, str]  # (case_id, impl)


@dataclass
class Side:
    """One side of a comparison: its runs and their measured records pooled per (case, impl)."""

    label: str  # what the user gave: a run directory or a commit prefix
    runs: list[Run]
    records: dict[Key, list[Record]]  # measured records, one per run that has the pair
    modelled: list[Record]
    set_aside: list[Run] = field(default_factory=list)  # runs of the commit not pooled (another kind of run)

    @property
    def fingerprints(self) -> list[str]:
        return list(dict.fromkeys(run_fingerprint(r) for r in self.runs))

    @property
    def commits(self) -> list[str]:
        return list(dict.fromkeys(run_commit(r) or "unknown" for r in self.runs))

    @property
    def kind(self) -> str:
        """`run` (whole-suite runs), `ab` (a side of a `bench ab`) or `filtered` (runs restricted by --impl)."""
        return run_kind(self.runs[0])

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "runs": [r.info.run_id for r in self.runs], "commits": self.commits,
                "suites": list(dict.fromkeys(r.info.suite.name for r in self.runs)), "kind": self.kind,
                "set_aside": [r.info.run_id for r in self.set_aside],
                "fingerprint": self.fingerprints[0] if self.fingerprints else None,
                "measured_pairs": len(self.records), "modelled_records": len(self.modelled)}


def pooled_runs(runs: list[Run]) -> tuple[list[Run], list[Run]]:
    """(pooled, set aside): a commit's whole-suite runs when it has any; else the runs of its latest command (one
    `bench ab`, or one `--impl` filter), never samples of differently-made runs in one pool."""
    ordinary = [r for r in runs if run_kind(r) == ORDINARY]
    if ordinary or len(runs) <= 1:
        chosen = ordinary or runs
    else:
        latest = runs[-1].info.command
        chosen = [r for r in runs if r.info.command == latest]
    return chosen, [r for r in runs if r not in chosen]


def make_side(label: str, runs: list[Run], what: str) -> Side:
    runs, set_aside = pooled_runs(runs)
    records: dict[Key, list[Record]] = {}
    modelled: list[Record] = []
    for run in runs:  # one record per pair and run (bench.results.store.first_per_pair)
        for record in run.records:
            if run.info.source == "modelled" or record.source == "modelled":
                modelled.append(record)
            else:
                records.setdefault((record.case_id, record.impl), []).append(record)
    if not records and modelled:
        raise BadInput(f"{what} {label!r} holds only modelled records (from `bench model`), not measurements; "
                       "compare compares measurements. Compare two measured runs instead")
    if not records:
        raise BadInput(f"{what} {label!r} holds no records ({', '.join(r.info.run_id for r in runs)}: nothing was "
                       "measured, or the run was interrupted before its first pair); compare needs measured runs")
    fingerprints = {run_fingerprint(r) for r in runs}
    if len(fingerprints) > 1:
        raise BadInput(f"{what} {label!r}: its runs come from different environments (fingerprints "
                       f"{', '.join(sorted(fingerprints))}); pooled samples must come from one machine. "
                       "Pass a single run directory")
    return Side(label, runs, records, modelled, set_aside)


def one_ab(base: Side, new: Side) -> bool:
    """Whether the two sides are the two runs of one `bench ab` (its interleaved rounds: time verdicts that gate)."""
    return (base.kind == new.kind == "ab" and len(base.runs) == len(new.runs) == 1
            and base.runs[0].info.command == new.runs[0].info.command
            and _minutes_apart(base.runs[0], new.runs[0]) < 10)


def _minutes_apart(a: Run, b: Run) -> float:
    from datetime import datetime

    try:
        times = [datetime.fromisoformat(r.info.started_at.replace("Z", "+00:00")) for r in (a, b)]
    except ValueError:
        return math.inf
    return abs((times[0] - times[1]).total_seconds()) / 60


def time_gates(base: Side, new: Side) -> str | None:
    """None when a SLOWER verdict may fail the comparison; else why it is advisory."""
    if one_ab(base, new):
        return None
    if base.kind == new.kind == ORDINARY and len(base.runs) >= 2 and len(new.runs) >= 2:
        return None
    counts = f"BASE pools {_runs_of(base)}, NEW {_runs_of(new)}"
    return (f"time verdicts are advisory ({counts}): a time verdict fails the comparison only where each side "
            "pools at least two whole-suite runs, or the sides are the two runs of one `bench ab`. Drift between "
            "whole runs on a shared machine is larger than the regressions to catch; for verdicts that gate, run "
            "`bench ab BASE NEW SUITE.yaml`")


def _runs_of(side: Side) -> str:
    what = {"ab": "side of a `bench ab`", "filtered": "run filtered by --impl"}.get(side.kind, "whole-suite run")
    return f"{len(side.runs)} {what}{'s' if len(side.runs) != 1 else ''}"


@dataclass
class PairResult:
    case_id: str
    impl: str
    base_status: str
    new_status: str
    time: cs.TimeTest | None = None
    q_value: float | None = None
    verdict: str | None = None  # None when time was not compared (a side not ok, or --deterministic-only)
    time_comparable: bool = True
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    time_advisory: bool = False  # one run per side: the time verdict is shown, never a regression

    @property
    def key(self) -> tuple[str, str]:
        return self.case_id, self.impl

    @property
    def slower_regression(self) -> bool:
        return self.verdict == cs.SLOWER and self.time_comparable and not self.time_advisory

    @property
    def regression(self) -> bool:
        return self.slower_regression or any(c.kind == "regression" for c in self.changes)


@dataclass
class Comparison:
    base: Side
    new: Side
    threshold_pct: float
    alpha: float
    deterministic_only: bool
    time_comparable: bool
    pairs: list[PairResult]
    only_base: list[tuple[str, str, str]]  # (case_id, impl, status)
    only_new: list[tuple[str, str, str]]
    warnings: list[str]
    notes: list[str]
    time_advisory: bool = False  # one run per side: time verdicts cannot fail the comparison

    def regressions(self) -> list[PairResult]:
        return [p for p in self.pairs if p.regression]

    def verdict_counts(self) -> dict[str, int]:
        return {v: sum(p.verdict == v for p in self.pairs) for v in cs.VERDICTS}

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions() else 0

    def to_json(self) -> dict[str, Any]:
        """The machine-readable result (`bench compare --json`); NaN becomes null."""
        return {
            "schema": "bench-compare/1",
            "base": self.base.summary(),
            "new": self.new.summary(),
            "threshold_pct": self.threshold_pct,
            "alpha": self.alpha,
            "confidence": cs.CONFIDENCE,
            "deterministic_only": self.deterministic_only,
            "time_comparable": self.time_comparable,
            "time_advisory": self.time_advisory,
            "warnings": self.warnings,
            "notes": self.notes,
            "pairs": [_pair_json(p) for p in self.pairs],
            "only_base": [{"case_id": c, "impl": i, "status": s} for c, i, s in self.only_base],
            "only_new": [{"case_id": c, "impl": i, "status": s} for c, i, s in self.only_new],
            "modelled_not_compared": [{"side": side, "case_id": r.case_id, "impl": r.impl}
                                      for side, recs in (("base", self.base.modelled), ("new", self.new.modelled))
                                      for r in recs],
            "summary": {**self.verdict_counts(), "pairs": len(self.pairs),
                        "changes": sum(len(p.changes) for p in self.pairs),
                        "regressions": len(self.regressions())},
            "exit_code": self.exit_code,
        }


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def _pair_json(p: PairResult) -> dict[str, Any]:
    time = None
    if p.time is not None:
        t = p.time
        time = {"n_base": t.n_base, "n_new": t.n_new, "runs_base": t.runs_base, "runs_new": t.runs_new,
                "median_base_s": _num(t.median_base),
                "median_new_s": _num(t.median_new), "ratio": _num(t.ratio), "ci_low": _num(t.ci_low),
                "ci_high": _num(t.ci_high), "p_value": _num(t.p_value), "q_value": _num(p.q_value),
                "comparable": p.time_comparable, "advisory": p.time_advisory, "note": t.note}
    return {"case_id": p.case_id, "impl": p.impl, "base_status": p.base_status, "new_status": p.new_status,
            "verdict": p.verdict, "time": time, "regression": p.regression,
            "changes": [{"figure": c.figure, "base": c.base, "new": c.new, "kind": c.kind} for c in p.changes],
            "notes": p.notes}


def samples_per_run(records: list[Record]) -> list[list[float]]:
    return [list(r.time_s.samples) for r in records if r.status == "ok" and r.time_s]


def _environment_warnings(base: Side, new: Side) -> tuple[list[str], bool]:
    warnings: list[str] = []
    b_fp, n_fp = base.fingerprints[0], new.fingerprints[0]
    comparable = b_fp == n_fp
    if not comparable:
        diffs = base.runs[0].info.env.differences(new.runs[0].info.env)
        warnings.append(f"ENVIRONMENTS DIFFER: base fingerprint {b_fp}, new fingerprint {n_fp}"
                        f"{' (' + '; '.join(diffs) + ')' if diffs else ''}. Timings from different machines, "
                        "drivers or library versions are not comparable: time verdicts are shown but marked "
                        "not comparable and cannot fail this comparison; deterministic figures still can.")
    for side_name, side in (("base", base), ("new", new)):
        for run in side.runs:
            if run.info.finished_at is None:
                warnings.append(f"{side_name} run {run.info.run_id} did not finish (interrupted or still "
                                "running); pairs it lacks are listed as missing")
            if run.info.env.git.dirty:
                warnings.append(f"{side_name} run {run.info.run_id} was made from a working tree with "
                                "uncommitted changes: its commit id does not describe the code measured")
        warnings.extend(f"{side_name}: {w}" for run in side.runs for w in run.warnings)
    return warnings, comparable


def compare_sides(base: Side, new: Side, *, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
                  alpha: float = DEFAULT_ALPHA, deterministic_only: bool = False, seed: int = 0) -> Comparison:
    """Compare two sides; pure given the records (the bootstrap is seeded per pair from `seed`)."""
    if not threshold_pct >= 0:
        raise BadInput(f"got {threshold_pct}; a percentage >= 0", field="--threshold")
    if not 0 < alpha < 1:
        raise BadInput(f"got {alpha}; a level strictly between 0 and 1", field="--alpha")
    warnings, comparable = _environment_warnings(base, new)
    notes = []
    b_suites = {r.info.suite.name for r in base.runs}
    n_suites = {r.info.suite.name for r in new.runs}
    if b_suites != n_suites:
        notes.append(f"suites differ (base {', '.join(sorted(b_suites))}, new {', '.join(sorted(n_suites))}): "
                     "only (case, impl) pairs present in both are compared")
    advisory_reason = time_gates(base, new)
    advisory = advisory_reason is not None
    if not deterministic_only and advisory_reason is not None:
        notes.append(advisory_reason)
    for side_name, side in (("BASE", base), ("NEW", new)):
        if side.set_aside:
            notes.append(f"{side_name} {side.label!r} pools {', '.join(describe_kind(r) for r in side.runs)}; set "
                         f"aside, made differently: {', '.join(describe_kind(r) for r in side.set_aside)}")
    if base.modelled or new.modelled:
        notes.append(f"{len(base.modelled) + len(new.modelled)} modelled records (source: modelled) were set "
                     "aside: models are not measurements and are not compared")

    keys = list(dict.fromkeys([*new.records, *base.records]))
    if not any(key in base.records for key in new.records):
        raise BadInput(f"no (case, impl) pair is on both sides: BASE {base.label!r} holds {len(base.records)} pairs "
                       f"of suite {', '.join(sorted(b_suites))}, NEW {new.label!r} {len(new.records)} pairs of suite "
                       f"{', '.join(sorted(n_suites))}. Compare runs of the same suite (and implementations)")
    pairs: list[PairResult] = []
    for case_id, impl in keys:
        b, n = base.records.get((case_id, impl)), new.records.get((case_id, impl))
        if b is None or n is None:
            continue
        pair = PairResult(case_id, impl, pooled_status(b), pooled_status(n), time_comparable=comparable,
                          changes=figure_changes(b, n),
                          notes=disagreements("base", b) + disagreements("new", n), time_advisory=advisory)
        if not deterministic_only and pair.base_status == "ok" and pair.new_status == "ok":
            pair.time = cs.compare_runs(samples_per_run(b), samples_per_run(n), cs.seed_for(f"{case_id}|{impl}", seed))
            if any(r.interpreter for r in (*b, *n)):
                pair.notes.append("timed through the Triton interpreter on CPU: not kernel speed")
        pairs.append(pair)

    _judge_times(pairs, base, new, threshold_pct / 100, alpha)

    only_base = [(c, i, pooled_status(r)) for (c, i), r in base.records.items() if (c, i) not in new.records]
    only_new = [(c, i, pooled_status(r)) for (c, i), r in new.records.items() if (c, i) not in base.records]
    return Comparison(base, new, threshold_pct, alpha, deterministic_only, comparable, pairs, only_base, only_new,
                      warnings, notes, time_advisory=advisory and not deterministic_only)


def _judge_times(pairs: list[PairResult], base: Side, new: Side, threshold: float, alpha: float) -> None:
    """Each timed pair's verdict: the interval and the BH-corrected q-value, then the rules past the statistics
    (bench.analysis.stats.judge: different code paths, a busy side, a record above the roof), each noted."""
    tested = [p for p in pairs if p.time is not None and p.time.note is None]
    for pair, q in zip(tested, cs.benjamini_hochberg([p.time.p_value for p in tested if p.time]), strict=True):
        pair.q_value = q
    for pair in pairs:
        if pair.time is None:
            continue
        verdict = cs.verdict(pair.time, pair.q_value if pair.q_value is not None else 1.0, threshold, alpha)
        b, n = base.records[pair.key], new.records[pair.key]
        busy = cs.busy_side([("BASE", b), ("NEW", n)])
        path, roof = cs.path_change(b, n), cs.above_roof([("BASE", b), ("NEW", n)])
        pair.verdict = cs.judge(verdict, busy, path, roof)
        if pair.verdict == cs.PATH:
            pair.notes.append(f"PATH: {path}")
        elif pair.verdict == cs.NOISY and verdict != cs.NOISY:
            pair.notes.append(f"NOISY: {busy}; the time change is not called")
        if roof is not None:
            pair.notes.append(f"{roof}: no gain is claimed from it")


def compare_specs(base_spec: str, new_spec: str, *, results: Path | None = None, suite: str | None = None,
                  **options: Any) -> Comparison:
    """`bench compare BASE NEW`: resolve both (run directory or commit prefix) and compare. `results` and `suite`
    pick among a commit's runs; given with two run directories they would be ignored, so they are refused."""
    if Path(base_spec).is_dir() and Path(new_spec).is_dir():
        for value, option in ((results, "--results"), (suite, "--suite")):
            if value is not None:
                raise BadInput(f"got {value!r} with two run directories; {option} picks among the runs of a commit "
                               "prefix (BASE or NEW given as a commit id), and a run directory names its run already",
                               field=option)
    results = Path("results") if results is None else results
    base = make_side(base_spec, resolve(base_spec, results, suite=suite, what="BASE"), "BASE")
    new = make_side(new_spec, resolve(new_spec, results, suite=suite, what="NEW"), "NEW")
    return compare_sides(base, new, **options)


def iter_changes(comparison: Comparison) -> Iterator[tuple[PairResult, Change]]:
    for pair in comparison.pairs:
        for change in pair.changes:
            yield pair, change
