"""Fuzzing: generated suite files and results files never produce a traceback.

Either the input loads, or a clear `BadInput` message comes out (exit code 2 at the command line).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.cli import main
from bench.errors import BadInput
from bench.results.store import load_run
from bench.spec.case import Case

FIELDS = list(Case.field_names())
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10, 5000), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["local", "axial", "fwd_bwd", "bfloat16", "cpu", "dense"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)
CASE_DICT = st.dictionaries(st.sampled_from([*FIELDS, "bogus"]), VALUES, max_size=5)
AXES = st.dictionaries(st.sampled_from([*FIELDS, "bogus"]), st.one_of(st.lists(SCALARS, max_size=3), VALUES),
                       max_size=3)
SUITES = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.sampled_from(["fz", "../x", "Bad Name", ""]), SCALARS),
        "impls": st.one_of(st.lists(st.sampled_from(["dense", "sdpa", "naive_loop", "nope"]), max_size=3), VALUES),
        "description": VALUES,
        "defaults": st.one_of(CASE_DICT, VALUES),
        "sweep": st.one_of(AXES, VALUES),
        "sweeps": st.one_of(st.lists(st.fixed_dictionaries({}, optional={"defaults": CASE_DICT, "sweep": AXES}),
                                     max_size=2), VALUES),
        "measure": st.one_of(st.dictionaries(st.sampled_from(["warmup", "repeat", "max_time_s", "timeout_s",
                                                              "check", "bogus"]), SCALARS, max_size=3), VALUES),
        "plugins": st.one_of(st.lists(st.sampled_from(["missing.py", "json", "no_such_module"]), max_size=2),
                             VALUES),
        "extra": VALUES,
    },
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


@FUZZ
@given(suite=SUITES)
def test_generated_suites_load_or_exit_2(suite, tmp_path_factory, capsys):
    path = tmp_path_factory.mktemp("fuzz") / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, allow_unicode=True))
    code = main(["run", str(path), "--dry-run", "--out", str(path.parent / "results")])
    err = capsys.readouterr().err
    assert code in (0, 2)
    if code == 2:
        assert err.startswith("bench run: error: ") and str(path) in err and "Traceback" not in err


@FUZZ
@given(text=st.text(max_size=300))
def test_arbitrary_text_as_a_suite_file(text, tmp_path_factory, capsys):
    path = tmp_path_factory.mktemp("fuzztext") / "suite.yaml"
    path.write_text(text)
    code = main(["run", str(path), "--dry-run", "--out", str(path.parent / "results")])
    assert code in (0, 2)
    capsys.readouterr()


def _valid_run(tmp: Path) -> Path:
    run_dir = tmp / "20260101T000000-abc1234-fz"
    run_dir.mkdir()
    info = {"schema_version": 1, "run_id": run_dir.name, "suite": {"name": "fz", "content": {}},
            "started_at": "2026-01-01T00:00:00Z", "finished_at": None, "env": {"fingerprint": "x"}}
    (run_dir / "run.json").write_text(json.dumps(info))
    record = {"schema_version": 1, "case_id": "c", "impl": "dense", "params": {"seq_len": 64}, "status": "ok",
              "time_s": {"median": 1.0, "min": 1.0, "max": 1.0, "mean": 1.0, "std": 0.0, "q1": 1.0, "q3": 1.0,
                         "n": 1, "samples": [1.0]}}
    (run_dir / "records.jsonl").write_text(json.dumps(record) + "\n")
    return run_dir


MUTATIONS = st.lists(st.tuples(st.sampled_from(["run.json", "records.jsonl"]), st.integers(0, 10_000),
                               st.binary(min_size=0, max_size=8), st.integers(0, 6)), min_size=1, max_size=4)


@FUZZ
@given(mutations=MUTATIONS)
def test_mutated_results_files_load_or_name_the_file(mutations, tmp_path_factory):
    run_dir = _valid_run(tmp_path_factory.mktemp("fuzzrun"))
    for name, position, insert, delete in mutations:
        path = run_dir / name
        data = path.read_bytes()
        position %= len(data) + 1
        path.write_bytes(data[:position] + insert + data[position + delete:])
    try:
        load_run(run_dir)
    except BadInput as exc:
        assert str(run_dir) in str(exc)


@FUZZ
@given(record=st.dictionaries(st.sampled_from(["schema_version", "case_id", "impl", "params", "status", "time_s",
                                               "memory", "error", "comm", "flops", "junk"]), VALUES, max_size=8))
def test_generated_records_load_or_name_the_line(record, tmp_path_factory):
    run_dir = _valid_run(tmp_path_factory.mktemp("fuzzrec"))
    with open(run_dir / "records.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    try:
        load_run(run_dir)
    except BadInput as exc:
        assert "records.jsonl" in str(exc) and "line 2" in str(exc)
