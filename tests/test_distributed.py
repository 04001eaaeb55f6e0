"""`bench run` with world_size > 1: bytes in closed form, outputs and gradients against the oracle, per-rank work,
overlap, faults.

- Under torchrun (`python -m torch.distributed.run`, which is what the `torchrun` script runs) with 8 CPU ranks,
  once: every distributed implementation at P = 2, 4 and 8 (the launcher's first P ranks form each pair's
  group) on local, block_random, longformer, causal contiguous and zigzag, grouped-query attention and packed
  documents, fwd and fwd_bwd (P = 8, the slowest on shared cores, on block_random, causal and GQA only). Each
  record must be ok (output and dq, dk, dv within tolerance of the float64 oracle), its counted bytes must
  equal the implementation's expected_comm_bytes and the closed form written here (per level for cp_usp), and
  its per-rank rows must give the useful FLOPs, the imbalance and the overlap fraction.
- Without a launcher, the runner starts the ranks itself: cp_usp at P = 4 with the same checks, and a
  rank that raises, hangs or dies gives a failed record naming it, no rank process survives, and the sweep
  goes on to a healthy pair.
- What a scheme cannot split says why (a skip). (Bad layouts and degrees in a suite file: tests/test_bad_input.py.)
"""

from __future__ import annotations

import os
import sys
from functools import cache

import pytest

from bench.patterns import make_pattern
from tests.conftest import ROOT, only_run_dir, read_jsonl, run_bench, write_suite

B, H, D, N, BS, E = 1, 8, 8, 128, 16, 4  # batch, heads, head_dim, seq_len, block_size, bytes per float32
A = 4  # bytes per element of the accumulation dtype (float32): the ring's dK/dV
PATTERNS = {"local": {"window": 16}, "causal_local": {"window": 24},
            "block_random": {"density": 0.3, "block_size": BS, "seed": 5},
            "longformer": {"window": 16, "global_tokens": 4}, "causal": {}}
IMPLS = ["tp_heads", "cp_ring", "cp_allgather", "cp_sparse", "cp_ulysses", "cp_usp"]
SEQUENCE_SPLIT = ["cp_ring", "cp_allgather", "cp_sparse", "cp_ulysses", "cp_usp"]
WORLDS = (2, 4, 8)


def kv_row(kv_heads: int, e: int = E) -> int:
    """Bytes of one position of K and V at kv_heads."""
    return 2 * B * kv_heads * D * e


def positions(p: int, rank: int, layout: str) -> list[int]:
    if layout == "contiguous":
        c = N // p
        return list(range(rank * c, (rank + 1) * c))
    c = N // (2 * p)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * p - 1 - rank) * c, (2 * p - rank) * c))


def dense_mask(params: dict):
    fields = {k: params[k] for k in ("window", "density", "block_size", "seed", "global_tokens", "dilation")
              if k in params}
    return make_pattern(params["pattern"], N, documents=params.get("documents"), **fields).dense_mask()


