"""`bench run` with world_size > 1: bytes in closed form, outputs and gradients against the oracle, faults.

- Under torchrun (`python -m torch.distributed.run`, which is what the `torchrun` script runs) with 2 and 4
  CPU ranks: every distributed implementation on local, causal_local, block_random and longformer, fwd and
  fwd_bwd. Each record must be ok (output and dq, dk, dv within tolerance of the float64 oracle), and its
  counted bytes must equal the implementation's expected_comm_bytes and the closed form written here.
- Without a launcher, the runner starts the ranks itself: a rank that raises, hangs or dies gives a failed
  record naming it, no rank process survives, and the sweep goes on to a healthy pair.
"""

from __future__ import annotations

import math
import os
import sys
import time
from functools import cache

import pytest

from bench.patterns import make_pattern
from tests.conftest import ROOT, only_run_dir, read_jsonl, run_bench, write_suite

B, H, D, N, BS, E = 1, 4, 16, 128, 16, 4  # batch, heads, head_dim, seq_len, block_size, bytes per float32
KV_ROW = 2 * B * H * D * E  # one position of K and V
PATTERNS = {"local": {"window": 16}, "causal_local": {"window": 24},
            "block_random": {"density": 0.3, "block_size": BS, "seed": 5},
            "longformer": {"window": 16, "global_tokens": 4}}
IMPLS = ["tp_heads", "cp_ring", "cp_allgather", "cp_sparse"]


