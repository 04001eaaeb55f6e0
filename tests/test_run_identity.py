"""A run's identity (bench.run.identity): `--resume` and `--shard` add records only to a run of the same suite,
commit, tree and machine, refusing any other with exit 2 naming what differs and losing nothing; records carry
`git`; `--run-id` takes any safe name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.cli import main
from bench.errors import BadInput
from bench.measure.machine.env import capture, git_info
from bench.results.records import RunInfo
from bench.run.identity import check_run_id, differences
from bench.spec.suite import load_suite
from tests.conftest import read_jsonl, write_suite

SUITE = {"name": "ident", "impls": ["dense"], "defaults": {"heads": 2, "head_dim": 16, "seq_len": 64, "device": "cpu"},
         "sweep": {"pattern": ["local", "causal"]},
         "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "timeout_s": 60, "memory": "worker"}}


def _edit_run_json(run_dir: Path, **git: object) -> None:
    """Make the stored run claim other code (as if another checkout had made it)."""
    path = run_dir / "run.json"
    info = json.loads(path.read_text())
    info["env"]["git"].update(git)
    path.write_text(json.dumps(info))


def _first_pair_only(run_dir: Path) -> None:
    records = run_dir / "records.jsonl"
    records.write_text(records.read_text().splitlines()[0] + "\n")


def test_records_carry_the_code_that_measured_them_and_a_named_run_keeps_its_name(tmp_path):
    suite = write_suite(tmp_path, SUITE)
    assert main(["run", str(suite), "--out", str(tmp_path / "r"), "--run-id", "nightly-42"]) == 0
    run_dir = tmp_path / "r" / "nightly-42"
    here = git_info()
    records = read_jsonl(run_dir / "records.jsonl")
    assert len(records) == 2
    assert all(r["git"] == {"commit": here.commit, "dirty": here.dirty} for r in records)
    info = RunInfo.model_validate_json((run_dir / "run.json").read_text())
    assert info.run_id == "nightly-42" and info.env.git.commit == here.commit  # the commit is in run.json
    # the same name again is not a silent join: that is --resume's job
    assert main(["run", str(suite), "--out", str(tmp_path / "r"), "--run-id", "nightly-42"]) == 2


@pytest.mark.parametrize(("git", "named"), [
    ({"commit": "0" * 40, "dirty": False}, "the run has commit 000000000000 (clean)"),
    ({"dirty": True, "diff_sha256": "f" * 64}, "dirty, diff ffffffffffff"),
])
def test_resume_refuses_a_run_of_other_code_naming_it_and_keeps_its_records(tmp_path, capsys, git, named):
    suite = write_suite(tmp_path, SUITE)
    assert main(["run", str(suite), "--out", str(tmp_path / "r"), "--run-id", "first"]) == 0
    run_dir = tmp_path / "r" / "first"
    _first_pair_only(run_dir)
    here = git_info()
    if git.get("dirty") and here.dirty and here.diff_sha256 == git.get("diff_sha256"):
        pytest.skip("this tree's diff happens to be the planted one")
    _edit_run_json(run_dir, **git)
    before = (run_dir / "records.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["run", str(suite), "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "code:" in err and named in err and "Traceback" not in err, err
    assert (run_dir / "records.jsonl").read_bytes() == before


def test_a_shard_refuses_to_join_a_run_made_on_another_machine(tmp_path, capsys):
    suite = write_suite(tmp_path, SUITE)
    out = tmp_path / "r"
    assert main(["run", str(suite), "--shard", "0/2", "--run-id", "split", "--out", str(out)]) == 0
    path = out / "split" / "run.json"
    info = json.loads(path.read_text())
    info["env"]["cpu"]["model"] = "Another CPU 9000"
    path.write_text(json.dumps(info))
    part = out / "split" / "records.0of2.jsonl"
    before = part.read_bytes()
    capsys.readouterr()
    assert main(["run", str(suite), "--shard", "1/2", "--run-id", "split", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "machine: cpu.model: Another CPU 9000 ->" in err, err
    assert part.read_bytes() == before and not (out / "split" / "records.1of2.jsonl").exists()


def test_the_same_identity_is_no_difference_and_each_field_is_named(tmp_path):
    suite_path = write_suite(tmp_path, SUITE)
    suite = load_suite(suite_path)
    assert main(["run", str(suite_path), "--out", str(tmp_path / "r"), "--run-id", "one"]) == 0
    info = RunInfo.model_validate_json((tmp_path / "r" / "one" / "run.json").read_text())
    here = capture(backend="cpu")
    assert differences(info, suite, here) == []
    other = load_suite(write_suite(tmp_path, {**SUITE, "sweep": {"pattern": ["dense"]}}, "other.yaml"))
    assert [d.split(":")[0] for d in differences(info, other, here)] == ["suite"]


@pytest.mark.parametrize("name", ["nightly-42", "a.b_c-D", "x" * 100])
def test_safe_run_names_are_taken(name):
    assert check_run_id(name) == name


@pytest.mark.parametrize("name", ["", "a/b", "..", ".hidden", "x" * 101, "calibration", "with space"])
def test_unsafe_run_names_are_refused_with_what_is_allowed(name):
    with pytest.raises(BadInput, match=re.escape("letters, digits, '.', '_' or '-'")):
        check_run_id(name)


PLUGIN = '''
from bench.registry import Impl, register
from impls.dense import Dense


@register
class MyKernel(Dense):
    name = "my_identity_kernel"
'''


def test_editing_a_plugin_between_a_run_and_its_resume_is_refused_naming_the_file(tmp_path, capsys):
    plugin = tmp_path / "my_kernel.py"
    plugin.write_text(PLUGIN)
    suite = write_suite(tmp_path, {**SUITE, "impls": ["my_identity_kernel"], "plugins": ["my_kernel.py"]})
    assert main(["run", str(suite), "--out", str(tmp_path / "r"), "--run-id", "first"]) == 0
    run_dir = tmp_path / "r" / "first"
    records = read_jsonl(run_dir / "records.jsonl")
    assert all(list(r["code"]) == [str(plugin)] for r in records)  # the plugin's digest on every record
    _first_pair_only(run_dir)
    before = (run_dir / "records.jsonl").read_bytes()
    plugin.write_text(PLUGIN + "\n# a faster kernel, the author thinks\n")
    capsys.readouterr()
    assert main(["run", str(suite), "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"code: {plugin} changed (sha256" in " ".join(err.split()), err
    assert (run_dir / "records.jsonl").read_bytes() == before


def test_results_and_dashboards_do_not_make_a_tree_dirty(tmp_path):
    import subprocess

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    for name in ("results/run/records.jsonl", "dashboards/index.html", "bench.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("first\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    (tmp_path / "results/run/records.jsonl").write_text("more\n")
    (tmp_path / "dashboards/index.html").write_text("re-rendered\n")
    assert git_info(tmp_path).dirty is False
    (tmp_path / "bench.py").write_text("changed\n")
    assert git_info(tmp_path).dirty is True


def test_an_installed_bench_reports_its_version_not_the_commit_of_the_directory_it_runs_in(tmp_path, monkeypatch):
    from bench.measure.machine import env

    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    monkeypatch.setattr(env, "PROJECT_ROOT", tmp_path / "site-packages")  # no checkout around the code
    info = env.git_info()
    assert info.commit is None and info.dirty is None
    assert info.version == env._installed_version()
