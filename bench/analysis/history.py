"""`bench history [SUITE]`: every (case, impl) as a series over commits, with the steps where its time changed.

Data API (for the dashboard and other tools; plain frozen dataclasses, `dataclasses.asdict` gives JSON):

    build_history(runs, suite=None, threshold=0.05) -> list[Series]

- A `Series` is one (suite, environment fingerprint, case_id, impl): timings from different machines or library
  versions never share a series.
- Its `points` are one per commit, in the order the commits were first measured (`started_at` of their
  earliest run): the pooled samples of every measured `ok` record of that commit, their median and the
  median's 95% interval. Runs of a dirty working tree are kept and flagged `dirty`.
- Its `levels` are the piecewise-constant fit (bench.analysis.steps: weighted L1, as asv) and its `steps` the jumps
  between levels larger than their noise and than `threshold`: the step happened after `commit_before` and at
  or before `commit_after` (the git range `commit_before..commit_after`).

Modelled records and runs are not measurements and never enter a series. Only whole-suite runs make points: the
sides of a `bench ab` and runs filtered by `--impl` are set aside, and the command says how many. `bench history`
reads the runs committed under the results directory unless `--uncommitted` adds the local ones; each step names
the runs on both sides of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.analysis.steps import Segment, fit_levels, significant_steps
from bench.console.format import format_seconds
from bench.errors import BadInput
from bench.measure.timing import median_ci95
from bench.results.index import (
    ORDINARY,
    StoreIndex,
    committed_run_dirs,
    load_index,
    run_commit,
    run_fingerprint,
    run_kind,
)
from bench.results.store import Run


@dataclass(frozen=True)
class Point:
    """One commit of a series. Times in seconds per call."""

    commit: str
    run_ids: tuple[str, ...]  # the runs pooled into this point, oldest first
    started_at: str  # of the earliest of them
    median: float
    ci95: tuple[float, float] | None  # distribution-free interval of the median; None under 6 samples
    samples: tuple[float, ...]
    dirty: bool = False  # some run was made from uncommitted changes

    @property
    def run_id(self) -> str:
        return self.run_ids[0]


MIN_RUNS_PER_LEVEL = 2


@dataclass(frozen=True)
class Step:
    """A change of level between points[index - 1] and points[index]. ratio > 1: slower."""

    index: int
    commit_before: str
    commit_after: str
    median_before: float  # fitted level before the step (weighted median of its segment)
    median_after: float
    ratio: float
    runs_before: tuple[str, ...] = ()  # the runs of the point before the step
    runs_after: tuple[str, ...] = ()  # the runs of the point after it
    # runs measured between the previous step (or the first commit) and this one, and between this one and the next
    level_runs: tuple[int, int] = (0, 0)

    @property
    def firm(self) -> bool:
        """Both levels measured by at least two runs: as for `bench compare`, a step between two single runs is
        as likely the drift between two runs as a change of the code, and is reported apart (advisory)."""
        return min(self.level_runs) >= MIN_RUNS_PER_LEVEL

    @property
    def direction(self) -> str:
        return "slower" if self.ratio > 1 else "faster"

    @property
    def commit_range(self) -> str:
        return f"{self.commit_before[:10]}..{self.commit_after[:10]}"


@dataclass(frozen=True)
class Series:
    suite: str
    fingerprint: str
    case_id: str
    impl: str
    points: tuple[Point, ...]
    levels: tuple[Segment, ...]
    steps: tuple[Step, ...]

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.suite, self.fingerprint, self.case_id, self.impl)


def _point_weight(point: Point) -> float | None:
    """asv's weighting: the inverse width of the point's interval (None: the median weight is used)."""
    if point.ci95 is None or point.ci95[1] <= point.ci95[0]:
        return None
    return 1.0 / (point.ci95[1] - point.ci95[0])


def _make_point(commit: str, entries: list[tuple[Run, list[float]]]) -> Point:
    samples = [s for _, run_samples in entries for s in run_samples]
    ci = median_ci95(samples)
    return Point(commit=commit, run_ids=tuple(r.info.run_id for r, _ in entries),
                 started_at=entries[0][0].info.started_at, median=float(np.median(samples)),
                 ci95=(float(ci[0]), float(ci[1])) if ci else None, samples=tuple(samples),
                 dirty=any(bool(r.info.env.git.dirty) for r, _ in entries))


def series_from_points(suite: str, fingerprint: str, case_id: str, impl: str, points: list[Point],
                       threshold: float = 0.05) -> Series:
    """Fit levels to the points' medians and keep the steps larger than noise and `threshold` (a fraction)."""
    levels = fit_levels([p.median for p in points], [_point_weight(p) for p in points])
    significant = significant_steps(levels, threshold)
    bounds = [0, *(levels[i].start for i in significant), len(points)]  # between steps: one level, as far as told
    steps = []
    for n, i in enumerate(significant):
        before, after = levels[i - 1], levels[i]
        index = after.start
        steps.append(Step(index=index, commit_before=points[index - 1].commit, commit_after=points[index].commit,
                          median_before=before.value, median_after=after.value,
                          ratio=after.value / before.value if before.value > 0 else math.inf,
                          runs_before=points[index - 1].run_ids, runs_after=points[index].run_ids,
                          level_runs=(_runs_in(points[bounds[n]:index]), _runs_in(points[index:bounds[n + 2]]))))
    return Series(suite, fingerprint, case_id, impl, tuple(points), tuple(levels), tuple(steps))


