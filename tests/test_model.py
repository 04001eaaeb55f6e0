"""`bench model`: roofline lower bounds for cards that are not here, marked as models everywhere."""

from __future__ import annotations

import pytest
import torch

from bench.analysis.model import BOUNDS, block_pairs, bound, min_bytes, model_records
from bench.cli import main
from bench.measure.machine.hardware import resolve
from bench.results.store import load_run
from bench.spec.case import Case
from tests.conftest import only_run_dir, run_bench, write_suite
from tests.pattern_zoo import BUILTIN, valid_fields

FIELDS = {"window": 16, "density": 0.3, "block_size": 16, "dilation": 2, "global_tokens": 3}


def test_min_bytes_are_the_inputs_and_outputs():
    case = Case(batch=2, heads=3, seq_len=50, head_dim=8, dtype="float16")
    assert min_bytes(case) == 4 * 2 * 3 * 50 * 8 * 2
    assert min_bytes(Case(**{**case.params(), "mode": "fwd_bwd"})) == 12 * 2 * 3 * 50 * 8 * 2


def test_block_pairs_count_short_edge_blocks():
    assert block_pairs(torch.ones(4, 4, dtype=torch.bool), 100, 32) == 100 * 100
    assert block_pairs(torch.eye(4, dtype=torch.bool), 100, 32) == 3 * 32 * 32 + 4 * 4


@pytest.mark.parametrize("name", BUILTIN)
def test_block_pairs_equal_the_expanded_layout_and_bounds_are_ordered(name):
    n, bs = 96, 16  # 96 = 6 rows of 16 for axial
    case = Case(seq_len=n, pattern=name, **valid_fields(name, n, **FIELDS))
    pattern = case.make_pattern()
    layout = pattern.block_layout(bs)
    expanded = layout.repeat_interleave(bs, 0).repeat_interleave(bs, 1)[:n, :n]
    assert block_pairs(layout, n, bs) == int(expanded.sum())
    assert pattern.nnz <= block_pairs(layout, n, bs) <= n * n  # blocks hold every allowed pair
    times = [r.time_s.median for r in model_records(case, case.case_id, resolve("h100"))]
    assert times[0] >= times[1] >= times[2] > 0  # dense >= block >= sparse


def test_large_cases_are_compute_bound_small_ones_memory_bound():
    spec = resolve("h100")
    big = Case(batch=4, heads=16, seq_len=8192, head_dim=128, dtype="bfloat16", pattern="dense")
    b = bound(big, big.seq_len**2, spec)
    assert b["bound_by"] == "compute" and b["unit"] == "bf16 tensor"
    assert b["time_s"] == pytest.approx(4 * 4 * 16 * 8192**2 * 128 / 989.4e12)
    small = Case(heads=2, seq_len=128, head_dim=32)
    s = bound(small, 128 * 128, spec)
    assert s["bound_by"] == "memory" and s["unit"] == "tf32 tensor"
    assert s["time_s"] == pytest.approx(4 * 2 * 128 * 32 * 4 / 3.35e12)


def test_records_are_unmistakably_models():
    spec = resolve("rtx4090")
    case = Case(heads=4, seq_len=1024, head_dim=64, dtype="bfloat16", pattern="local", window=128)
    records = model_records(case, case.case_id, spec)
    assert [r.impl for r in records] == list(BOUNDS)
    for r in records:
        assert r.source == "modelled" and r.status == "ok"
        assert r.device == "model: NVIDIA GeForce RTX 4090 (datasheet figures; not a measurement)"
        assert r.time_s.n == 0 and r.time_s.samples == [] and r.time_s.stopped_by == "model"
        assert r.setup_s is None and r.error is None and r.memory.method == "model"
        assert r.peak.source == "datasheet" and r.peak.hardware == "rtx4090 bf16 tensor"
        assert r.flops == 4 * 4 * case.make_pattern().nnz * 64


def test_cases_that_cannot_be_modelled_say_why():
    spec = resolve("rtx4090")
    huge = Case(batch=64, heads=64, seq_len=65536, head_dim=128, dtype="bfloat16")
    for r in model_records(huge, huge.case_id, spec):
        assert r.status == "skipped" and r.time_s is None
        assert r.reason == "memory model: inputs and outputs alone need 256 GiB; rtx4090 has 24 GiB"
        assert r.memory.peak_bytes == 256 * 2**30
    dist = Case(heads=4, world_size=2)
    assert {r.reason for r in model_records(dist, dist.case_id, spec)} == {
        "world_size > 1: communication is not modelled"}


def test_bench_model_writes_a_modelled_run(tmp_path, capsys):
    suite = write_suite(tmp_path, {"name": "m", "impls": ["dense"], "defaults": {"heads": 2, "head_dim": 16},
                                   "sweep": {"seq_len": [64, 128], "pattern": ["local", "causal"]}})
    assert main(["model", str(suite), "--gpu", "a100", "--out", str(tmp_path / "results")]) == 0
    out = capsys.readouterr().out
    assert "lower bounds on NVIDIA A100-SXM4-80GB (model, not a measurement)" in out
    run_dir = only_run_dir(tmp_path / "results")
    assert "-model-a100_80gb-m" in run_dir.name
    run = load_run(run_dir)  # validates run.json and every record against the schema
    assert run.info.source == "modelled" and run.info.finished_at is not None
    assert run.info.env.backend == "model" and run.info.env.modelled_hardware["key"] == "a100_80gb"
    assert len(run.records) == 4 * 3
    assert all(r.source == "modelled" and "model" in r.device and "A100" in r.device for r in run.records)


def test_bench_model_rejects_unknown_gpus_and_modelled_runs_cannot_be_resumed(tmp_path):
    suite = write_suite(tmp_path, {"name": "m", "impls": ["dense"], "sweep": {"seq_len": [64]}})
    proc = run_bench("model", str(suite), "--gpu", "v100")
    assert proc.returncode == 2 and "invalid choice: 'v100'" in proc.stderr
    assert main(["model", str(suite), "--gpu", "h200", "--out", str(tmp_path / "r")]) == 0
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "r"), "--resume", str(only_run_dir(tmp_path / "r")))
    assert proc.returncode == 2
    assert "a modelled run (bench model); only measured runs can be resumed" in proc.stderr
