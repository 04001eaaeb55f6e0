"""FLOP counts on cases small enough to count by hand, as the formulas give them and as records carry them."""

from __future__ import annotations

import pytest

from bench.measure.case import flops
from bench.measure.pair import CaseCache, Task, measure_task
from bench.patterns import make_pattern
from bench.spec.case import Case

MEASURE = {"warmup": 0, "repeat": 3, "max_time_s": 0.01, "timeout_s": 60, "check": True}

# Allowed pairs counted by hand, row by row.
HAND_NNZ = [
    # local W=4: |i - j| <= 2 over N=5 -> rows 0..4 see 3, 4, 5, 4, 3 keys
    ({"pattern": "local", "seq_len": 5, "window": 4}, 19),
    # causal N=4: row i sees i + 1 keys -> 1 + 2 + 3 + 4
    ({"pattern": "causal", "seq_len": 4}, 10),
    # causal_local W=2 N=4: keys i-1 and i -> 1 + 2 + 2 + 2
    ({"pattern": "causal_local", "seq_len": 4, "window": 2}, 7),
    # strided W=2 N=4: own pair {0,1} or {2,3}, plus the summary columns {1, 3} -> 3 keys for every row
    ({"pattern": "strided", "seq_len": 4, "window": 2}, 12),
    # axial 2x3 (N=6, C=3): own row (3) + own column (2) - itself counted twice = 4 per query
    ({"pattern": "axial", "seq_len": 6, "window": 3}, 24),
    ({"pattern": "dense", "seq_len": 3}, 9),
]


def case_of(fields: dict, **extra) -> Case:
    return Case(batch=2, heads=3, head_dim=8, device="cpu", **{**fields, **extra})


@pytest.mark.parametrize("fields, nnz", HAND_NNZ)
def test_pattern_nnz_matches_the_hand_count(fields, nnz):
    assert case_of(fields).make_pattern().nnz == nnz


@pytest.mark.parametrize("fields, nnz", HAND_NNZ)
def test_flop_formulas(fields, nnz):
    case = case_of(fields)
    n = case.seq_len
    # forward: Q K^T and P V, 2 * D FLOPs each per allowed pair, per head: 4 * B * H * nnz * D
    assert flops.useful_flops(case, nnz) == 4 * 2 * 3 * nnz * 8
    assert flops.dense_flops(case) == 4 * 2 * 3 * n * n * 8
    backward = case_of(fields, mode="fwd_bwd")
    assert flops.useful_flops(backward, nnz) == 2.5 * 4 * 2 * 3 * nnz * 8


def _record(case: Case, impl: str):
    task = Task.of(case, impl, MEASURE)
    return measure_task(task, CaseCache())


@pytest.mark.parametrize("impl", ["dense", "csr", "blocked"])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_records_carry_useful_and_dense_flops_and_the_rate(impl, mode):
    case = case_of({"pattern": "local", "seq_len": 5, "window": 4}, mode=mode)
    record = _record(case, impl)
    assert record.status == "ok", record.reason
    factor = 2.5 if mode == "fwd_bwd" else 1.0
    assert record.flops == factor * 4 * 2 * 3 * 19 * 8  # 19 allowed pairs, counted above
    assert record.flops_dense == factor * 4 * 2 * 3 * 25 * 8
    assert record.flops_per_s == pytest.approx(record.flops / record.time_s.median)
    assert record.density == pytest.approx(19 / 25)


def test_blocked_reports_the_pairs_it_computes():
    # local W=4 (band -2..2) in blocks of 2 rows: each block sees a span of 2 + 4 = 6 keys; 3 blocks
    # cover N=5 (the last padded), so 3 * 2 * 6 = 36 products per head for 19 allowed pairs.
    case = case_of({"pattern": "local", "seq_len": 5, "window": 4, "block_size": 2})
    record = _record(case, "blocked")
    assert record.status == "ok", record.reason
    assert record.config["path"] == "band"
    assert record.config["computed_pairs_per_head"] == 36
    assert record.config["computed_over_allowed"] == pytest.approx(36 / 19)


def test_blocked_gather_counts_padded_blocks():
    # block_random at density 1 keeps every block: N=6 in blocks of 4 -> 2 x 2 blocks of 4 x 4 = 64
    # products per head for 36 allowed pairs (the last block row and column are half padding).
    pattern = make_pattern("block_random", 6, density=1.0, block_size=4)
    assert pattern.nnz == 36
    case = case_of({"pattern": "block_random", "seq_len": 6, "density": 1.0, "block_size": 4})
    record = _record(case, "blocked")
    assert record.status == "ok", record.reason
    assert record.config["path"] == "gather"
    assert record.config["computed_pairs_per_head"] == 64