def _runs_in(points: list[Point]) -> int:
    return sum(len(p.run_ids) for p in points)


def build_history(runs: Iterable[Run], suite: str | None = None, threshold: float = 0.05) -> list[Series]:
    """Series per (suite, fingerprint, case_id, impl) over commits, with their detected steps."""
    ordered = sorted((r for r in runs if r.info.source == "measured" and (suite is None or r.info.suite.name == suite)),
                     key=lambda r: (r.info.started_at, r.info.run_id))
    # key -> commit -> [(run, samples)], insertion-ordered by first measurement
    grouped: dict[tuple[str, str, str, str], dict[str, list[tuple[Run, list[float]]]]] = {}
    for run in ordered:
        commit = run_commit(run) or f"(no git: {run.info.run_id})"
        for record in run.records:  # one per pair (bench.results.store.first_per_pair)
            if record.source != "measured" or record.status != "ok" or not record.time_s:
                continue
            key = (run.info.suite.name, run_fingerprint(run), record.case_id, record.impl)
            grouped.setdefault(key, {}).setdefault(commit, []).append((run, list(record.time_s.samples)))
    return [series_from_points(*key, [_make_point(c, e) for c, e in by_commit.items()], threshold=threshold)
            for key, by_commit in grouped.items()]


def history_json(series: list[Series]) -> list[dict[str, Any]]:
    out = []
    for s in series:
        item = asdict(s)
        item["steps"] = [{**asdict(st), "direction": st.direction, "commit_range": st.commit_range}
                         for st in s.steps]
        out.append(item)
    return out


def history_table(series: list[Series], show_all: bool) -> Table:
    table = Table(title="history: time per call over commits (steps by weighted L1 fit)")
    for name in ("case", "impl", "commits", "latest", "steps: commit range, ratio, runs before -> after"):
        table.add_column(name, overflow="fold", no_wrap=name in ("commits", "latest"))
    for s in series:
        shown = [st for st in s.steps if show_all or st.firm]
        if not shown and not show_all:
            continue
        steps = "; ".join(
            f"[{'red' if st.direction == 'slower' else 'green'}]{st.commit_range} x{st.ratio:.2f} {st.direction}[/] "
            f"({format_seconds(st.median_before)} -> {format_seconds(st.median_after)}; "
            f"{', '.join(st.runs_before)} -> {', '.join(st.runs_after)})"
            f"{'' if st.firm else ' [dim](advisory: a level of one run)[/]'}" for st in shown) or "-"
        suite = f"{escape(s.suite)}: " if len({x.suite for x in series}) > 1 else ""
        table.add_row(f"{suite}{escape(s.case_id)}", escape(s.impl), str(len(s.points)),
                      format_seconds(s.points[-1].median), steps)
    return table


