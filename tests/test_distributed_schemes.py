"""What the distributed schemes promise apart from a run: their closed forms compared, the cases each cannot split (and
why), faulty ranks that fail cleanly and leave no process, and the distributed suites loading."""

from __future__ import annotations

import math
import os
import time

import pytest

from tests.conftest import ROOT, only_run_dir, read_jsonl, run_bench, write_suite


def test_closed_forms_compare_the_schemes():
    """The closed forms themselves: cp_sparse against cp_ring for a local window, tp_heads' blindness, Ulysses'
    (P-1)/P against the ring's P-1, zigzag's cost for cp_sparse, USP's two levels adding up."""
    from bench import registry
    from bench.spec.case import Case

    ring, sparse, tp, ulysses, usp = (registry.get(n) for n in ("cp_ring", "cp_sparse", "tp_heads", "cp_ulysses",
                                                                "cp_usp"))
    for p in (2, 4, 8):
        case = Case(heads=8, seq_len=4096, window=128, block_size=64, world_size=p, device="cpu")
        ratio = sparse.expected_comm_bytes(case) / ring.expected_comm_bytes(case)
        assert ratio == 2 * (p - 1) * 64 / ((p - 1) * 4096)  # halo of one 64-block per side vs all of K/V
        zigzag = Case(heads=8, seq_len=4096, window=128, block_size=64, world_size=p, device="cpu", cp_layout="zigzag")
        assert sparse.expected_comm_bytes(zigzag) == 2 * sparse.expected_comm_bytes(case)  # twice the boundaries
        assert ring.expected_comm_bytes(zigzag) == ring.expected_comm_bytes(case)
        dense_case = Case(heads=8, seq_len=4096, pattern="block_random", density=0.5, world_size=p, device="cpu")
        assert tp.expected_comm_bytes(case) == tp.expected_comm_bytes(dense_case)
        # MHA: Ulysses moves 4 tensors x (P-1)/P, the ring 2 tensors x (P-1): a ratio of 2/P
        assert ulysses.expected_comm_bytes(case) / ring.expected_comm_bytes(case) == pytest.approx(2 / p)
        gqa = Case(heads=8, kv_heads=1, seq_len=4096, world_size=p, device="cpu")  # KV heads repeated to P
        assert ulysses.expected_comm_bytes(gqa) == (p - 1) * 4096 * (2 * 8 + 2 * p) * 64 * 4 // p
        levels = usp.expected_comm_bytes_by_level(case)
        assert sum(levels.values()) == usp.expected_comm_bytes(case)
        u = {2: 1, 4: 2, 8: 4}[p]  # the default: the largest proper divisor
        assert levels == {"ulysses": 0 if u == 1 else (u - 1) * 4096 * 4 * 8 * 64 * 4 // u,
                          "ring": (p // u - 1) * 4096 * 2 * 8 * 64 * 4}
    assert math.isclose(ring.expected_comm_bytes(Case(heads=8, world_size=4, mode="fwd_bwd")),
                        3 * 1024 * 2 * 8 * 64 * 4 * 2 + 4 * 1024 * 2 * 8 * 64 * 4)

def test_what_a_scheme_cannot_split_says_why():
    from bench import registry
    from bench.spec.case import Case

    ulysses, usp, ring = registry.get("cp_ulysses"), registry.get("cp_usp"), registry.get("cp_ring")
    assert "kv_heads 3 must divide by 4 (each rank its KV heads) or divide 4" in ulysses.unsupported(
        Case(heads=12, kv_heads=3, world_size=4, device="cpu"))
    assert "heads 6 is not divisible by 4" in ulysses.unsupported(Case(heads=6, kv_heads=6, world_size=4,
                                                                       device="cpu"))
    assert ulysses.unsupported(Case(heads=8, kv_heads=2, world_size=4, device="cpu")) is None  # repeated KV heads
    assert "over ulysses_degree 4" in usp.unsupported(Case(heads=6, world_size=8, ulysses_degree=4, device="cpu"))
    assert "not divisible by 16" in ring.unsupported(Case(seq_len=1000, world_size=8, cp_layout="zigzag",
                                                          device="cpu"))
    assert "ulysses_degree applies to cp_usp" in ring.unsupported(Case(world_size=4, ulysses_degree=2, device="cpu"))
    assert "q_len 64 < seq_len 1024 (decode, chunked prefill) is not supported" in ulysses.unsupported(
        Case(world_size=4, q_len=64, device="cpu"))

def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" in f.read()
    except OSError:
        return True

def test_faulty_ranks_give_failed_records_and_leave_no_process(tmp_path):
    plugin = tmp_path / "faulty_distributed.py"
    plugin.write_text((ROOT / "tests" / "plugins" / "faulty_distributed.py").read_text())
    pids = tmp_path / "pids"
    pids.mkdir()
    timeout_s = 10
    suite = write_suite(tmp_path, {
        "name": "faults", "plugins": ["faulty_distributed.py"],
        "impls": ["fault_rank_raise", "fault_rank_hang", "fault_rank_kill", "cp_sparse", "dense"],
        "defaults": {"heads": 4, "head_dim": 16, "seq_len": 64, "pattern": "block_random", "density": 0.3,
                     "block_size": 16, "mode": "fwd_bwd", "device": "cpu"},
        "sweeps": [{"sweep": {"world_size": [2]}}, {"defaults": {"mode": "fwd"}, "sweep": {"world_size": [9]}}],
        "measure": {"warmup": 1, "repeat": 3, "max_time_s": 0.05, "timeout_s": timeout_s}})
    start = time.monotonic()
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"), env={"BENCH_TEST_PID_DIR": str(pids)})
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout + proc.stderr
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    two = {r["impl"]: r for r in records if r["params"]["world_size"] == 2}

    assert two["fault_rank_raise"]["status"] == "failed"
    assert two["fault_rank_raise"]["reason"] == "rank 1: RuntimeError during first call: planted failure on rank 1"
    assert "planted failure on rank 1" in two["fault_rank_raise"]["details"]
    hang = two["fault_rank_hang"]
    assert hang["status"] == "failed"
    assert hang["reason"] == (f"timed out after {timeout_s} s: rank 1 during prepare (rank 0 waiting in first "
                              "call); all 2 ranks killed")
    assert timeout_s <= hang["wall_s"] < timeout_s + 60  # the clock starts once every rank has imported
    assert two["fault_rank_kill"]["reason"] == "rank 1 died during first call (killed by SIGKILL); all 2 ranks killed"
    # the kinds a worker gives the same failures, not `error` for all
    assert [two[name]["failure"] for name in ("fault_rank_raise", "fault_rank_hang", "fault_rank_kill")] == [
        "error", "timeout", "died"]

    healthy = two["cp_sparse"]  # the sweep went on
    assert healthy["status"] == "ok", healthy
    assert healthy["comm"]["bytes_total"] == healthy["comm"]["expected_bytes"] > 0
    assert set(healthy["error"]["grads"]) == {"dq", "dk", "dv"}
    assert two["dense"]["status"] == "skipped"
    nine = [r for r in records if r["params"]["world_size"] == 9]
    assert len(nine) == 5 and all(r["status"] == "skipped" and r["reason"] == "CPU runs allow up to 8 ranks "
                                  "sharing the cores; got world_size 9" for r in nine)

    # Every rank that reached prepare left its pid (rank 0 may be killed before it gets there).
    started = {f.name.rsplit("-", 1)[0]: int(f.name.rsplit("-", 1)[1]) for f in pids.iterdir()}
    assert {f"{name}-rank1" for name in ("fault_rank_raise", "fault_rank_hang", "fault_rank_kill")} <= set(started)
    assert all(_gone(pid) for pid in started.values()), "a rank process outlived its pair"
    assert elapsed < 600

@pytest.mark.parametrize("name, impls, worlds, pairs", [
    ("seed000_comm", ["cp_sparse", "cp_ring", "cp_allgather", "cp_ulysses", "cp_usp", "tp_heads"], {2, 4, 8}, None),
    ("multi_gpu", ["tp_heads", "cp_ring", "cp_allgather", "cp_sparse"], {1, 2, 4, 8}, 160)])
def test_distributed_suites_load(name, impls, worlds, pairs):
    from bench.spec.suite import load_suite

    suite = load_suite(ROOT / "suites" / f"{name}.yaml")
    assert suite.impls == impls
    assert {c.world_size for c in suite.cases} == worlds
    if pairs is not None:
        assert len(suite.cases) * len(suite.impls) == pairs
    assert all(c.heads % c.world_size == 0 and c.seq_len % c.world_size == 0 for c in suite.cases)
