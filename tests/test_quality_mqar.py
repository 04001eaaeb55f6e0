"""micro-mqar as a yardstick of sparse attention ([R4 2/6]): the oracle at full budget answers exactly as dense
attention does, a selector that cannot retrieve (a query block's own key block and the first) loses with
p < 0.01, the per-row oracle at 1/8 keeps every answer; each record carries the kernel's own measurement at the
model's attention shape beside the model's quality."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench.cli import main
from tests.conftest import PLUGINS, only_run_dir, read_jsonl, write_suite

SUITE = {"name": "mqar-check", "impls": ["sdpa", "blocked"], "plugins": [str(PLUGINS / "diag_and_first.py")],
         "defaults": {"model": "micro-mqar", "seq_len": 1024, "samples": 12, "pattern": "causal", "block_size": 64,
                      "device": "cpu"},
         "sweeps": [{"defaults": {"selector": "oracle_topk", "budget": 1.0}, "sweep": {}},
                    {"defaults": {"selector": "diag_and_first"}, "sweep": {}},
                    {"defaults": {"selector": "oracle_topk_rows", "budget": 0.125}, "sweep": {}}],
         "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "memory": "worker"}}


def test_micro_mqar_tells_retrieval_from_its_absence(tmp_path):
    suite = write_suite(tmp_path, SUITE)
    assert main(["run", str(suite), "--out", str(tmp_path / "r")]) == 0
    records = read_jsonl(only_run_dir(tmp_path / "r") / "records.jsonl")
    by = {(r["params"]["selector"], r["impl"]): r for r in records}
    assert len(by) == 6
    for r in records:
        q = r["quality"]
        assert r["status"] == "ok" and r["params"]["heads"] == 4 and r["params"]["kv_heads"] == 2
        assert r["params"]["head_dim"] == 64 and r["time_s"]["median"] > 0 and r["error"]["rel_l2"] is not None
        assert q["metric"] == "accuracy" and q["dense_value"] == 1.0 and q["samples"] == 12 and q["scored"] == 16
        assert len(q["values"]) == len(q["dense_values"]) == 12
    for impl in ("sdpa", "blocked"):
        full = by[("oracle_topk", impl)]["quality"]
        assert full["value"] == 1.0 and full["p_value"] == 1.0 and full["kl_mean"] < 1e-9  # dense, exactly
        blind = by[("diag_and_first", impl)]["quality"]
        assert blind["value"] < 0.5 and blind["p_value"] < 0.01 and blind["delta"] < -0.5, blind
        rows = by[("oracle_topk_rows", impl)]["quality"]
        assert rows["value"] == 1.0 and rows["kl_mean"] < 1e-3, rows


def test_training_against_dense_from_the_same_weights_and_batches(tmp_path):
    suite = write_suite(tmp_path, {
        "name": "train-check", "impls": ["sdpa", "flex"],
        "defaults": {"model": "micro-mqar", "seq_len": 128, "samples": 2, "block_size": 32, "device": "cpu",
                     "train": {"steps": 4, "lr": 0.001}},
        "sweeps": [{"defaults": {"pattern": "causal", "selector": "oracle_topk", "budget": 1.0}, "sweep": {}},
                   {"defaults": {"pattern": "causal_local", "window": 16}, "sweep": {}}],
        "measure": {"warmup": 0, "repeat": 1, "max_time_s": 0.01, "memory": "worker"}})
    assert main(["run", str(suite), "--out", str(tmp_path / "r")]) == 0
    by = {(r["params"]["pattern"], r["impl"]): r for r in read_jsonl(only_run_dir(tmp_path / "r") / "records.jsonl")}
    exact = by[("causal", "sdpa")]["training"]
    assert exact["steps"] == 4 and len(exact["curve"]) == len(exact["curve_dense"]) == 4
    assert exact["curve"] == pytest.approx(exact["curve_dense"], abs=1e-6) and abs(exact["delta"]) < 1e-6
    window = by[("causal_local", "sdpa")]["training"]
    assert window["loss"] > window["loss_dense"] + 1.0  # a 16-token window cannot reach the answers' keys
    assert "no backward on CPU" in by[("causal_local", "flex")]["training"]["error"]
