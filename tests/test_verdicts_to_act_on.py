"""[R5 2/6] compare and history never cry wolf: a time verdict fails only where each side pools two whole-suite runs
(or the sides are one `bench ab`), a `bench ab` or `--impl` run is never pooled without a note, nothing in common
or an option that does not apply is exit 2, float figures have a tolerance, and the output leads with the answer."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from bench.analysis.figures import same_figure
from bench.cli import main
from tests.synthetic import commit_id, noisy, record, write_run

BASE, NEW = commit_id(1), commit_id(2)
AB = ["ab", BASE[:7], NEW[:7], "suites/smoke.yaml", "--impl", "dense"]


def day(i: int, hour: int = 0) -> str:
    return f"2026-03-{i + 1:02d}T{hour:02d}:00:00.000000Z"


def runs(root, commit, n, median, start, *, rng, command=None, impls=("dense", "sdpa")):
    for i in range(n):
        write_run(root, commit=commit, started_at=day(start + i), command=command,
                  records=[record("c", impl, noisy(rng, median)) for impl in impls])


def compare(capsys, *args):
    code = main(["compare", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_slowdown_between_one_run_a_side_is_advisory_and_two_runs_a_side_gate(tmp_path, capsys):
    rng = np.random.default_rng(0)
    runs(tmp_path, BASE, 1, 1e-3, 0, rng=rng)
    runs(tmp_path, NEW, 1, 1.5e-3, 1, rng=rng)
    code, out, _ = compare(capsys, BASE[:7], NEW[:7], "--results", str(tmp_path))
    assert code == 0 and out.startswith("no regression (exit 0): 2 pairs compared: 2 SLOWER (advisory")
    assert "2 time verdicts SLOWER or FASTER that cannot fail this comparison (advisory" in " ".join(out.split())
    assert "BASE pools 1 whole-suite run, NEW 1 whole-suite run" in out
    runs(tmp_path, BASE, 1, 1e-3, 2, rng=rng)  # two runs on BASE, still one on NEW: advisory
    code, out, _ = compare(capsys, BASE[:7], NEW[:7], "--results", str(tmp_path))
    assert code == 0 and "BASE pools 2 whole-suite runs, NEW 1 whole-suite run" in out
    runs(tmp_path, NEW, 1, 1.5e-3, 3, rng=rng)
    code, out, _ = compare(capsys, BASE[:7], NEW[:7], "--results", str(tmp_path))
    assert code == 1 and out.startswith("REGRESSION in 2 pairs (exit 1)")
    assert "REGRESSIONS" in out and "advisory" not in out


def test_a_bench_ab_side_is_not_pooled_with_whole_suite_runs_and_the_note_says_so(tmp_path, capsys):
    rng = np.random.default_rng(1)
    runs(tmp_path, BASE, 2, 1e-3, 0, rng=rng)
    runs(tmp_path, BASE, 1, 3e-3, 2, rng=rng, command=AB, impls=("dense",))  # another process, 3x slower
    runs(tmp_path, NEW, 2, 1e-3, 3, rng=rng)
    code, doc_text, _ = compare(capsys, BASE[:7], NEW[:7], "--results", str(tmp_path), "--json")
    doc = json.loads(doc_text)
    assert code == 0 and len(doc["base"]["runs"]) == 2 and len(doc["base"]["set_aside"]) == 1
    assert all(p["verdict"] != "FASTER" for p in doc["pairs"])
    code, out, _ = compare(capsys, BASE[:7], NEW[:7], "--results", str(tmp_path))
    assert "set aside, made differently" in out and "`bench ab" in out


def test_the_two_runs_of_one_bench_ab_gate(tmp_path, capsys):
    rng = np.random.default_rng(2)
    base = write_run(tmp_path, commit=BASE, started_at=day(0), command=AB, records=[record("c", "dense",
                                                                                           noisy(rng, 1e-3))])
    new = write_run(tmp_path, commit=NEW, started_at=day(0), command=AB, records=[record("c", "dense",
                                                                                         noisy(rng, 1.5e-3))])
    code, out, _ = compare(capsys, str(base), str(new))
    assert code == 1 and "REGRESSION in 1 pairs" in out
    other = write_run(tmp_path, commit=NEW, started_at=day(5), command=[*AB[:3], "suites/cpu.yaml"],
                      records=[record("c", "dense", noisy(rng, 1.5e-3))])
    code, out, _ = compare(capsys, str(base), str(other))  # sides of two different bench ab runs: advisory
    assert code == 0 and "advisory" in out


def test_nothing_in_common_an_empty_side_and_options_that_do_not_apply_are_exit_2(tmp_path, capsys):
    rng = np.random.default_rng(3)
    smoke = write_run(tmp_path, commit=BASE, started_at=day(0), records=[record("a", "dense", noisy(rng, 1e-3))])
    cpu = write_run(tmp_path, commit=NEW, started_at=day(1), suite="cpu",
                    records=[record("b", "dense", noisy(rng, 1e-3))])
    empty = write_run(tmp_path, commit=NEW, started_at=day(2), records=[])
    code, _, err = compare(capsys, str(smoke), str(cpu))
    assert code == 2 and "no (case, impl) pair is on both sides" in err and "suite smoke" in err and "cpu" in err
    code, _, err = compare(capsys, str(smoke), str(empty))
    assert code == 2 and "holds no records" in err
    for option, value in (("--suite", "smoke"), ("--results", str(tmp_path))):
        code, _, err = compare(capsys, str(smoke), str(smoke), option, value)
        assert code == 2 and option in err and "two run directories" in err


def test_float_figures_have_a_tolerance_and_counts_none():
    assert same_figure("error.rel_l2", 1.00e-7, 1.05e-7)
    assert not same_figure("error.rel_l2", 1e-7, 0.3)
    assert not same_figure("error.rows_checked", 128, 129)
    assert not same_figure("error.tolerance", 1e-4, 1.05e-4)
    assert same_figure("flops", 4.0e6, 4.0e6 * (1 + 1e-12)) and not same_figure("flops", 4.0e6, 4.1e6)
    assert not same_figure("comm.backend", "gloo", "nccl")


def test_repeated_notes_are_printed_once_with_their_count_and_every_pair_only_with_all(tmp_path, capsys):
    rng = np.random.default_rng(4)
    recs = [record(f"c{i}", "triton", noisy(rng, 1e-3), interpreter=True) for i in range(12)]
    base = write_run(tmp_path, commit=BASE, started_at=day(0), records=recs)
    new = write_run(tmp_path, commit=NEW, started_at=day(1), records=recs)
    code, out, _ = compare(capsys, str(base), str(new))
    assert code == 0 and out.count("Triton interpreter") == 1 and "12 pairs: timed through" in out
    assert "c11" not in out  # nothing changed: no pair listed
    code, out, _ = compare(capsys, str(base), str(new), "--all")
    assert "c11" in out


def test_history_sets_aside_ab_and_filtered_runs_and_single_run_steps_are_advisory(tmp_path, capsys):
    rng = np.random.default_rng(5)
    for i in range(6):  # one run per commit; a 1.5x step after commit 2 between levels of three runs each
        write_run(tmp_path, commit=commit_id(i), started_at=day(i),
                  records=[record("c", "dense", noisy(rng, 1e-3 * (1.5 if i >= 3 else 1), n=15))])
    write_run(tmp_path, commit=commit_id(6), started_at=day(6), records=[record("c", "dense", noisy(rng, 9e-3))])
    write_run(tmp_path, commit=commit_id(5), started_at=day(5, 5), command=AB,
              records=[record("c", "dense", noisy(rng, 1e-3))])
    write_run(tmp_path, commit=commit_id(5), started_at=day(5, 6), command=["run", "s.yaml", "--impl", "dense"],
              records=[record("c", "dense", noisy(rng, 1e-3))])
    assert main(["history", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 steps (1 slower) where each level holds at least 2 runs; 1 advisory steps")
    assert "left out: 1 sides of a `bench ab`" in out and "1 runs filtered by --impl" in out
    assert f"{commit_id(2)[:10]}..{commit_id(3)[:10]}" in out
    assert f"{commit_id(5)[:10]}..{commit_id(6)[:10]}" not in out  # the single-run level: advisory, not listed
    assert main(["history", "--results", str(tmp_path), "--all"]) == 0
    assert f"{commit_id(5)[:10]}..{commit_id(6)[:10]}" in capsys.readouterr().out


def test_history_reads_committed_runs_unless_told_otherwise(tmp_path, capsys):
    rng = np.random.default_rng(6)
    results = tmp_path / "results"
    for i in range(4):
        write_run(results, commit=commit_id(i), started_at=day(i), records=[record("c", "dense", noisy(rng, 1e-3))])
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "results"], check=True)
    subprocess.run([*git, "commit", "-qm", "reference runs"], check=True)
    write_run(results, commit=commit_id(9), started_at=day(9), records=[record("c", "dense", noisy(rng, 5e-3))])
    assert main(["history", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert "over 4 commits" in out and "left out: 1 uncommitted runs" in out
    assert main(["history", "--results", str(results), "--uncommitted"]) == 0
    assert "over 5 commits" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["history", "--help"], ["compare", "--help"]])
def test_thresholds_say_why_they_differ(command, capsys):
    with pytest.raises(SystemExit):
        main(command)
    out = " ".join(capsys.readouterr().out.split())
    assert "bench ab" in out and "default" in out
