"""`bench ab` end to end on a temporary git repository: worktrees, both sides' runs, bad input, a killed run.

The repository is made here (a copy of this checkout's bench/ and impls/ with a one-case suite, committed), the
results store is a temporary directory, and every test checks that no worktree is left behind. Nothing here
asserts how long anything takes: deadlines only bound the waiting for a process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, read_jsonl

TINY = {"name": "tiny", "impls": ["dense", "sdpa"],
        "defaults": {"heads": 1, "head_dim": 8, "seq_len": 32, "window": 4, "device": "cpu"},
        "sweep": {"pattern": ["local"]},
        "measure": {"warmup": 1, "repeat": 3, "max_time_s": 0.05, "timeout_s": 60}}
FAST = ["--rounds", "5", "--block-ms", "1"]


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@localhost", *args],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def worktrees(repo: Path) -> list[str]:
    return [line for line in git(repo, "worktree", "list", "--porcelain").splitlines() if line.startswith("worktree ")]


def worktrees_while_changing(repo: Path) -> list[str] | None:
    """worktrees(repo) while bench ab adds or removes one: None where git fails to read a worktree's entry that
    it is writing or removing that moment (exit 128, seen once in CI), so the caller polls again."""
    try:
        return worktrees(repo)
    except subprocess.CalledProcessError:
        return None


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """main: the tiny suite; `renamed`: the suite named differently; `nosuite`: the suite file removed; `slow`:
    dense twice as slow (scripts/ab_plant.py)."""
    root = tmp_path_factory.mktemp("abrepo") / "repo"
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("bench", "impls"):
        shutil.copytree(ROOT / name, root / name, ignore=ignore)
    (root / "suites").mkdir()
    (root / "suites" / "tiny.yaml").write_text(yaml.safe_dump(TINY, sort_keys=False))
    (root / ".gitignore").write_text("__pycache__/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "tiny")
    git(root, "checkout", "-qb", "renamed")
    (root / "suites" / "tiny.yaml").write_text(yaml.safe_dump({**TINY, "name": "tiny2"}, sort_keys=False))
    git(root, "commit", "-qam", "renamed")
    git(root, "checkout", "-q", "-b", "nosuite", "main")
    git(root, "rm", "-q", "suites/tiny.yaml")
    git(root, "commit", "-qm", "no suite")
    git(root, "checkout", "-q", "-b", "slow", "main")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_plant.py"), str(root / "impls" / "dense"), "100"],
                   check=True, capture_output=True)
    git(root, "commit", "-qam", "dense twice as slow")
    git(root, "checkout", "-q", "main")
    return root


@pytest.fixture
def clean(repo, tmp_path):
    """The TMPDIR `bench ab` gets (its worktrees are made there); after the test the repository has no worktree
    but itself and that directory is empty."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    yield tmp
    assert worktrees(repo) == [f"worktree {repo}"]
    assert list(tmp.iterdir()) == []


def env_for(tmp: Path) -> dict[str, str]:
    return {**os.environ, "COLUMNS": "100", "PYTHONPATH": "", "TMPDIR": str(tmp)}