def fetched_rows_by_rank(pattern: str, p: int, **structure) -> list[int]:
    """cp_sparse, derived from the dense mask: per rank, the positions of other ranks' key blocks (of BS)
    that hold any pair allowed to one of its queries."""
    mask = make_pattern(pattern, N, **PATTERNS[pattern], **structure).dense_mask()
    c = N // p
    rows = []
    for r in range(p):
        blocks = mask[r * c : (r + 1) * c].reshape(c, N // BS, BS).any(dim=2).any(dim=0)  # key blocks needed
        own = set(range(r * c // BS, (r + 1) * c // BS))
        rows.append(BS * sum(1 for b in range(N // BS) if blocks[b] and b not in own))
    return rows


def closed_form(impl: str, pattern: str, p: int, mode: str) -> int:
    """Total bytes all ranks send per step, written out per implementation."""
    c = N // p
    if impl == "tp_heads":  # ring all-reduce of S = B N H D e: 2 (P-1) S; backward dq, dk, dv: 2 (P-1) 3S
        s = B * N * H * D * E
        return 2 * (p - 1) * s * (1 if mode == "fwd" else 4)
    if impl in ("cp_ring", "cp_allgather"):  # every chunk reaches P-1 other ranks; backward moves as much
        forward = p * (p - 1) * c * KV_ROW
    elif pattern == "local":  # a halo of ceil((W//2)/bs) blocks on each side of each of the P-1 boundaries
        forward = 2 * (p - 1) * math.ceil(16 // 2 / BS) * BS * KV_ROW
    elif pattern == "causal_local":  # the left halo only: ceil((W-1)/bs) blocks
        forward = (p - 1) * math.ceil((24 - 1) / BS) * BS * KV_ROW
    elif pattern == "longformer":  # rank 0's global queries need every key; the others: halo + global block
        halo = math.ceil(16 // 2 / BS) * BS
        forward = ((p - 1) * c + (p - 1) * (halo + BS) + (p - 2) * halo) * KV_ROW
    else:  # block_random: the kept blocks, counted from the dense mask
        forward = sum(fetched_rows_by_rank(pattern, p)) * KV_ROW
    return forward * (1 if mode == "fwd" else 2)


def expected_ops(impl: str, p: int, mode: str) -> dict[str, int]:
    """Op -> calls per step."""
    bwd = mode == "fwd_bwd"
    return {"tp_heads": {"all_reduce": 2 if bwd else 1},
            "cp_ring": {"batch_isend_irecv": (p - 1) * (2 if bwd else 1)},
            "cp_allgather": {"all_gather_into_tensor": 1, **({"reduce_scatter_tensor": 1} if bwd else {})},
            "cp_sparse": {"all_to_all_single": 2 if bwd else 1}}[impl]


def suite_for(world: int) -> dict:
    sweeps = [{"defaults": {"pattern": name, **fields}, "sweep": {"mode": ["fwd", "fwd_bwd"]}}
              for name, fields in PATTERNS.items()]
    impls = list(IMPLS)
    if world == 2:  # also: a world_size-1 pair (the leader's worker) and a pair needing more ranks (a skip)
        sweeps.append({"defaults": {"pattern": "local", "window": 16, "world_size": 1}, "sweep": {}})
        sweeps.append({"defaults": {"pattern": "local", "window": 16, "world_size": 4}, "sweep": {}})
        impls.append("dense")
    return {"name": f"torchrun{world}", "impls": impls,
            "defaults": {"batch": B, "heads": H, "head_dim": D, "seq_len": N, "block_size": BS, "device": "cpu",
                         "world_size": world},
            "sweeps": sweeps, "measure": {"warmup": 1, "repeat": 2, "max_time_s": 0.01, "timeout_s": 120}}


@cache
def torchrun_records(world: int, tmp_root: str) -> list[dict]:
    """`torchrun --standalone --nproc-per-node WORLD -m bench run SUITE` on CPU; the records it wrote."""
    import subprocess
    from pathlib import Path

    directory = Path(tmp_root) / f"torchrun{world}"
    directory.mkdir()
    suite = write_suite(directory, suite_for(world))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "bench", "run", str(suite), "--out", str(directory / "results")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_jsonl(only_run_dir(directory / "results") / "records.jsonl")


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("distributed"))


@pytest.mark.parametrize("world", [2, 4])
def test_torchrun_bytes_equal_the_closed_forms_and_outputs_match_the_oracle(world, tmp_root):
    records = [r for r in torchrun_records(world, tmp_root) if r["params"]["world_size"] == world
               and r["impl"] in IMPLS]
    assert len(records) == len(IMPLS) * len(PATTERNS) * 2
    for r in records:
        impl, pattern, mode = r["impl"], r["params"]["pattern"], r["params"]["mode"]
        label = f"{impl} {pattern} {mode} P={world}"
        assert r["status"] == "ok", (label, r["reason"], r["details"])
        assert r["error"]["rel_l2"] <= r["error"]["tolerance"]
        if mode == "fwd_bwd":
            assert set(r["error"]["grads"]) == {"dq", "dk", "dv"}, label
        comm = r["comm"]
        assert comm["backend"] == "gloo" and comm["world_size"] == world and len(comm["bytes_per_rank"]) == world
        assert comm["bytes_total"] == comm["expected_bytes"] == closed_form(impl, pattern, world, mode), label
        assert comm["bytes_total"] == sum(comm["bytes_per_rank"]) == sum(
            op["bytes_total"] for op in comm["by_op"].values())
        assert comm["bytes_max_rank"] == max(comm["bytes_per_rank"])
        assert {op: s["calls"] for op, s in comm["by_op"].items()} == expected_ops(impl, world, mode), label
        for op, s in comm["by_op"].items():
            assert s["time_s"] > 0 and s["busbw_gbps"] > 0, (label, op)
        if impl == "cp_sparse":
            per_rank = [rows * KV_ROW * (1 if mode == "fwd" else 2) for rows in fetched_rows_by_rank(pattern, world)]
            # all-to-all: what rank r sends is what the others fetch from it; totals per rank differ
            assert sum(comm["bytes_per_rank"]) == sum(per_rank), label
        else:
            assert len(set(comm["bytes_per_rank"])) == 1, label  # symmetric: every rank sends the same
        assert r["device"].endswith(f"x{world} ranks (gloo)") and r["config"]["backend"] == "gloo"
        assert len(r["time_s"]["samples"]) == r["time_s"]["n"] >= 2


def test_torchrun_also_runs_single_process_pairs_and_skips_what_needs_more_ranks(tmp_root):
    records = torchrun_records(2, tmp_root)
    single = [r for r in records if r["params"]["world_size"] == 1]
    assert {r["impl"] for r in single} == set(IMPLS) | {"dense"}
    assert all(r["status"] == "ok" and r["comm"] is None for r in single)
    four = [r for r in records if r["params"]["world_size"] == 4]
    assert four and all(r["status"] == "skipped" and r["reason"] == "world_size 4 needs 4 ranks; the launcher "
                        "started 2" for r in four)
    dense = [r for r in records if r["impl"] == "dense" and r["params"]["world_size"] == 2]
    assert all(r["status"] == "skipped" and "single-process" in r["reason"] for r in dense)


def test_cp_sparse_saves_what_the_pattern_allows():
    """The closed forms themselves: cp_sparse against cp_ring for a local window, and tp_heads' blindness."""
    from bench import registry
    from bench.spec.case import Case

    ring, sparse, tp = (registry.get(n) for n in ("cp_ring", "cp_sparse", "tp_heads"))
    for p in (2, 4):
        case = Case(heads=8, seq_len=4096, window=128, block_size=64, world_size=p, device="cpu")
        ratio = sparse.expected_comm_bytes(case) / ring.expected_comm_bytes(case)
        assert ratio == 2 * (p - 1) * 64 / ((p - 1) * 4096)  # halo of one 64-block per side vs all of K/V
        dense_case = Case(heads=8, seq_len=4096, pattern="block_random", density=0.5, world_size=p, device="cpu")
        assert tp.expected_comm_bytes(case) == tp.expected_comm_bytes(dense_case)


def test_grouped_query_attention_and_documents_over_ranks(tmp_path):
    """kv_heads < heads and packed documents, P = 2, ranks started by the runner: every record ok against the
    oracle (dq, dk, dv included), K/V bytes at kv_heads; what cannot be split says why."""
    kv_heads, documents = 2, [40, 88]
    suite = write_suite(tmp_path, {
        "name": "gqa_ranks", "impls": IMPLS,
        "defaults": {"batch": B, "heads": H, "kv_heads": kv_heads, "head_dim": D, "seq_len": N, "block_size": BS,
                     "pattern": "local", "window": 16, "documents": documents, "device": "cpu", "world_size": 2},
        "sweeps": [{"sweep": {"mode": ["fwd", "fwd_bwd"]}},
                   {"defaults": {"kv_heads": 1, "q_len": 64}, "sweep": {}}],
        "measure": {"warmup": 1, "repeat": 2, "max_time_s": 0.01, "timeout_s": 120}})
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    kv_row = 2 * B * kv_heads * D * E
    for r in records:
        impl, mode = r["impl"], r["params"]["mode"]
        if r["params"]["kv_heads"] == 1:
            assert r["status"] == "skipped", r
            expected = ("kv_heads 1 is not divisible by world_size 2" if impl == "tp_heads"
                        else "q_len 64 < seq_len 128 (decode, chunked prefill) is not supported")
            assert expected in r["reason"], r["reason"]
            continue
        assert r["status"] == "ok", (impl, mode, r["reason"], r["details"])
        if mode == "fwd_bwd":
            assert set(r["error"]["grads"]) == {"dq", "dk", "dv"}
        factor = 1 if mode == "fwd" else 2
        if impl == "tp_heads":  # output all-reduce at H heads; backward: dq (H) + dk, dv (Hkv)
            s_q, s_kv = B * N * H * D * E, B * N * kv_heads * D * E
            closed = 2 * (2 - 1) * (s_q if mode == "fwd" else 2 * s_q + 2 * s_kv)
        elif impl == "cp_sparse":
            closed = sum(fetched_rows_by_rank("local", 2, documents=documents)) * kv_row * factor
        else:  # cp_ring, cp_allgather: every chunk of K/V at kv_heads reaches the other rank
            closed = 2 * 1 * (N // 2) * kv_row * factor
        assert r["comm"]["bytes_total"] == r["comm"]["expected_bytes"] == closed, (impl, mode)
    assert len(records) == len(IMPLS) * 3


# --- the runner's own rank processes, with planted faults -------------------------------------------------

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


@pytest.mark.parametrize("name, worlds, pairs", [("seed000_comm", {2, 4}, 56), ("multi_gpu", {1, 2, 4, 8}, 160)])
def test_distributed_suites_load(name, worlds, pairs):
    from bench.spec.suite import load_suite

    suite = load_suite(ROOT / "suites" / f"{name}.yaml")
    assert suite.impls == IMPLS
    assert {c.world_size for c in suite.cases} == worlds
    assert len(suite.cases) * len(suite.impls) == pairs
    assert all(c.heads % c.world_size == 0 and c.seq_len % c.world_size == 0 for c in suite.cases)
