"""What `bench compare` does with records it cannot trust as they stand ([R5 1/6]): a pair whose sides ran
different code (a fallback on one side) is a PATH change, never a regression or a gain; a record above the roof
is noted and no gain is claimed from it."""

from __future__ import annotations

import numpy as np

from bench.analysis import stats as cs
from tests.synthetic import noisy, record, write_run
from tests.test_compare import BASE_COMMIT, LATER, NEW_COMMIT, compare_json, pair


def test_a_fallback_on_one_side_is_a_path_change_never_a_regression(tmp_path, capsys):
    """blocked's kernel built for BASE but not for NEW: NEW is 4x slower on the fallback path; the verdict is PATH
    with both paths named, exit 0 (not SLOWER)."""
    rng = np.random.default_rng(7)
    samples = noisy(rng, 1e-3, n=20)
    kernel = record("c", "blocked", samples).model_copy(update={"config": {"path": "kernel"}})
    fallback = record("c", "blocked", samples * 4).model_copy(update={"config": {
        "path": "gather", "fallback": {"path": "gather", "reason": "the CPU kernel could not be built"}}})
    base = write_run(tmp_path, commit=BASE_COMMIT, records=[kernel])
    new = write_run(tmp_path, commit=NEW_COMMIT, records=[fallback], started_at=LATER)
    code, doc, _ = compare_json(capsys, base, new)
    p = pair(doc, "c", "blocked")
    assert code == 0 and p["verdict"] == cs.PATH and not p["regression"]
    assert any("different code paths: BASE kernel, NEW gather, fallback" in note for note in p["notes"]), p["notes"]


def test_no_gain_is_claimed_from_a_record_above_the_roof(tmp_path, capsys):
    from bench.results.records import PeakInfo

    rng = np.random.default_rng(8)
    samples = noisy(rng, 1e-3, n=20)
    slow = record("c", "blocked", samples)
    warm = record("c", "blocked", samples / 3).model_copy(update={"peak": PeakInfo(
        bandwidth=1e10, bandwidth_fraction=1.4, above_roof=True,
        above_roof_reason="1.40x the calibrated read bandwidth: the timing was warm")})
    base = write_run(tmp_path, commit=BASE_COMMIT, records=[slow])
    new = write_run(tmp_path, commit=NEW_COMMIT, records=[warm], started_at=LATER)
    code, doc, _ = compare_json(capsys, base, new)
    p = pair(doc, "c", "blocked")
    assert code == 0 and p["verdict"] == cs.AMBIGUOUS
    assert any("NEW above the roof" in note and "no gain is claimed" in note for note in p["notes"]), p["notes"]
