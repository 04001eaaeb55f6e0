"""Bad suite files: exit code 2 and one message naming the file, the field and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cli import main
from tests.conftest import run_bench, write_suite

GOOD = {"name": "ok", "impls": ["dense"], "defaults": {"heads": 2, "head_dim": 16},
        "sweep": {"seq_len": [64, 128]}, "measure": {"repeat": 3}}


def bench_exit(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.err


def with_changes(**changes) -> dict:
    suite = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GOOD.items()}
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            suite[section][field] = value
        else:
            suite[section] = value
    return suite


CASES = {
    "malformed_yaml": ("name: x\nimpls: [dense\n", ["malformed YAML at line"]),
    "unknown_key": (with_changes(measure__repeats=3), ["measure.repeats", "unknown key", "repeat"]),
    "wrong_type": (with_changes(sweep__seq_len=[64, "long"]), ["sweep.seq_len[1]", "'long'", "integer"]),
    "out_of_range": (with_changes(sweep__seq_len=[64, -5]), ["sweep.seq_len[1]", "-5", "greater than or equal to 1"]),
    "empty_axis": (with_changes(sweep__seq_len=[]), ["sweep.seq_len", "must not be empty"]),
    "unknown_impl": (with_changes(impls=["dense", "fastest"]), ["impls[1]", "'fastest'", "known implementations:",
                                                               "naive_loop"]),
    "unknown_pattern": (with_changes(sweep__pattern=["local", "spiral"]),
                        ["sweep.pattern[1]", "'spiral'", "known patterns:", "axial"]),
    "axial_not_a_product": (with_changes(defaults__pattern="axial", defaults__window=16, sweep__seq_len=[64, 97]),
                            ["sweep.seq_len[1]", "97", "R*C", "window C = 16"]),
    "unsafe_name": (with_changes(name="../x"), ["name", "'../x'", "[a-z0-9_-]+"]),
    "bad_mode": (with_changes(defaults__mode="backward"), ["defaults.mode", "'fwd' or 'fwd_bwd'"]),
    "missing_density": (with_changes(defaults__pattern="block_random"),
                        ["density: not set; pattern block_random needs a density in [0, 1]", "set defaults.density"]),
    "missing_name": ({"impls": ["dense"]}, ["name", "required"]),
    "sweep_and_sweeps": (with_changes(sweeps=[{"sweep": {"seq_len": [64]}}]), ["sweeps", "not both"]),
    "not_a_mapping": ("- just\n- a list\n", ["a suite is a mapping"]),
    "bad_sweeps_block": (
        {"name": "x", "impls": ["dense"], "sweeps": [{"sweep": {"seq_len": [64]}}, {"defaults": {"head_dim": 0}}]},
        ["sweeps[1].defaults.head_dim", "got 0"]),
    "missing_plugin": (with_changes(plugins=["nothere.py"]), ["plugins[0]", "'nothere.py'", "no such file"]),
    "checkpoint_without_backward": (with_changes(defaults__checkpoint=True),
                                    ["checkpoint", "mode fwd_bwd"]),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_bad_suite_exits_2_naming_file_and_field(kind, tmp_path, capsys):
    content, expected = CASES[kind]
    path = write_suite(tmp_path, content)
    code, err = bench_exit(capsys, "run", str(path), "--out", str(tmp_path / "results"))
    assert code == 2, err
    assert str(path) in err
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert "Traceback" not in err
    assert not (tmp_path / "results").exists()  # validation happens before any work


def test_missing_file(tmp_path, capsys):
    code, err = bench_exit(capsys, "run", str(tmp_path / "absent.yaml"))
    assert code == 2
    assert "absent.yaml: no such suite file" in err


def test_bad_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "suites/smoke.yaml", "--device", "tpu"])
    assert exc.value.code == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


def test_unknown_impl_flag(tmp_path, capsys):
    path = write_suite(tmp_path, GOOD)
    code, err = bench_exit(capsys, "run", str(path), "--impl", "nope", "--dry-run")
    assert code == 2
    assert "--impl: got 'nope'; known implementations:" in err


def test_command_line_prints_no_traceback(tmp_path):
    path = write_suite(tmp_path, with_changes(sweep__seq_len=[64, "long"]))
    proc = run_bench("run", str(path), "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("allowed: a valid integer") or "sweep.seq_len[1]" in proc.stderr


def test_dry_run_lists_cases_and_runs_nothing(tmp_path, capsys):
    path = write_suite(tmp_path, GOOD)
    code = main(["run", str(path), "--dry-run", "--out", str(tmp_path / "results")])
    out = capsys.readouterr().out
    assert code == 0
    assert "2 (case, impl) pairs" in out and "nothing was run" in out
    assert not (tmp_path / "results").exists()


def test_case_ids_are_stable(tmp_path):
    from bench.suite import load_suite

    path: Path = write_suite(tmp_path, GOOD)
    first = [c.case_id for c in load_suite(path).cases]
    second = [c.case_id for c in load_suite(path).cases]
    assert first == second
    assert first[0] == "local_w64-n64-b1h2d16-fp32-fwd-" + first[0].rsplit("-", 1)[1]
    assert len(set(first)) == len(first)
