"""Custom patterns through `bench run`: a predicate class and attention-gym mask_mods from a suite's plugin run on
every single-process implementation, forward and (where there is a backward) forward+backward, every record
ok against the oracle; `bench list patterns` shows where each pattern comes from."""

from __future__ import annotations

import shutil

import pytest

from bench import registry
from tests.conftest import ROOT, only_run_dir, read_jsonl, run_bench, write_suite

pytest.importorskip("attn_gym.masks", reason="attention-gym is an optional extra (pip install attn-gym)")

SINGLE_PROCESS = [name for name in registry.names() if not registry.get(name).distributed]


def _suite(tmp_path):
    shutil.copy(ROOT / "suites" / "plugins" / "attn_gym_masks.py", tmp_path / "attn_gym_masks.py")
    return write_suite(tmp_path, {
        "name": "custom", "plugins": ["attn_gym_masks.py"], "impls": SINGLE_PROCESS,
        "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 16, "seq_len": 144, "block_size": 16, "window": 17,
                     "device": "cpu"},
        "sweeps": [
            {"sweep": {"pattern": ["checker", "agym_sliding_window"], "mode": ["fwd", "fwd_bwd"]}},
            {"defaults": {"pattern": "agym_natten", "window": 5, "image_width": 12}, "sweep": {}},
            {"defaults": {"pattern": "checker", "documents": [50, 94], "q_len": 70}, "sweep": {}},
        ],
        # memory in the worker: a fresh process per pair would compile flex and build Triton's kernels again
        "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "timeout_s": 300, "memory": "worker"}})


def test_plugin_patterns_run_on_every_single_process_implementation(tmp_path):
    proc = run_bench("run", str(_suite(tmp_path)), "--out", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    assert {r["impl"] for r in records} == set(SINGLE_PROCESS)
    for r in records:
        label = (r["impl"], r["case_id"])
        if r["params"]["mode"] == "fwd_bwd" and not registry.get(r["impl"]).fwd_bwd:
            assert r["status"] == "skipped", label
            continue
        if r["impl"] == "flex" and r["params"]["mode"] == "fwd_bwd":  # FlexAttention has no CPU backward
            assert r["status"] == "skipped" and "no backward on CPU" in r["reason"], label
            continue
        assert r["status"] == "ok", (label, r["reason"])
        assert r["error"]["rel_l2"] <= r["error"]["tolerance"], label
        if r["params"]["mode"] == "fwd_bwd":
            assert set(r["error"]["grads"]) == {"dq", "dk", "dv"}, label


def test_list_patterns_names_the_plugin(tmp_path):
    suite = _suite(tmp_path)
    proc = run_bench("list", "patterns", "--suite", str(suite), env={"COLUMNS": "250"})
    assert proc.returncode == 0, proc.stderr
    lines = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.count("│") > 3}
    assert "plugin attn_gym_masks.py" in lines["agym_natten"] and "plugin attn_gym_masks.py" in lines["checker"]
    assert "built-in" in lines["causal"]