def bench(repo: Path, tmp: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m bench ARGS` run in the temporary repository (so it imports that checkout's bench)."""
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=repo, capture_output=True, text=True,
                          timeout=timeout, env=env_for(tmp))


def bench_here(capsys, monkeypatch, repo: Path, tmp: Path, *args: str) -> tuple[int, str]:
    """`bench ARGS` in this process, in the repository (for input refused before any worker starts)."""
    from bench.cli import main

    monkeypatch.chdir(repo)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    code = main(list(args))
    return code, capsys.readouterr().err


def test_ab_of_two_revisions_writes_both_runs_and_leaves_no_worktree(repo, tmp_path, clean):
    out = tmp_path / "results"
    md = tmp_path / "summary.md"
    proc = bench(repo, clean, "ab", "main", "main~0", "suites/tiny.yaml", *FAST, "--out", str(out), "--json",
                 "--markdown", str(md))
    assert proc.returncode in (0, 1), proc.stderr
    doc = json.loads(proc.stdout)  # stdout is the JSON alone; progress went to stderr
    assert doc["schema"] == "bench-ab/1" and doc["exit_code"] == proc.returncode
    assert [p["impl"] for p in doc["pairs"]] == ["dense", "sdpa"]
    assert all(p["mode"] == "interleaved" and p["base_status"] == p["new_status"] == "ok" for p in doc["pairs"])
    assert all(p["time"]["rounds"] == 5 * p["time"]["looks"] and p["time"]["mde_pct"] is not None
               for p in doc["pairs"])
    assert "[1/2]" in proc.stderr and "[2/2]" in proc.stderr
    # both sides are ordinary runs of the store: run.json finished, one record per pair, read by bench compare
    runs = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(runs) == 2 and {doc["base"]["run_dir"], doc["new"]["run_dir"]} == {str(r) for r in runs}
    for run in runs:
        info = json.loads((run / "run.json").read_text())
        assert info["finished_at"] and info["suite"]["name"] == "tiny"
        records = read_jsonl(run / "records.jsonl")
        assert [(r["impl"], r["status"]) for r in records] == [("dense", "ok"), ("sdpa", "ok")]
        assert records[0]["time_s"]["stopped_by"] == "blocks"
        for r in records:  # the wall split by phase: the blocks apart from the other side's turns (waiting)
            assert {"first call", "check", "warm-up", "timing", "waiting", "memory"} <= set(r["phases_s"])
            assert sum(r["phases_s"].values()) == pytest.approx(r["wall_s"], rel=1e-3, abs=1e-3)
    cmp = bench(repo, clean, "compare", str(runs[0]), str(runs[1]))
    # the two runs of one bench ab: their time verdicts gate (no advisory note)
    assert cmp.returncode == 0 and "2 pairs compared" in cmp.stdout and "advisory" not in cmp.stdout
    assert md.read_text().startswith("### bench ab `tiny`")


def test_an_open_verdict_gets_another_look_on_fresh_workers(repo, tmp_path, clean):
    """dense twice as slow: one trial alone can never be SLOWER, so the pair is open after the first look and
    gets a second trial of R rounds; then SLOWER (NOISY where this machine was busy while it was timed)."""
    # a budget no restart of the workers can exhaust (the default, 1.75x a first pass of one pair, can)
    proc = bench(repo, clean, "ab", "main", "slow", "suites/tiny.yaml", "--rounds", "6", "--max-rounds", "12",
                 "--budget-s", "600", "--block-ms", "1", "--impl", "dense", "--out", str(tmp_path / "results"),
                 "--json")
    assert proc.returncode in (0, 1), proc.stderr
    doc = json.loads(proc.stdout)
    (pair,) = doc["pairs"]
    assert doc["settings"]["looks"] == [6, 12]
    assert pair["time"]["looks"] == 2 and [t["rounds"] for t in pair["time"]["trials"]] == [6, 6]
    assert all(t["ratio"] > 1.3 for t in pair["time"]["trials"])
    assert pair["time"]["p_sequential"] < 0.05
    expected = "NOISY" if pair["busy"] else "SLOWER"
    assert pair["verdict"] == expected and doc["impls"][0]["verdict"] == expected
    assert proc.returncode == (1 if expected == "SLOWER" else 0)
    assert "trial 2:" in proc.stderr


def test_a_spent_budget_adds_no_look_and_says_how_many_were_left_open(repo, tmp_path, clean):
    proc = bench(repo, clean, "ab", "main", "slow", "suites/tiny.yaml", "--rounds", "6", "--max-rounds", "12",
                 "--budget-s", "0", "--block-ms", "1", "--impl", "dense", "--out", str(tmp_path / "results"), "--json")
    doc = json.loads(proc.stdout)
    (pair,) = doc["pairs"]
    assert pair["time"]["looks"] == 1 and doc["settings"]["left_open"] == 1 and doc["settings"]["budget_s"] == 0
    assert any("ran out with 1 pair(s) still open" in n for n in doc["notes"])
    assert pair["verdict"] != "SLOWER" and proc.returncode == 0


def test_max_rounds_equal_to_rounds_adds_no_look(repo, tmp_path, clean):
    proc = bench(repo, clean, "ab", "main", "slow", "suites/tiny.yaml", "--rounds", "5", "--max-rounds", "5",
                 "--block-ms", "1", "--impl", "dense", "--out", str(tmp_path / "results"), "--json")
    doc = json.loads(proc.stdout)
    (pair,) = doc["pairs"]
    assert doc["settings"]["looks"] == [5] and pair["time"]["looks"] == 1
    assert pair["verdict"] != "SLOWER" and proc.returncode == 0  # one trial cannot show a change repeats


@pytest.mark.parametrize(("base", "new", "message"), [
    ("main", "no-such-branch", "NEW: unknown revision 'no-such-branch'"),
    ("nosuite", "main", "BASE nosuite"),
])
def test_bad_revisions_exit_2_before_measuring(repo, tmp_path, clean, capsys, monkeypatch, base, new, message):
    code, err = bench_here(capsys, monkeypatch, repo, clean, "ab", base, new, "suites/tiny.yaml", *FAST, "--out",
                           str(tmp_path / "results"))
    assert code == 2 and message in err, err
    if base == "nosuite":
        assert "no suite file suites/tiny.yaml in that checkout" in err
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())  # no run started


def test_different_suite_names_exit_2(repo, tmp_path, clean, capsys, monkeypatch):
    code, err = bench_here(capsys, monkeypatch, repo, clean, "ab", "main", "renamed", "suites/tiny.yaml", *FAST,
                           "--out", str(tmp_path / "results"))
    assert code == 2 and "named 'tiny' in BASE and 'tiny2' in NEW" in err, err


def test_a_dirty_checked_out_commit_is_refused(repo, tmp_path, clean, capsys, monkeypatch):
    dense = repo / "impls" / "dense.py"
    original = dense.read_text()
    dense.write_text(original + "\n# an uncommitted change\n")
    try:
        code, err = bench_here(capsys, monkeypatch, repo, clean, "ab", "main", "HEAD", "suites/tiny.yaml", *FAST,
                               "--out", str(tmp_path / "results"))
        assert code == 2 and "uncommitted changes" in err and "impls/dense.py" in err, err
        assert "give the working tree itself as a directory" in err
    finally:
        dense.write_text(original)


@pytest.mark.parametrize(("args", "message"), [
    (["--rounds", "1"], "--rounds: got 1"),
    (["--threshold", "-3"], "--threshold: got -3"),
    (["--rounds", "10", "--max-rounds", "5"], "--max-rounds: got 5; at least --rounds (10)"),
    (["--budget-s", "-1"], "--budget-s: got -1"),
    (["--markdown", "/no/such/dir/x.md"], "--markdown"),
])
def test_bad_options_exit_2(repo, tmp_path, clean, capsys, monkeypatch, args, message):
    code, err = bench_here(capsys, monkeypatch, repo, clean, "ab", "main", "main", "suites/tiny.yaml", *args,
                           "--out", str(tmp_path / "results"))
    assert code == 2 and message in err, err


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_ab_leaves_no_worktree(repo, tmp_path, clean, sig):
    """Killed once its worktrees exist (SIGKILL: the janitor cleans up; SIGTERM: bench ab itself)."""
    out = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "bench", "ab", "main", "main", "suites/tiny.yaml", "--rounds",
                             "10000", "--out", str(out)], cwd=repo, env=env_for(clean), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while (listed := worktrees_while_changing(repo)) is None or len(listed) < 3:  # both worktrees made
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(sig)
        proc.wait(timeout=120)
        deadline = time.monotonic() + 120
        while (listed := worktrees_while_changing(repo)) is None or len(listed) > 1 or list(clean.iterdir()):
            assert time.monotonic() < deadline, listed
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    for run in out.glob("*/run.json"):  # a run it had opened says it did not finish
        assert json.loads(run.read_text())["finished_at"] is None