def step_ranges(steps: list[Step], show_all: bool = False) -> list[str]:
    """One line per commit range with a firm step (with `show_all`, with any step): how many series stepped
    there, which way, the median ratio."""
    by_range: dict[str, list[Step]] = {}
    for st in steps:
        by_range.setdefault(st.commit_range, []).append(st)
    lines = []
    for commit_range, group in by_range.items():
        ratios = sorted(st.ratio for st in group)
        slower = sum(st.direction == "slower" for st in group)
        firm = sum(st.firm for st in group)
        if not firm and not show_all:
            continue
        lines.append(f"  {commit_range}: {len(group)} series stepped ({slower} slower, {len(group) - slower} faster; "
                     f"median x{ratios[len(ratios) // 2]:.2f}), {firm} firm")
    return lines


def history_runs(index: StoreIndex, include_uncommitted: bool) -> tuple[list[Run], list[str]]:
    """The runs of the store a history is built from, and what was left out (one line per reason)."""
    results = index.root
    runs, left_out = index.runs, []
    committed = None if include_uncommitted else committed_run_dirs(results)
    if committed is not None:
        local = [r for r in runs if r.path.name not in committed]
        runs = [r for r in runs if r.path.name in committed]
        if local:
            left_out.append(f"{len(local)} uncommitted runs in {results} (--uncommitted adds them)")
    for kind, what in (("ab", "sides of a `bench ab`"), ("filtered", "runs filtered by --impl")):
        made = [r for r in runs if run_kind(r) == kind]
        if made:
            left_out.append(f"{len(made)} {what} (measured apart from the whole-suite runs: not pooled)")
    return [r for r in runs if run_kind(r) == ORDINARY], left_out


def history_command(results: Path, suite: str | None, *, threshold_pct: float, as_json: bool, show_all: bool,
                    console: Console, include_uncommitted: bool = False) -> int:
    if not threshold_pct >= 0:
        raise BadInput(f"got {threshold_pct}; a percentage >= 0", field="--threshold")
    index = load_index(results)
    if suite is not None and suite not in index.suites():
        raise BadInput(f"got {suite!r}; suites in {results}: {', '.join(index.suites()) or 'none'}", field="SUITE")
    runs, left_out = history_runs(index, include_uncommitted)
    series = build_history(runs, suite, threshold=threshold_pct / 100)
    if as_json:
        print(json.dumps(history_json(series), indent=2))
        return 0
    steps = [st for s in series for st in s.steps]
    firm = [st for st in steps if st.firm]
    fingerprints = {s.fingerprint for s in series}
    commits = {p.commit for s in series for p in s.points}
    console.print(f"{len(firm)} steps ({sum(st.direction == 'slower' for st in firm)} slower) where each level holds "
                  f"at least {MIN_RUNS_PER_LEVEL} runs; {len(steps) - len(firm)} advisory steps between levels of one "
                  f"run; {len(series)} series over {len(commits)} commits of {results}"
                  f"{f' ({len(fingerprints)} environments, kept apart)' if len(fingerprints) > 1 else ''}")
    ranges = step_ranges(steps, show_all)
    for line in ranges:
        console.print(line, highlight=False)
    advisory_ranges = len({st.commit_range for st in steps}) - len(ranges)
    if advisory_ranges:
        console.print(f"  {advisory_ranges} commit ranges with advisory steps only (--all lists them)")
    for line in left_out:
        console.print(f"left out: {escape(line)}", highlight=False)
    for warning in index.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    if firm or show_all:
        console.print(history_table(series, show_all))
    if not show_all and series:
        console.print("[dim]--all lists every series and the advisory steps[/]")
    return 0
