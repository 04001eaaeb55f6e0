"""Bad suite files: exit code 2 and one message naming the file, the field and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cli import main
from tests.conftest import PLUGINS, only_run_dir, read_jsonl, run_bench, write_suite

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
    # a key with a dash once looked like a union member's name and was dropped from the path (IndexError)
    "unknown_dashed_key": ({**GOOD, "-": None}, ["-: unknown key", "allowed keys here: name"]),
    "unknown_dashed_field": (with_changes(defaults__a_b=1) | {"defaults": {"heads": 2, "a-b": 1}},
                             ["defaults.a-b", "unknown key"]),
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
    "misspelled_field": (with_changes(defaults__kv_head=1), ["defaults.kv_head", "unknown key",
                                                             "did you mean 'kv_heads'?"]),
    "kv_heads_not_dividing": (with_changes(defaults__heads=6, defaults__kv_heads=4),
                              ["defaults.kv_heads", "got 4 with heads 6", "allowed kv_heads [1, 2, 3, 6]"]),
    "q_len_past_seq_len": (with_changes(defaults__q_len=100),
                           ["defaults.q_len", "got 100; allowed: 1 to seq_len (64)"]),
    "documents_not_summing": (with_changes(defaults__documents=[30, 30]),
                              ["defaults.documents", "lengths [30, 30] sum to 60; they must sum to seq_len (64)"]),
    "documents_zero": (with_changes(defaults__documents=[64, 0]), ["defaults.documents[1]", "got 0"]),
    "window_larger_than_image": (with_changes(defaults__pattern="neighborhood", defaults__image_width=8,
                                              defaults__window=9),
                                 ["defaults.window", "got 9; the kernel may not be larger than the image (8 rows x 8 "
                                  "columns): allowed odd sizes up to 8"]),
    "neighborhood_even_kernel": (with_changes(defaults__pattern="neighborhood", defaults__image_width=8,
                                              defaults__window=4), ["defaults.window", "must be odd"]),
    "neighborhood_without_width": (with_changes(defaults__pattern="neighborhood", defaults__window=3),
                                   ["image_width: not set", "set defaults.image_width or sweep it"]),
    "zigzag_on_one_rank": (with_changes(defaults__cp_layout="zigzag"),
                           ["defaults.cp_layout", "got cp_layout 'zigzag' with world_size 1", "needs world_size >= 2"]),
    "unknown_cp_layout": (with_changes(defaults__world_size=2, defaults__cp_layout="diagonal"),
                          ["defaults.cp_layout", "'contiguous' or 'zigzag'"]),
    "ulysses_degree_not_dividing": (with_changes(defaults__world_size=4, defaults__ulysses_degree=3),
                                    ["defaults.ulysses_degree", "got 3 with world_size 4",
                                     "allowed ulysses_degree [1, 2, 4] (or null)"]),
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
    assert "sweep.seq_len[1]" in proc.stderr and "'long'" in proc.stderr and "integer" in proc.stderr, proc.stderr


def test_dry_run_lists_cases_and_runs_nothing(tmp_path, capsys):
    path = write_suite(tmp_path, GOOD)
    code = main(["run", str(path), "--dry-run", "--out", str(tmp_path / "results")])
    out = capsys.readouterr().out
    assert code == 0
    assert "2 (case, impl) pairs" in out and "nothing was run" in out
    assert not (tmp_path / "results").exists()


def test_case_ids_are_stable(tmp_path):
    from bench.spec.suite import load_suite

    path: Path = write_suite(tmp_path, GOOD)
    first = [c.case_id for c in load_suite(path).cases]
    second = [c.case_id for c in load_suite(path).cases]
    assert first == second
    assert first[0] == "local_w64-n64-b1h2d16-fp32-fwd-" + first[0].rsplit("-", 1)[1]
    assert len(set(first)) == len(first)


@pytest.mark.parametrize("which, expected", [
    ("clash", ["plugins[0]", "pattern name 'causal' is already registered (built-in)"]),
    ("raises", ["defaults.pattern", "pattern bad_raises: the predicate (plugin bad_patterns.py) raised "
                "RuntimeError: ZeroDivisionError"]),
    ("not_bool", ["defaults.pattern", "returned a torch.int64 tensor; it must return a bool tensor"]),
])
def test_bad_custom_patterns_exit_2_at_load(which, expected, tmp_path):
    (tmp_path / "bad_patterns.py").write_text((PLUGINS / "bad_patterns.py").read_text())
    pattern = {"clash": "causal", "raises": "bad_raises", "not_bool": "bad_not_bool"}[which]
    path = write_suite(tmp_path, with_changes(plugins=["bad_patterns.py"], defaults__pattern=pattern))
    proc = run_bench("run", str(path), "--out", str(tmp_path / "results"), env={"BENCH_TEST_BAD_PATTERN": which})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(path) in proc.stderr and "Traceback" not in proc.stderr
    for fragment in expected:
        assert fragment in proc.stderr, f"{fragment!r} not in {proc.stderr!r}"
    assert not (tmp_path / "results").exists()


def test_a_pattern_failing_mid_run_gives_failed_records_naming_it(tmp_path):
    """A mask_mod that passes the load-time probe but raises on real blocks: every record failed, naming the
    pattern, the healthy built-in case after it still measured, exit 1."""
    (tmp_path / "bad_patterns.py").write_text((PLUGINS / "bad_patterns.py").read_text())
    path = write_suite(tmp_path, {"name": "late", "impls": ["dense", "sdpa"], "plugins": ["bad_patterns.py"],
                                  "defaults": {"heads": 2, "head_dim": 16, "seq_len": 64},
                                  "sweep": {"pattern": ["bad_late", "causal"]}, "measure": {"repeat": 3}})
    proc = run_bench("run", str(path), "--out", str(tmp_path / "results"), env={"BENCH_TEST_BAD_PATTERN": "late"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    late = [r for r in records if r["params"]["pattern"] == "bad_late"]
    assert len(late) == 2 and all(r["status"] == "failed" for r in late)
    assert all("pattern bad_late: the predicate (plugin bad_patterns.py) raised RuntimeError: planted failure"
               in r["reason"] for r in late), [r["reason"] for r in late]
    assert all(r["status"] == "ok" for r in records if r["params"]["pattern"] == "causal")
