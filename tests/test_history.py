"""`bench history`: series over commits and the weighted L1 step detection behind it."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.analysis.history import build_history
from bench.analysis.steps import best_segmentations, fit_levels, interval_costs, normalized_weights, weighted_median
from bench.cli import main
from bench.errors import BadInput
from bench.results.index import load_index
from tests.synthetic import commit_id, noisy, record, write_run


def day(i: int) -> str:
    return f"2026-02-{i + 1:02d}T00:00:00.000000Z"


def store_with_step(root, n_commits=12, step_at=7, factor=1.3, seed=0, fingerprint="f00dcafe12345678",
                    impls=("dense", "sdpa")):
    """`n_commits` runs; from commit `step_at` on, `dense` is `factor` times slower, `sdpa` unchanged."""
    rng = np.random.default_rng(seed)
    for i in range(n_commits):
        recs = [record("local-n128", impl, noisy(rng, 1e-3 * (factor if impl == "dense" and i >= step_at else 1),
                                                 n=15, sigma=0.03)) for impl in impls]
        write_run(root, commit=commit_id(i), started_at=day(i), records=recs, fingerprint=fingerprint)


def test_a_step_is_found_with_its_commit_range(tmp_path):
    store_with_step(tmp_path)
    series = {s.impl: s for s in build_history(load_index(tmp_path).runs)}
    dense, sdpa = series["dense"], series["sdpa"]
    assert [p.commit for p in dense.points] == [commit_id(i) for i in range(12)]
    assert len(dense.points[0].samples) == 15 and dense.points[0].run_ids == (dense.points[0].run_id,)
    (step,) = dense.steps
    assert (step.index, step.commit_before, step.commit_after) == (7, commit_id(6), commit_id(7))
    assert step.ratio == pytest.approx(1.3, rel=0.03) and step.direction == "slower"
    assert step.commit_range == f"{commit_id(6)[:10]}..{commit_id(7)[:10]}"
    assert sdpa.steps == () and len(sdpa.levels) == 1


def test_the_calibration_directory_is_not_a_run_and_anything_else_is_refused(tmp_path):
    store_with_step(tmp_path, n_commits=2)
    (tmp_path / "calibration").mkdir()  # bench calibrate's rates live in the store
    (tmp_path / "calibration" / "f00dcafe12345678.json").write_text("{}")
    assert len(load_index(tmp_path).runs) == 2
    (tmp_path / "notes").mkdir()
    with pytest.raises(BadInput, match=r"every directory under .* must be a run"):
        load_index(tmp_path)


def test_noise_alone_gives_no_steps(tmp_path):
    store_with_step(tmp_path, n_commits=30, factor=1.0, seed=1)
    assert all(s.steps == () for s in build_history(load_index(tmp_path).runs))


def test_environments_and_suites_are_kept_apart_and_models_left_out(tmp_path):
    store_with_step(tmp_path / "r", n_commits=4, step_at=99, impls=("dense",))
    # same commits measured on another machine, 2x slower throughout: its own series, no step in either
    rng = np.random.default_rng(2)
    for i in range(4):
        write_run(tmp_path / "r", commit=commit_id(i), started_at=day(i).replace("T00", "T12"),
                  fingerprint="0000000000000002", records=[record("local-n128", "dense", noisy(rng, 2e-3))])
    write_run(tmp_path / "r", commit=commit_id(9), started_at=day(9), source="modelled",
              records=[record("local-n128", "dense", noisy(rng, 9e-3), source="modelled")])
    write_run(tmp_path / "r", commit=commit_id(9), started_at=day(9), suite="other",
              records=[record("local-n128", "dense", noisy(rng, 9e-3))])
    runs = load_index(tmp_path / "r").runs
    series = build_history(runs, suite="smoke")
    assert sorted(s.fingerprint for s in series) == ["0000000000000002", "f00dcafe12345678"]
    assert all(len(s.points) == 4 and s.steps == () for s in series)
    assert {s.suite for s in build_history(runs)} == {"smoke", "other"}


def test_runs_of_one_commit_are_pooled_into_one_point(tmp_path):
    rng = np.random.default_rng(3)
    for i, commit in enumerate([commit_id(0), commit_id(0), commit_id(1)]):
        write_run(tmp_path, commit=commit, started_at=day(i), records=[record("c", "dense", noisy(rng, 1e-3, n=8))])
    (series,) = build_history(load_index(tmp_path).runs)
    assert [len(p.samples) for p in series.points] == [16, 8]
    assert len(series.points[0].run_ids) == 2 and series.points[0].started_at == day(0)


def test_history_command(tmp_path, capsys):
    store_with_step(tmp_path)
    assert main(["history", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{commit_id(6)[:10]}..{commit_id(7)[:10]}" in out and "x1.3" in out and "slower" in out
    assert out.startswith("1 steps (1 slower) where each level holds at least 2 runs; 0 advisory steps")
    assert "2 series over 12 commits" in out
    assert main(["history", "smoke", "--results", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    dense = next(s for s in doc if s["impl"] == "dense")
    assert dense["steps"][0]["commit_before"] == commit_id(6) and dense["steps"][0]["direction"] == "slower"
    assert len(dense["points"]) == 12 and set(dense["points"][0]) >= {"commit", "run_ids", "median", "samples"}
    assert main(["history", "nosuch", "--results", str(tmp_path)]) == 2
    assert "SUITE: got 'nosuch'; suites in" in capsys.readouterr().err


def brute_force(y: np.ndarray, w: np.ndarray, k: int) -> float:
    """Best weighted L1 cost of y in exactly k pieces, by trying every set of cut points."""
    n, best = len(y), np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        cost = 0.0
        for a, b in itertools.pairwise(bounds):
            mu = weighted_median(y[a:b], w[a:b])
            cost += float(np.sum(w[a:b] * np.abs(y[a:b] - mu)))
        best = min(best, cost)
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=7), st.lists(st.integers(1, 4), min_size=7, max_size=7))
def test_dynamic_programming_is_exact(values, weights):
    y = np.array(values, dtype=float)
    w = normalized_weights([float(x) for x in weights[:len(y)]], len(y))
    cost, _ = interval_costs(y, w)
    for k, (total, bounds) in enumerate(best_segmentations(cost, len(y)), start=1):
        assert len(bounds) == k + 1 and bounds[0] == 0 and bounds[-1] == len(y)
        assert total == pytest.approx(brute_force(y, w, k), abs=1e-9)


def test_levels_of_clean_series():
    assert fit_levels([]) == []
    (only,) = fit_levels([2.0] * 10)
    assert (only.start, only.stop, only.value, only.spread) == (0, 10, 2.0, 0.0)
    levels = fit_levels([1.0] * 6 + [2.0] * 6)
    assert [(s.start, s.stop, s.value) for s in levels] == [(0, 6, 1.0), (6, 12, 2.0)]
    # a point with a huge weight pulls its level; missing weights take the median weight
    assert weighted_median(np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0, 5.0])) == 3.0
    assert list(normalized_weights([None, 2.0, float("nan"), 4.0], 4)) == [1.0, 2 / 3, 1.0, 4 / 3]
