"""submit.json is a model (an old or broken file is named, exit 2), and a job whose state cannot be read (squeue
failed) is asked again and reported, never counted as ended."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from rich.console import Console

from bench.cli import main
from bench.errors import BadInput
from bench.run.cluster import executors, submit
from bench.run.cluster.executors import SlurmExecutor, State
from bench.run.cluster.plan import ShardJob, SubmitPlan, read_plan
from tests.conftest import write_suite

SUITE = {"name": "planned", "impls": ["dense"], "defaults": {"heads": 2, "head_dim": 16, "seq_len": 64,
                                                              "device": "cpu"},
         "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "memory": "worker"}}


def _fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: str) -> None:
    """sbatch and squeue stand-ins on PATH: squeue runs the given shell body."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", "echo 1"), ("squeue", squeue)):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


@pytest.mark.parametrize(("squeue", "kind"), [
    ('echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1', "unknown"),
    ('echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1', "ended"),
    ("echo RUNNING", "running"),
    ("exit 0", "ended"),  # no longer in the queue
])
def test_squeue_failing_is_unknown_not_ended(tmp_path, monkeypatch, squeue, kind):
    _fake_slurm(tmp_path, monkeypatch, squeue)
    state = SlurmExecutor(None, 0, None).state(ShardJob(id="7_0", started_at="now"))
    assert state.kind == kind
    if kind == "unknown":
        assert "Unable to contact slurm controller" in str(state.why)


class Flaky:
    """An executor whose job's state cannot be read for `unknown` polls, then has ended."""

    def __init__(self, unknown: int) -> None:
        self.left, self.polls = unknown, 0

    def state(self, job: ShardJob) -> State:
        self.polls += 1
        if self.left:
            self.left -= 1
            return State("unknown", "squeue failed (exit 1): Unable to contact slurm controller")
        return State("ended")


def test_the_watcher_waits_through_unknown_states_and_reports_them(tmp_path, monkeypatch):
    suite = write_suite(tmp_path, SUITE)
    out = tmp_path / "r"
    assert main(["run", str(suite), "--shard", "0/1", "--run-id", "planned-1", "--out", str(out)]) == 0
    run_dir = out / "planned-1"
    SubmitPlan(suite_file=str(suite), executor="slurm", shards=1, out=str(out), run_id="planned-1",
               jobs={"0": [ShardJob(id="7_0", started_at="now")]}, submitted_at="now").write(run_dir)
    flaky = Flaky(unknown=4)
    monkeypatch.setattr(executors, "make", lambda *a, **k: flaky)
    console = Console(record=True, width=200)
    assert submit.watch(run_dir, console, sleep=lambda s: None) == 0
    text = console.export_text()
    assert flaky.polls == 5  # four unknown polls waited through, then ended with every pair held
    assert "could not be read 3 times in a row (squeue failed (exit 1): Unable to contact" in text, text
    assert "1 unknown" in text and "1 done" in text


def test_an_old_or_broken_submit_json_is_named_with_its_field(tmp_path):
    (tmp_path / "submit.json").write_text(json.dumps({"suite_file": "s.yaml", "executor": "local", "shards": 1,
                                                      "out": "r", "jobs": {}, "submitted_at": "now"}))
    with pytest.raises(BadInput, match=r"submit.json: --attach: run_id: Field required; this submit.json is not"):
        read_plan(tmp_path)
    (tmp_path / "submit.json").write_text("{")
    with pytest.raises(BadInput, match="not valid JSON"):
        read_plan(tmp_path)
    # a local run's file from before the model (job ids were pids as numbers) still reads
    (tmp_path / "submit.json").write_text(json.dumps({
        "suite_file": "s.yaml", "executor": "local", "shards": 1, "rank_groups": [], "nodes_per_rank_group": 1,
        "impls": [], "out": "r", "run_id": "x", "settings": {}, "submitted_at": "now",
        "jobs": {"0": [{"id": 4242, "host": "h", "log": "l", "started_at": "now"}]}}))
    assert read_plan(tmp_path).jobs["0"][0].id == "4242"


def test_attach_to_a_broken_submit_json_exits_2(tmp_path, capsys):
    (tmp_path / "submit.json").write_text(json.dumps({"executor": "pbs"}))
    assert main(["submit", "--attach", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "submit.json" in err and "Traceback" not in err, err
