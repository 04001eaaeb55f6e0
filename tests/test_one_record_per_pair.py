"""A run that holds a pair twice (a resume that raced) counts its first record, in every reader: the store, compare,
history and the dashboards (which kept the last one before the rule lived in one place)."""

from __future__ import annotations

import numpy as np

from bench.analysis.compare import make_side
from bench.analysis.history import build_history
from bench.dashboard.data import current_rows, rows_from_runs
from bench.results.store import load_run
from tests.synthetic import commit_id, record, write_run


def test_the_first_record_of_a_pair_counts_everywhere(tmp_path):
    first, second = np.full(6, 1e-3), np.full(6, 5e-3)
    run_dir = write_run(tmp_path, commit=commit_id(1), records=[record("c", "dense", first),
                                                               record("c", "dense", second)])
    run = load_run(run_dir)
    assert [r.time_s.median for r in run.records if r.time_s] == [1e-3]
    assert any("set aside" in w for w in run.warnings)
    side = make_side("BASE", [run], "BASE")
    assert [r.time_s.median for r in side.records[("c", "dense")] if r.time_s] == [1e-3]
    (series,) = build_history([run])
    assert series.points[0].median == 1e-3
    (row,) = current_rows(rows_from_runs([run]))
    assert row.median_s == 1e-3
