"""`bench export RUN_DIR --format github-action-benchmark|bencher`: a run for CI benchmark trackers.

- github-action-benchmark (benchmark-action/github-action-benchmark), tool `customSmallerIsBetter`: a JSON list
  of `{"name", "unit", "value", "range", "extra"}`, one per measured `ok` (case, impl); `name` is
  `impl[case_id]` (as the pytest-benchmark export names it), `value` the median in microseconds, `range` half
  the interquartile range (`± x`), `extra` the quartiles, the sample count and the commit.
- Bencher (bencher.dev) Metric Format, BMF: `{"impl[case_id]": {"latency": {"value", "lower_value",
  "upper_value"}}}` in nanoseconds (Bencher's built-in `latency` measure): the median, the first and the third
  quartile.

As with the pytest-benchmark export, records that are not measured times (skipped, failed, incorrect,
modelled) are left out and counted on stderr: a tracker plots times, and a status change is `bench compare`'s
or `bench ab`'s to report.
"""

from __future__ import annotations

from typing import Any

from bench.results.records import Record
from bench.results.store import Run

FORMATS = ("github-action-benchmark", "bencher")


def benchmark_name(record: Record) -> str:
    return f"{record.impl}[{record.case_id}]"


def _measured(run: Run) -> list[Record]:
    return [r for r in run.records if r.status == "ok" and r.time_s is not None and r.time_s.n > 0
            and r.source == "measured" and run.info.source == "measured"]


def to_github_action_benchmark(run: Run) -> tuple[list[dict[str, Any]], int]:
    """(the customSmallerIsBetter list, number of records left out)."""
    commit = run.info.env.git.commit or "unversioned"
    out = []
    for r in _measured(run):
        t = r.time_s
        assert t is not None
        out.append({"name": benchmark_name(r), "unit": "us", "value": round(t.median * 1e6, 6),
                    "range": f"± {round((t.q3 - t.q1) / 2 * 1e6, 6)}",
                    "extra": f"q1 {t.q1 * 1e6:.6g} us, q3 {t.q3 * 1e6:.6g} us, {t.n} samples; suite "
                             f"{run.info.suite.name}, run {run.info.run_id}, commit {commit[:12]}"})
    return out, len(run.records) - len(out)


def to_bencher(run: Run) -> tuple[dict[str, Any], int]:
    """(the BMF document, number of records left out)."""
    out: dict[str, Any] = {}
    for r in _measured(run):
        t = r.time_s
        assert t is not None
        out[benchmark_name(r)] = {"latency": {"value": t.median * 1e9, "lower_value": t.q1 * 1e9,
                                              "upper_value": t.q3 * 1e9}}
    return out, len(run.records) - len(out)
