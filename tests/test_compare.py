"""`bench compare`: verdicts with statistics, exact figures, environments, modelled records, bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from bench.analysis import stats as cs
from bench.analysis.compare import compare_sides, make_side
from bench.cli import main
from bench.results.records import CommInfo, CommOp
from bench.results.store import load_run
from tests.synthetic import commit_id, noisy, record, write_run

GOLDEN = Path(__file__).parent / "golden" / "compare_mixed.json"
BASE_COMMIT, NEW_COMMIT = commit_id(1), commit_id(2)
LATER = "2026-01-02T00:00:00.000000Z"


def bench_exit(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def compare_json(capsys, base: Path, new: Path, *extra: str) -> tuple[int, dict, str]:
    code, out, err = bench_exit(capsys, "compare", str(base), str(new), "--json", *extra)
    return code, json.loads(out), err


def pair(doc: dict, case_id: str, impl: str = "dense") -> dict:
    (found,) = [p for p in doc["pairs"] if p["case_id"] == case_id and p["impl"] == impl]
    return found


def comm(bytes_total: int) -> CommInfo:
    return CommInfo(backend="gloo", bytes_total=bytes_total, bytes_max_rank=bytes_total // 2,
                    by_op={"all_gather": CommOp(calls=2, bytes_total=bytes_total, bytes_max_rank=bytes_total // 2)},
                    expected_bytes=bytes_total, world_size=2)


def identical_runs(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(1)
    recs = [record(f"case{i}", impl, noisy(rng, 1e-3 * (i + 1))) for i in range(6) for impl in ("dense", "sdpa")]
    base = write_run(tmp_path, commit=BASE_COMMIT, records=recs)
    new = write_run(tmp_path, commit=NEW_COMMIT, records=recs, started_at=LATER)
    return base, new


def test_identical_runs_are_same_everywhere_and_exit_0(tmp_path, capsys):
    base, new = identical_runs(tmp_path)
    code, doc, err = compare_json(capsys, base, new)
    assert code == 0, err
    assert [p["verdict"] for p in doc["pairs"]] == ["SAME"] * 12
    assert all(p["time"]["ratio"] == 1.0 and p["time"]["p_value"] == 1.0 for p in doc["pairs"])
    assert doc["summary"]["regressions"] == 0 and doc["warnings"] == []
    # the terminal form says the same
    code, out, _ = bench_exit(capsys, "compare", str(base), str(new))
    assert code == 0 and "12 SAME" in out and "no regression" in out


def test_samples_scaled_by_1_3_are_slower_with_small_p(tmp_path, capsys):
    rng = np.random.default_rng(2)
    samples = noisy(rng, 2e-3, n=20)
    base = write_run(tmp_path, commit=BASE_COMMIT, records=[record("c", "dense", samples)])
    new = write_run(tmp_path, commit=NEW_COMMIT, records=[record("c", "dense", samples * 1.3)], started_at=LATER)
    code, doc, _ = compare_json(capsys, base, new)
    p = pair(doc, "c")
    # one run per side: the verdict is shown but advisory - it cannot fail the job, and it points to bench ab
    assert code == 0 and p["verdict"] == "SLOWER" and not p["regression"] and p["time"]["advisory"]
    assert doc["time_advisory"] and any("bench ab" in note for note in doc["notes"])
    code, out, _ = bench_exit(capsys, "compare", str(base), str(new))
    assert code == 0 and "SLOWER" in out and "advisory" in out and "bench ab" in out
    assert p["time"]["ratio"] == pytest.approx(1.3)
    assert p["time"]["p_value"] < 1e-6  # every NEW sample above every BASE sample: the exact MWU tail
    assert 1.1 < p["time"]["ci_low"] < 1.3 < p["time"]["ci_high"]
    # the mirror image is FASTER and not a regression
    code, doc, _ = compare_json(capsys, new, base)
    assert code == 0 and pair(doc, "c")["verdict"] == "FASTER"


def test_heavy_noise_is_ambiguous_not_slower(tmp_path, capsys):
    rng = np.random.default_rng(3)
    recs_base = [record(f"n{i}", "dense", noisy(rng, 1e-3, n=10, sigma=0.6)) for i in range(5)]
    recs_new = [record(f"n{i}", "dense", noisy(rng, 1.3e-3, n=10, sigma=0.6)) for i in range(5)]
    base = write_run(tmp_path, commit=BASE_COMMIT, records=recs_base)
    new = write_run(tmp_path, commit=NEW_COMMIT, records=recs_new, started_at=LATER)
    code, doc, _ = compare_json(capsys, base, new)
    assert code == 0
    assert [p["verdict"] for p in doc["pairs"]] == ["AMBIGUOUS"] * 5
    for p in doc["pairs"]:  # the interval is wide: it reaches both below 1 and past the threshold
        assert p["time"]["ci_low"] < 1.0 and p["time"]["ci_high"] > 1.1


def test_200_null_cases_keep_false_slower_within_the_corrected_level():
    """Both sides drawn from one distribution: with threshold 0 only the test decides.

    Under this global null BH bounds P(any SLOWER) by alpha = 0.05, so more than 2 false SLOWER is far outside
    what the correction allows; uncorrected p-values at the same level flag ~5% of the 200 cases.
    """
    rng = np.random.default_rng(20240607)
    base_recs = [record(f"null{i}", "dense", noisy(rng, 1e-3, n=12, sigma=0.05)) for i in range(200)]
    new_recs = [record(f"null{i}", "dense", noisy(rng, 1e-3, n=12, sigma=0.05)) for i in range(200)]
    base = make_side("base", [_as_run(base_recs, BASE_COMMIT)], "BASE")
    new = make_side("new", [_as_run(new_recs, NEW_COMMIT)], "NEW")
    result = compare_sides(base, new, threshold_pct=0.0, alpha=0.05)
    verdicts = [p.verdict for p in result.pairs]
    raw_slower = sum(p.time.p_value < 0.05 and p.time.ratio > 1 for p in result.pairs)
    assert len(verdicts) == 200
    assert verdicts.count("SLOWER") <= 2
    assert raw_slower >= 3, "the simulation should show what an uncorrected test would flag"
    assert all(p.q_value >= p.time.p_value for p in result.pairs)


def _as_run(records, commit):
    from bench.results.records import RunInfo, SuiteInfo
    from bench.results.store import Run

    info = RunInfo(run_id=f"20260101T000000-{commit[:7]}-smoke", suite=SuiteInfo(name="smoke", content={}),
                   started_at="2026-01-01T00:00:00Z", env={"git": {"commit": commit}, "fingerprint": "x"})
    return Run(Path("."), info, records)


def test_a_case_turned_incorrect_is_a_regression(tmp_path, capsys):
    rng = np.random.default_rng(4)
    samples = noisy(rng, 1e-3)
    base = write_run(tmp_path, commit=BASE_COMMIT, records=[record("c", "dense", samples)])
    new = write_run(tmp_path, commit=NEW_COMMIT, started_at=LATER, records=[
        record("c", "dense", samples, status="incorrect", rel_l2=0.3, reason="output off the float64 oracle")])
    code, doc, _ = compare_json(capsys, base, new)
    p = pair(doc, "c")
    assert code == 1 and p["regression"] and p["verdict"] is None
    assert {"figure": "status", "base": "ok", "new": "incorrect", "kind": "regression"} in p["changes"]
    assert {"figure": "error.rel_l2", "base": 1e-7, "new": 0.3, "kind": "change"} in p["changes"]
    code, out, _ = bench_exit(capsys, "compare", str(base), str(new))
    assert code == 1 and "REGRESSION" in out and "ok -> incorrect" in out


def test_failed_and_byte_increases_are_regressions_flops_changes_are_reported(tmp_path, capsys):
    rng = np.random.default_rng(5)
    s = [noisy(rng, 1e-3) for _ in range(3)]
    base = write_run(tmp_path, commit=BASE_COMMIT, records=[
        record("a", "dense", s[0]), record("b", "cp_sparse", s[1], comm=comm(1000)),
        record("c", "sdpa", s[2], flops=4e6)])
    new = write_run(tmp_path, commit=NEW_COMMIT, started_at=LATER, records=[
        record("a", "dense", None, status="failed", reason="RuntimeError during timing"),
        record("b", "cp_sparse", s[1], comm=comm(1200)), record("c", "sdpa", s[2], flops=5e6)])
    code, doc, _ = compare_json(capsys, base, new)
    assert code == 1
    assert {"figure": "status", "base": "ok", "new": "failed", "kind": "regression"} in pair(doc, "a")["changes"]
    b = pair(doc, "b", "cp_sparse")
    assert b["regression"] and b["verdict"] == "SAME"
    assert {"figure": "comm.bytes_total", "base": 1000, "new": 1200, "kind": "regression"} in b["changes"]
    c = pair(doc, "c", "sdpa")
    assert not c["regression"] and c["changes"] == [{"figure": "flops", "base": 4e6, "new": 5e6, "kind": "change"}]
    assert doc["summary"]["regressions"] == 2
    # fewer bytes is an improvement, not a regression
    code, doc, _ = compare_json(capsys, new, base)
    assert {"figure": "comm.bytes_total", "base": 1200, "new": 1000, "kind": "improvement"} in \
        pair(doc, "b", "cp_sparse")["changes"]


def test_differing_fingerprints_warn_and_time_verdicts_are_not_comparable(tmp_path, capsys):
    rng = np.random.default_rng(6)
    samples = noisy(rng, 1e-3)
    base = write_run(tmp_path, commit=BASE_COMMIT, records=[record("c", "dense", samples)])
    new = write_run(tmp_path, commit=NEW_COMMIT, started_at=LATER, fingerprint="0123456789abcdef",
                    cpu="Other CPU", records=[record("c", "dense", samples * 1.5)])
    code, doc, err = compare_json(capsys, base, new)
    assert "ENVIRONMENTS DIFFER" in err and "cpu.model: Test CPU -> Other CPU" in err
    assert doc["time_comparable"] is False
    p = pair(doc, "c")
    assert p["verdict"] == "SLOWER" and p["time"]["comparable"] is False and not p["regression"]
    assert code == 0  # a slowdown measured on another machine cannot fail the comparison
    code, out, err = bench_exit(capsys, "compare", str(base), str(new))
    assert "WARNING" in err and "ENVIRONMENTS DIFFER" in err and "not comparable" in out


def test_pairs_on_one_side_only_are_listed(tmp_path, capsys):
    rng = np.random.default_rng(7)
    s = noisy(rng, 1e-3)
    base = write_run(tmp_path, commit=BASE_COMMIT, records=[record("c", "dense", s), record("gone", "dense", s)])
    new = write_run(tmp_path, commit=NEW_COMMIT, started_at=LATER,
                    records=[record("c", "dense", s), record("c", "blocked", s)])
    code, doc, _ = compare_json(capsys, base, new)
    assert code == 0 and len(doc["pairs"]) == 1
    assert doc["only_base"] == [{"case_id": "gone", "impl": "dense", "status": "ok"}]
    assert doc["only_new"] == [{"case_id": "c", "impl": "blocked", "status": "ok"}]
    code, out, _ = bench_exit(capsys, "compare", str(base), str(new))
    assert "only in BASE" in out and "gone | dense" in out and "c | blocked" in out


def test_modelled_records_are_never_compared_as_measurements(tmp_path, capsys):
    rng = np.random.default_rng(8)
    s = noisy(rng, 1e-3)
    base = write_run(tmp_path, commit=BASE_COMMIT, records=[record("c", "dense", s), record("m", "cp_ring", s)])
    new = write_run(tmp_path, commit=NEW_COMMIT, started_at=LATER, records=[
        record("c", "dense", s), record("m", "cp_ring", s * 3, source="modelled", device="model: H100")])
    code, doc, _ = compare_json(capsys, base, new)
    assert code == 0
    assert [(p["case_id"], p["impl"]) for p in doc["pairs"]] == [("c", "dense")]
    assert doc["modelled_not_compared"] == [{"side": "new", "case_id": "m", "impl": "cp_ring"}]
    assert doc["only_base"] == [{"case_id": "m", "impl": "cp_ring", "status": "ok"}]
    assert any("modelled" in n for n in doc["notes"])
    # a run that is a model as a whole is refused
    model = write_run(tmp_path / "m", commit=commit_id(3), source="modelled",
                      records=[record("c", "dense", s * 0.5, source="modelled")])
    code, out, err = bench_exit(capsys, "compare", str(base), str(model))
    assert code == 2 and out == ""
    assert "holds only modelled records" in err and "not measurements" in err


def test_commit_prefixes_pool_the_runs_of_a_commit(tmp_path, capsys):
    rng = np.random.default_rng(9)
    results = tmp_path / "results"
    for i, day in enumerate(("01", "02", "03", "04")):
        commit = BASE_COMMIT if i % 2 == 0 else NEW_COMMIT  # interleaved rounds, as CI measures them
        write_run(results, commit=commit, started_at=f"2026-01-{day}T00:00:00.000000Z",
                  records=[record("c", "dense", noisy(rng, 1e-3, n=10))])
    code, doc, err = compare_json(capsys, Path(BASE_COMMIT[:7]), Path(NEW_COMMIT[:8]), "--results", str(results))
    assert code == 0, err
    assert len(doc["base"]["runs"]) == 2 and len(doc["new"]["runs"]) == 2
    assert pair(doc, "c")["time"]["n_base"] == 20 and pair(doc, "c")["time"]["n_new"] == 20
    code, _, err = bench_exit(capsys, "compare", "deadbeef", BASE_COMMIT[:7], "--results", str(results))
    assert code == 2 and "no run of a commit starting with 'deadbeef'" in err and BASE_COMMIT[:10] in err
    code, _, err = bench_exit(capsys, "compare", "000000", NEW_COMMIT[:7], "--results", str(results))
    assert code == 2 and "ambiguous" in err
    code, _, err = bench_exit(capsys, "compare", "not/a/run", NEW_COMMIT[:7], "--results", str(results))
    assert code == 2 and "expected a run directory" in err


def test_a_corrupt_file_exits_2_naming_it(tmp_path, capsys):
    rng = np.random.default_rng(10)
    results = tmp_path / "results"
    write_run(results, commit=BASE_COMMIT, records=[record("c", "dense", noisy(rng, 1e-3))])
    broken = write_run(results, commit=NEW_COMMIT, started_at=LATER,
                       records=[record("c", "dense", noisy(rng, 1e-3)), record("d", "dense", noisy(rng, 1e-3))])
    lines = (broken / "records.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1].replace('"status":"ok"', '"status":"fine"')
    (broken / "records.jsonl").write_text("".join(lines))
    code, out, err = bench_exit(capsys, "compare", BASE_COMMIT[:7], NEW_COMMIT[:7], "--results", str(results))
    assert code == 2 and out == ""
    assert str(broken / "records.jsonl") in err and "line 2" in err and "status" in err
    assert "Traceback" not in err
    # loading the store validates every run, even one neither side asked for
    code, _, err = bench_exit(capsys, "compare", BASE_COMMIT[:7], BASE_COMMIT[:7], "--results", str(results))
    assert code == 2 and str(broken / "records.jsonl") in err
    (broken / "run.json").write_text("{not json")
    code, _, err = bench_exit(capsys, "compare", str(broken), BASE_COMMIT[:7], "--results", str(results))
    assert code == 2 and str(broken / "run.json") in err and "not valid JSON" in err
    shutil.rmtree(broken)
    (results / "stray").mkdir()
    code, _, err = bench_exit(capsys, "history", "--results", str(results))
    assert code == 2 and "stray" in err


@pytest.mark.parametrize(("flag", "value", "expected"), [("--threshold", "-5", "--threshold: got -5.0"),
                                                         ("--alpha", "1.5", "--alpha: got 1.5")])
def test_bad_options_exit_2(tmp_path, capsys, flag, value, expected):
    base, new = identical_runs(tmp_path)
    code, _, err = bench_exit(capsys, "compare", str(base), str(new), flag, value)
    assert code == 2 and expected in err


def test_deterministic_only_ignores_time_but_not_status(tmp_path, capsys):
    rng = np.random.default_rng(11)
    s = noisy(rng, 1e-3)
    base = write_run(tmp_path, commit=BASE_COMMIT, records=[record("c", "dense", s), record("d", "dense", s)])
    new = write_run(tmp_path, commit=NEW_COMMIT, started_at=LATER,
                    records=[record("c", "dense", s * 2), record("d", "dense", s, status="incorrect")])
    code, doc, _ = compare_json(capsys, base, new, "--deterministic-only")
    assert pair(doc, "c")["verdict"] is None and pair(doc, "c")["time"] is None
    assert code == 1 and pair(doc, "d")["regression"] and not pair(doc, "c")["regression"]


def test_verdict_rules():
    def t(lo: float, hi: float) -> cs.TimeTest:
        return cs.TimeTest(10, 10, 1.0, 1.0, math.sqrt(lo * hi), lo, hi, 0.001)

    assert cs.verdict(t(1.15, 1.4), 0.01, 0.1, 0.05) == cs.SLOWER
    assert cs.verdict(t(1.15, 1.4), 0.2, 0.1, 0.05) == cs.AMBIGUOUS  # not significant after correction
    assert cs.verdict(t(1.05, 1.4), 0.01, 0.1, 0.05) == cs.AMBIGUOUS  # may be under the threshold
    assert cs.verdict(t(1.02, 1.08), 0.01, 0.1, 0.05) == cs.SAME  # real but within the threshold
    assert cs.verdict(t(0.6, 0.85), 0.01, 0.1, 0.05) == cs.FASTER
    assert cs.verdict(t(0.5, 2.0), 0.9, 0.1, 0.05) == cs.AMBIGUOUS
    few = cs.compare_samples([1.0, 1.1], [1.0, 1.2, 1.3], seed=0)
    assert few.note and "too few samples" in few.note and cs.verdict(few, 0.0, 0.1, 0.05) == cs.AMBIGUOUS


def test_bootstrap_is_seeded_so_verdicts_repeat():
    rng = np.random.default_rng(12)
    a, b = noisy(rng, 1e-3, sigma=0.1), noisy(rng, 1.1e-3, sigma=0.1)
    first = cs.compare_samples(a, b, seed=cs.seed_for("case|impl"))
    again = cs.compare_samples(a, b, seed=cs.seed_for("case|impl"))
    other = cs.compare_samples(a, b, seed=cs.seed_for("other|impl"))
    assert first == again and (first.ci_low, first.ci_high) != (other.ci_low, other.ci_high)


def _mixed_scenario(root: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(2024)
    same, slow, fast, bytes_ = (noisy(rng, 1e-3, n=20) for _ in range(4))
    base = write_run(root, commit=BASE_COMMIT, records=[
        record("same", "dense", same), record("slow", "dense", slow), record("fast", "dense", fast),
        record("noisy", "dense", noisy(rng, 1e-3, n=10, sigma=0.6)), record("broken", "dense", same),
        record("bytes", "cp_sparse", bytes_, comm=comm(4096)), record("gone", "dense", same)])
    new = write_run(root, commit=NEW_COMMIT, started_at=LATER, records=[
        record("same", "dense", same), record("slow", "dense", slow * 1.3), record("fast", "dense", fast * 0.7),
        record("noisy", "dense", noisy(rng, 1.3e-3, n=10, sigma=0.6)),
        record("broken", "dense", same, status="incorrect", rel_l2=0.5),
        record("bytes", "cp_sparse", bytes_ * 1.02, comm=comm(8192)), record("added", "blocked", same),
        record("model", "dense", same, source="modelled")])
    return base, new


def _golden_view(doc: dict) -> dict:
    """The stable part of the JSON: verdicts, rounded figures, changes, missing pairs, summary."""
    def rounded(x: float | None, digits: int) -> float | None:
        return None if x is None else float(f"{x:.{digits}g}")

    return {
        "pairs": [{"case_id": p["case_id"], "impl": p["impl"], "verdict": p["verdict"],
                   "ratio": rounded((p["time"] or {}).get("ratio"), 4),
                   "p_value": rounded((p["time"] or {}).get("p_value"), 3),
                   "q_value": rounded((p["time"] or {}).get("q_value"), 3),
                   "changes": p["changes"], "regression": p["regression"]} for p in doc["pairs"]],
        "only_base": doc["only_base"], "only_new": doc["only_new"],
        "modelled_not_compared": doc["modelled_not_compared"], "summary": doc["summary"],
        "exit_code": doc["exit_code"],
    }


def test_golden_mixed_comparison(tmp_path, capsys):
    base, new = _mixed_scenario(tmp_path)
    code, doc, _ = compare_json(capsys, base, new)
    view = _golden_view(doc)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(view, indent=1) + "\n")
    assert view == json.loads(GOLDEN.read_text())
    assert code == 1
    assert doc["base"]["runs"] == [load_run(base).info.run_id]


def test_runs_pooled_per_side_put_run_to_run_variation_into_the_interval():
    """Three runs a side whose levels spread by 10% (a busy neighbour, clocks): a 14% shift is not proven.

    Resampling the pooled samples alone would call it SLOWER; resampling runs, then samples, says AMBIGUOUS.
    """
    rng = np.random.default_rng(13)
    base_runs = [noisy(rng, level, n=20, sigma=0.01) for level in (1.00e-3, 1.05e-3, 1.10e-3)]
    new_runs = [noisy(rng, level, n=20, sigma=0.01) for level in (1.15e-3, 1.20e-3, 1.25e-3)]
    seed = cs.seed_for("c|dense")
    flat = cs.compare_samples(np.concatenate(base_runs), np.concatenate(new_runs), seed)
    runs = cs.compare_runs(base_runs, new_runs, seed)
    assert (runs.runs_base, runs.runs_new, runs.n_base) == (3, 3, 60) and runs.ratio == flat.ratio
    assert cs.verdict(flat, flat.p_value, 0.1, 0.05) == cs.SLOWER
    assert cs.verdict(runs, runs.p_value, 0.1, 0.05) == cs.AMBIGUOUS
    assert runs.ci_low < 1.1 < flat.ci_low and runs.ci_high > flat.ci_high
    # the same shift with steady runs is proven either way
    steady_base = [noisy(rng, 1e-3, n=20, sigma=0.01) for _ in range(3)]
    steady_new = [noisy(rng, 1.3e-3, n=20, sigma=0.01) for _ in range(3)]
    steady = cs.compare_runs(steady_base, steady_new, seed)
    assert cs.verdict(steady, steady.p_value, 0.1, 0.05) == cs.SLOWER