def fetched_rows_by_rank(params: dict) -> list[int]:
    """cp_sparse, derived from the dense mask: per rank, the positions of other ranks' key blocks (of BS)
    that hold any pair allowed to one of its queries."""
    mask = dense_mask(params)
    p, layout = params["world_size"], params.get("cp_layout", "contiguous")
    rows = []
    for r in range(p):
        mine = positions(p, r, layout)
        blocks = mask[mine].reshape(len(mine), N // BS, BS).any(dim=2).any(dim=0)  # key blocks needed
        rows.append(sum(1 for j in range(N) if blocks[j // BS] and j not in set(mine)))
    return rows


def usp_degree(p: int, heads: int, kv_heads: int, given: int | None) -> int:
    if given is not None:
        return given
    return max([d for d in range(1, p) if p % d == 0 and heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
               or [1])


def closed_form(impl: str, params: dict) -> dict[str, int]:
    """Bytes all ranks send per step, written out per implementation, by level ("all" for one level)."""
    p, mode, hkv = params["world_size"], params["mode"], params.get("kv_heads") or H
    bwd = mode == "fwd_bwd"
    if impl == "tp_heads":  # ring all-reduce of S: 2 (P-1) S; backward dq (H heads), dk, dv (Hkv heads)
        s_q, s_kv = B * N * H * D * E, B * N * hkv * D * E
        return {"all": 2 * (p - 1) * (s_q + (s_q + 2 * s_kv if bwd else 0))}
    if impl == "cp_allgather":  # every chunk reaches P-1 other ranks; backward moves as much
        return {"all": (p - 1) * N * kv_row(hkv) * (2 if bwd else 1)}
    if impl == "cp_sparse":
        return {"all": sum(fetched_rows_by_rank(params)) * kv_row(hkv) * (2 if bwd else 1)}

    def ulysses(u: int) -> int:  # q, k, v in and the output back: (u-1)/u of each rank's, KV heads repeated to u
        kv = hkv if hkv % u == 0 else u
        return (u - 1) * B * N * (2 * H + 2 * kv) * D * E // u * (2 if bwd else 1)

    def ring(r: int, kv: int) -> int:  # K/V shifts; backward: again, plus R dK/dV shifts in float32
        return (r - 1) * N * kv_row(kv) * (2 if bwd else 1) + (r * N * kv_row(kv, A) if bwd and r > 1 else 0)

    if impl == "cp_ring":
        return {"ring": ring(p, hkv)}
    if impl == "cp_ulysses":
        return {"ulysses": ulysses(p)}
    u = usp_degree(p, H, hkv, params.get("ulysses_degree"))
    return {"ulysses": ulysses(u) if u > 1 else 0, "ring": ring(p // u, hkv if hkv % u == 0 else u)}


def expected_ops(impl: str, params: dict) -> dict[str, int]:
    """Op -> calls per step."""
    p, bwd = params["world_size"], params["mode"] == "fwd_bwd"
    hkv = params.get("kv_heads") or H
    shifts = lambda r: (3 * r - 2 if bwd else r - 1)  # noqa: E731 - forward R-1; backward R-1 of K/V and R of dK/dV
    if impl == "cp_usp":
        u = usp_degree(p, H, hkv, params.get("ulysses_degree"))
        return {**({"all_to_all_single": 4 if bwd else 2} if u > 1 else {}),
                **({"batch_isend_irecv": shifts(p // u)} if p // u > 1 else {})}
    return {"tp_heads": {"all_reduce": 2 if bwd else 1},
            "cp_ring": {"batch_isend_irecv": shifts(p)},
            "cp_allgather": {"all_gather_into_tensor": 1, **({"reduce_scatter_tensor": 1} if bwd else {})},
            "cp_sparse": {"all_to_all_single": 2 if bwd else 1},
            "cp_ulysses": {"all_to_all_single": 4 if bwd else 2}}[impl]


def rank_pairs(impl: str, params: dict) -> list[int]:
    """Allowed (query head, query, key) triples each rank computes, from the dense mask."""
    mask = dense_mask(params)
    p, layout, hkv = params["world_size"], params.get("cp_layout", "contiguous"), params.get("kv_heads") or H
    nnz = int(mask.sum())
    if impl in ("tp_heads", "cp_ulysses"):
        return [H // p * nnz] * p
    if impl == "cp_usp":
        u = usp_degree(p, H, hkv, params.get("ulysses_degree"))
        groups = [[j for m in range(g * u, (g + 1) * u) for j in positions(p, m, layout)] for g in range(p // u)]
        return [H // u * int(mask[groups[r // u]].sum()) for r in range(p)]
    return [H * int(mask[positions(p, r, layout)].sum()) for r in range(p)]


def check_record(r: dict) -> None:
    """Everything a distributed record must satisfy against the closed forms written here."""
    impl, params = r["impl"], r["params"]
    p, mode = params["world_size"], params["mode"]
    label = f"{impl} {r['case_id']}"
    assert r["status"] == "ok", (label, r["reason"], r["details"])
    assert r["error"]["rel_l2"] <= r["error"]["tolerance"], label
    if mode == "fwd_bwd":
        assert set(r["error"]["grads"]) == {"dq", "dk", "dv"}, label
    comm = r["comm"]
    assert comm["backend"] == "gloo" and comm["world_size"] == p and len(comm["bytes_per_rank"]) == p
    levels = closed_form(impl, params)
    assert comm["bytes_total"] == comm["expected_bytes"] == sum(levels.values()), (label, comm["bytes_total"], levels)
    assert comm["bytes_total"] == sum(comm["bytes_per_rank"]) == sum(op["bytes_total"] for op in comm["by_op"].values())
    assert comm["bytes_max_rank"] == max(comm["bytes_per_rank"])
    if "all" in levels:
        assert comm["by_level"] is None, label
    else:  # every byte counted under its level, each level equal to its closed form
        assert {k: (v["bytes_total"], v["expected_bytes"]) for k, v in comm["by_level"].items()} == {
            k: (v, v) for k, v in levels.items()}, label
    assert {op: s["calls"] for op, s in comm["by_op"].items()} == expected_ops(impl, params), label
    for op, s in comm["by_op"].items():
        assert s["time_s"] > 0 and s["busbw_gbps"] > 0, (label, op)
    if impl == "cp_sparse":  # all-to-all: what rank r sends is what the others fetch from it; totals per rank differ
        assert sum(comm["bytes_per_rank"]) == sum(fetched_rows_by_rank(params)) * kv_row(
            params.get("kv_heads") or H) * (1 if mode == "fwd" else 2), label
    else:
        assert len(set(comm["bytes_per_rank"])) == 1, (label, comm["bytes_per_rank"])  # symmetric
    # per rank: useful FLOPs from the mask, the imbalance of them, times and memory
    per_rank = comm["per_rank"]
    assert [row["rank"] for row in per_rank] == list(range(p))
    assert [row["bytes"] for row in per_rank] == comm["bytes_per_rank"]
    pairs = rank_pairs(impl, params)
    factor = 4 * B * D * (2.5 if mode == "fwd_bwd" else 1)
    assert [row["flops"] for row in per_rank] == pytest.approx([factor * x for x in pairs]), label
    assert sum(row["flops"] for row in per_rank) == pytest.approx(r["flops"]), label  # no redundant useful work
    assert comm["imbalance"] == pytest.approx(max(pairs) / (sum(pairs) / p)), label
    for row in per_rank:
        assert row["comm_s"] > 0 and 0 <= row["hidden_s"] <= row["comm_s"], (label, row)
        assert row["exposed_s"] == pytest.approx(row["comm_s"] - row["hidden_s"])
        assert row["step_s"] > 0 and row["compute_s"] >= 0 and row["peak_bytes"] is not None, (label, row)
    overlapped = impl == "cp_ring" or (impl == "cp_usp" and levels.get("ring", 0) > 0)
    assert 0 <= comm["overlap_fraction"] <= 1 and comm["overlap_method"] == "host", label
    if not overlapped:  # blocking collectives hide nothing
        assert comm["overlap_fraction"] == 0, label
    assert r["memory"]["note"].startswith(f"largest of {p} ranks")
    assert r["device"].endswith(f"x{p} ranks (gloo)") and r["config"]["backend"] == "gloo"
    assert len(r["time_s"]["samples"]) == r["time_s"]["n"] >= 2


def torchrun_sweeps() -> list[dict]:
    """Per P: the patterns and modes each scheme runs at (fwd and fwd_bwd both appear at every P)."""
    def block(pattern: str, p: int, mode: str, **extra) -> dict:
        return {"defaults": {"pattern": pattern, **PATTERNS[pattern], "world_size": p, "mode": mode, **extra},
                "sweep": {}}

    sweeps = []
    for p in (2, 4):
        other = "fwd" if p == 4 else "fwd_bwd"
        sweeps += [block("local", p, "fwd_bwd" if p == 4 else "fwd"), block("block_random", p, other),
                   block("causal", p, other), block("causal", p, other, cp_layout="zigzag")]
    # P = 8 (8 ranks on the shared cores): fewer cases; fwd from causal, fwd_bwd from block_random and zigzag
    sweeps += [block("block_random", 8, "fwd_bwd"), block("causal", 8, "fwd"),
               block("causal", 8, "fwd_bwd", cp_layout="zigzag")]
    sweeps += [block("longformer", 4, "fwd"), block("causal_local", 2, "fwd_bwd"),
               block("local", 2, "fwd_bwd", kv_heads=2, documents=[40, 88]),  # GQA, kv_heads % P == 0
               block("local", 8, "fwd", kv_heads=2),  # P % kv_heads == 0: Ulysses repeats the KV heads
               block("causal", 8, "fwd_bwd", cp_layout="zigzag", ulysses_degree=2),  # USP: 4 rings of 2 groups
               block("local", 9, "fwd")]  # more ranks than the launcher started
    return sweeps


def suite_for(world: int) -> dict:
    sweeps = torchrun_sweeps()
    sweeps.append({"defaults": {"pattern": "local", "window": 16, "world_size": 1}, "sweep": {}})
    return {"name": f"torchrun{world}", "impls": [*IMPLS, "dense"],
            "defaults": {"batch": B, "heads": H, "head_dim": D, "seq_len": N, "block_size": BS, "device": "cpu"},
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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_jsonl(only_run_dir(directory / "results") / "records.jsonl")


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("distributed"))


def measured(records: list[dict]) -> list[dict]:
    return [r for r in records if r["status"] != "skipped" and 1 < r["params"]["world_size"] <= 8
            and r["impl"] in IMPLS]


def test_torchrun_bytes_equal_the_closed_forms_and_outputs_match_the_oracle(tmp_root):
    records = torchrun_records(8, tmp_root)
    done = measured(records)
    for r in done:
        check_record(r)
    assert {r["params"]["world_size"] for r in done} == set(WORLDS)
    for p in WORLDS:  # every scheme at every P, forward and backward
        for impl in IMPLS:
            assert {r["params"]["mode"] for r in done if r["impl"] == impl and r["params"]["world_size"] == p} == {
                "fwd", "fwd_bwd"}, (impl, p)
    # what cannot be split says why
    skipped = {(r["impl"], r["case_id"]): r["reason"] for r in records if r["status"] == "skipped"}
    reasons = list(skipped.values())
    assert any("cp_layout 'zigzag' (a placement of sequence chunks on ranks) does not apply" in s for s in reasons)
    assert any("kv_heads 2 is not divisible by world_size 8" in s for s in reasons)  # tp_heads
    assert any("ulysses_degree applies to cp_usp" in s for s in reasons)
    assert sum("world_size 9 needs 9 ranks; the launcher started 8" in s for s in reasons) == len(IMPLS) + 1
    usp = [r for r in done if r["impl"] == "cp_usp" and r["params"]["ulysses_degree"] == 2]
    assert len(usp) == 1 and usp[0]["config"]["ulysses_degree"] == 2 and usp[0]["config"]["ring_degree"] == 4


def test_zigzag_balances_causal_work_and_the_ring_overlaps(tmp_root):
    done = measured(torchrun_records(8, tmp_root))
    for p in WORLDS:
        causal = {(r["impl"], r["params"]["cp_layout"]): r for r in done
                  if r["params"]["pattern"] == "causal" and r["params"]["world_size"] == p
                  and r["params"]["ulysses_degree"] is None}
        c = N // p  # contiguous: the last rank has (P - 1/2) C^2 + C/2 pairs, against the mean N (N + 1) / 2P
        last = (p - 1) * c * c + c * (c + 1) // 2
        for impl in ("cp_ring", "cp_allgather", "cp_sparse"):
            contiguous, zigzag = causal[(impl, "contiguous")]["comm"], causal[(impl, "zigzag")]["comm"]
            assert contiguous["imbalance"] == pytest.approx(last / (N * (N + 1) / 2 / p))
            assert zigzag["imbalance"] == pytest.approx(1.0) and zigzag["imbalance"] < contiguous["imbalance"]
        for layout in ("contiguous", "zigzag"):  # Ulysses: every rank all rows for H/P heads, whatever the layout
            assert causal[("cp_ulysses", layout)]["comm"]["imbalance"] == pytest.approx(1.0)
        assert causal[("cp_usp", "zigzag")]["comm"]["imbalance"] == pytest.approx(1.0)
        if p > 2:  # USP's groups hold zigzag pairs of the ring's chunks: balanced; contiguous groups are not
            assert causal[("cp_usp", "contiguous")]["comm"]["imbalance"] > 1.1
    ring = [r["comm"] for r in done if r["impl"] == "cp_ring"]
    assert ring and all(c["overlap_fraction"] is not None and 0 <= c["overlap_fraction"] <= 1 for c in ring)
    assert any(c["overlap_fraction"] > 0 for c in ring)  # something was hidden behind compute


def test_torchrun_also_runs_single_process_pairs(tmp_root):
    records = torchrun_records(8, tmp_root)
    single = [r for r in records if r["params"]["world_size"] == 1]
    assert {r["impl"] for r in single} == set(IMPLS) | {"dense"}
    assert all(r["status"] == "ok" and r["comm"] is None for r in single)
    dense = [r for r in records if r["impl"] == "dense" and r["params"]["world_size"] in WORLDS]
    assert dense and all(r["status"] == "skipped" and "single-process" in r["reason"] for r in dense)


def test_runner_started_ranks_run_the_new_schemes(tmp_path):
    """Without a launcher, P = 4 fresh rank processes: USP (Ulysses all-to-alls in 2 groups of 2, the overlapped
    ring across them, its waiter threads in fresh processes) on grouped-query attention and a zigzag causal
    mask, fwd_bwd, against the closed forms of both levels. (Every scheme at P = 2, 4, 8: the torchrun test.)"""
    suite = write_suite(tmp_path, {
        "name": "ranks4", "impls": ["cp_usp"],
        "defaults": {"batch": B, "heads": H, "head_dim": D, "seq_len": N, "block_size": BS, "device": "cpu",
                     "world_size": 4, "mode": "fwd_bwd", "pattern": "causal", "cp_layout": "zigzag", "kv_heads": 2},
        "sweep": {}, "measure": {"warmup": 1, "repeat": 2, "max_time_s": 0.01, "timeout_s": 120}})
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    assert len(records) == 1
    check_record(records[0])
    assert set(records[0]["comm"]["by_level"]) == {"ulysses", "ring"}


# --- the runner's own rank processes, with planted faults -------------------------------------------------


