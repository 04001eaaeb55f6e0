"""The committed-baseline check of CI (`python -m bench.analysis.baseline check|refresh`), with real runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.analysis.baseline import main, read_baseline
from tests.conftest import write_suite
from tests.synthetic import commit_id, record, write_run


def tiny_suite(directory: Path, impls: list[str], **defaults) -> Path:
    return write_suite(directory, name=f"tiny-{'-'.join(impls)}.yaml", content={
        "name": "tiny", "impls": impls, "plugins": ["faulty.py"],
        "defaults": {"heads": 1, "head_dim": 8, "seq_len": 32, "window": 8, "device": "cpu", **defaults},
        "sweep": {"pattern": ["local", "causal"]}, "measure": {"warmup": 0, "repeat": 3, "max_time_s": 0.01}})


def baseline(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_refresh_then_check(tmp_path, capsys, faulty_plugin):
    results = tmp_path / "results"
    suite = tiny_suite(tmp_path, ["dense", "fault_wrong"])
    opts = ("--results", str(results), "--suite", str(suite))

    code, _, err = baseline(capsys, "check", *opts)
    assert code == 0 and "does not exist: the deterministic baseline check was NOT run" in err

    # a run with an incorrect record is refused as a baseline
    unhealthy = write_run(results, commit=commit_id(1), records=[record("c", "dense", [1e-3] * 3, status="incorrect")])
    code, _, err = baseline(capsys, "refresh", *opts, "--run", str(unhealthy))
    assert code == 1 and "a baseline must be healthy" in err and not (results / "BASELINE").exists()
    code, _, err = baseline(capsys, "refresh", *opts, "--run", str(tmp_path))
    assert code == 2 and f"must be a run directory directly under {results}" in err
    shutil.rmtree(unhealthy)

    healthy = tiny_suite(tmp_path, ["dense"])
    code, _, err = baseline(capsys, "refresh", "--results", str(results), "--suite", str(healthy))
    assert code == 0, err
    run_id = read_baseline(results / "BASELINE")
    assert run_id and (results / run_id / "records.jsonl").is_file() and "git add" in err

    # the same suite again: nothing changed
    code, out, _ = baseline(capsys, "check", "--results", str(results), "--suite", str(healthy))
    assert code == 0 and "no regression" in out and "time not compared" in out

    # the baseline knew fault_wrong as ok on the first case only: that case is now a regression, the other one
    # is listed as new (an implementation added since a baseline never fails the check), and a changed
    # figure is reported
    records = results / run_id / "records.jsonl"
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    lines.append({**lines[0], "impl": "fault_wrong"})
    lines[1]["flops"] *= 2
    records.write_text("".join(json.dumps(r) + "\n" for r in lines))
    code, out, _ = baseline(capsys, "check", *opts)
    assert code == 1 and "REGRESSION in 1 pairs" in out
    assert "only in NEW" in out and f"{lines[1]['case_id']} | fault_wrong" in out
    assert "flops" in out and "incorrect" in out


def test_bad_or_stale_baselines(tmp_path, capsys, faulty_plugin):
    results = tmp_path / "results"
    results.mkdir()
    (results / "BASELINE").write_text("# comment\n20990101T000000-abc-tiny\n")
    code, _, err = baseline(capsys, "check", "--results", str(results), "--suite", str(tiny_suite(tmp_path, [])))
    assert code == 2 and "names '20990101T000000-abc-tiny', which is not a run directory" in err
    (results / "BASELINE").write_text("a\nb\n")
    code, _, err = baseline(capsys, "check", "--results", str(results))
    assert code == 2 and "expected exactly one run id line" in err
