"""Fixed selectors: the brief's `diag_and_first`, registered as written there, runs without a budget and its case
id carries none; one registered with takes=None refuses a budget at load (exit 2, naming it)."""

from __future__ import annotations

from bench.cli import main
from tests.conftest import PLUGINS, only_run_dir, read_jsonl, write_suite

SUITE = {"name": "fixed", "impls": ["dense", "blocked"], "plugins": [str(PLUGINS / "diag_and_first.py")],
         "defaults": {"heads": 2, "head_dim": 16, "seq_len": 256, "block_size": 64, "pattern": "causal",
                      "device": "cpu"},
         "sweep": {"selector": ["diag_and_first", "fixed_first"]},
         "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "timeout_s": 120, "memory": "worker"}}


def test_a_selector_registered_without_takes_runs_with_no_budget_and_no_budget_in_its_id(tmp_path):
    suite = write_suite(tmp_path, SUITE)
    assert main(["run", str(suite), "--out", str(tmp_path / "r")]) == 0
    records = read_jsonl(only_run_dir(tmp_path / "r") / "records.jsonl")
    assert {(r["impl"], r["params"]["selector"], r["status"]) for r in records} == {
        (i, s, "ok") for i in ("dense", "blocked") for s in ("diag_and_first", "fixed_first")}
    for r in records:
        assert f"-{r['params']['selector']}-" in r["case_id"] and "-k" not in r["case_id"].split("d16")[1], r
        assert r["selection"]["budget"] is None and r["selection"]["units_mean"] <= 2
        assert r["fidelity"]["recall"]["mean"] < 1  # it keeps two blocks of a causal row's up to four


def test_a_fixed_selector_refuses_a_budget_at_load(tmp_path, capsys):
    suite = write_suite(tmp_path, {**SUITE, "defaults": {**SUITE["defaults"], "budget": 2},
                                   "sweep": {"selector": ["fixed_first"]}})
    assert main(["run", str(suite), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "budget" in err and "fixed_first is fixed (registered with takes=None)" in err, err
    assert not (tmp_path / "r").exists()
