"""triton_block_sparse's decode path (impls/triton_block_sparse/decode.py): a few query rows over a long cache split
over the keys, the GQA group's rows packed into one tile, the splits combined by their log-sum-exps. Through the
Triton interpreter against the float64 oracle (every mask kind, documents, batches, softcap, rows without keys),
the same-dtype numerics rule, and which cases take the path. Compiled on a GPU: test_triton_block_sparse_gpu.py;
compiled for sm_90 without one: test_triton_block_sparse.py's compile check."""

from __future__ import annotations

import pytest
import torch

from bench.measure.case.case_cache import CaseCache
from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.measure.pair import Task, measure_task
from bench.patterns import Pattern, make_pattern
from bench.registry import get
from bench.spec.case import Case
from impls.triton_block_sparse import decode, mode
from impls.triton_block_sparse.score_mods import mod_args

pytestmark = pytest.mark.skipif(not mode.uses_interpreter(),
                                reason="this process runs compiled kernels; these use the interpreter")

# (pattern, fields, structure, heads, kv_heads, N): formulas, bitmasks, documents, MQA and a group of 8
CASES = {
    "causal_q1_gqa4": ("causal", {}, dict(q_len=1), 8, 2, 1000),
    "causal_q5_odd": ("causal", {}, dict(q_len=5), 6, 3, 777),
    "local_q3_mha": ("local", dict(window=100), dict(q_len=3), 4, 4, 900),
    "block_random_q1_mqa": ("block_random", dict(density=0.2, block_size=64, seed=1), dict(q_len=1), 8, 1, 1024),
    "documents_q2": ("causal", {}, dict(q_len=2, documents=[100, 400, 500]), 4, 2, 1000),
    "sink_q1": ("sink", dict(window=128, global_tokens=4), dict(q_len=1), 4, 2, 1000),
    "random_q16_group8": ("random", dict(density=0.05, seed=2), dict(q_len=16), 8, 1, 600),
}


def _inputs(pattern: Pattern, heads: int, kv_heads: int, dtype: torch.dtype, batch: int = 2, head_dim: int = 64):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch, heads, pattern.q_len, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, pattern.seq_len, head_dim, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _case(pattern_name: str, fields: dict, structure: dict, heads: int, kv_heads: int, n: int, dtype: str,
          **extra) -> Case:
    return Case(batch=2, heads=heads, kv_heads=kv_heads, head_dim=64, seq_len=n, pattern=pattern_name, dtype=dtype,
                device="cpu", **structure, **fields, **extra)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", CASES)
def test_decode_matches_the_oracle_through_the_implementation(name, dtype):
    pattern_name, fields, structure, heads, kv_heads, n = CASES[name]
    case = _case(pattern_name, fields, structure, heads, kv_heads, n, dtype)
    pattern = case.make_pattern()
    q, k, v = _inputs(pattern, heads, kv_heads, getattr(torch, dtype))
    impl = get("triton_block_sparse")
    out = impl.prepare(case, pattern, q, k, v)()
    extras = impl.record_extras()
    assert extras["path"] == "decode (split keys)" and extras["splits"] >= 1, extras
    expected = reference_attention(q.double(), k.double(), v.double(), pattern)
    stats = compare(out, expected, tolerance_for(dtype))
    assert out.dtype == q.dtype and stats.passed, (name, stats)


def test_splits_cover_every_key_tile_and_more_than_one_is_combined():
    pattern = make_pattern("causal", 1000, q_len=1)
    q, k, v = _inputs(pattern, 8, 2, torch.float32)
    plan = decode.plan_decode(pattern, q, k, v, None)
    tiles = plan.kernel.tables.row_offsets[1] - plan.kernel.tables.row_offsets[0]
    assert plan.splits == decode.INTERPRETER_SPLITS and plan.packed_rows == 16  # 4 heads x 1 row, padded
    assert (plan.splits - 1) * plan.tiles_per_split < tiles <= plan.splits * plan.tiles_per_split


class LateCausal(Pattern):
    """Rows before `start` may attend to nothing (irregular, so bitmasks)."""

    name = "late_causal_decode"
    start = 990

    def allowed(self, i, j):
        return (j <= i) & (i >= self.start)


def test_a_row_without_keys_gives_zero_and_the_others_are_exact():
    pattern = LateCausal(1000, q_len=16)  # rows 984..989 have no key, 990..999 have
    q, k, v = _inputs(pattern, 4, 2, torch.float32)
    out = decode.run_decode(q, k, v, decode.plan_decode(pattern, q, k, v, None))
    assert out[:, :, :6].abs().max() == 0
    expected = reference_attention(q.double(), k.double(), v.double(), pattern)
    assert compare(out, expected, tolerance_for("float32")).passed


def test_softcap_is_applied_and_bias_modifications_take_the_prefill_path():
    case = _case("causal", {}, dict(q_len=2), 8, 2, 700, "float32", score_mod="softcap", softcap=5.0)
    pattern = case.make_pattern()
    q, k, v = _inputs(pattern, 8, 2, torch.float32)
    q = q * 4  # scores far past the cap: a missing cap would show
    impl = get("triton_block_sparse")
    out = impl.prepare(case, pattern, q, k, v)()
    assert impl.record_extras()["path"] == "decode (split keys)"
    mod = case.make_score_mod()
    expected = reference_attention(q.double(), k.double(), v.double(), pattern, score_mod=mod)
    assert compare(out, expected, tolerance_for("float32")).passed
    alibi = _case("causal", {}, dict(q_len=2), 8, 2, 700, "float32", score_mod="alibi")
    assert not decode.takes(pattern, q, k, False, mod_args(alibi, q.device))


@pytest.mark.parametrize(("q_len", "needs_grad", "heads", "takes"), [
    (1, False, 32, True), (16, False, 8, True), (16, True, 8, False),  # a backward: the prefill kernels
    (17, False, 8, False), (1, False, 256, False),  # past the rows, or a group of 256 rows
])
def test_which_cases_take_the_decode_path(q_len, needs_grad, heads, takes):
    pattern = make_pattern("causal", 512, q_len=q_len)
    q, k = torch.zeros(1, heads, q_len, 64), torch.zeros(1, 1, 512, 64)
    assert decode.takes(pattern, q, k, needs_grad, None) is takes
    square = make_pattern("causal", 16)  # 16 rows over 16 keys is prefill, not decode
    assert not decode.takes(square, torch.zeros(1, 2, 16, 64), torch.zeros(1, 2, 16, 64), False, None)


def test_decode_numerics_are_within_twice_the_same_dtype_reference():
    case = Case(batch=1, heads=8, kv_heads=2, head_dim=64, seq_len=2048, q_len=1, pattern="causal",
                dtype="bfloat16", device="cpu")
    record = measure_task(Task.of(case, "triton_block_sparse", {"warmup": 0, "repeat": 1, "max_time_s": 0.001,
                                                                   "memory": "worker"}), CaseCache())
    assert record.status == "ok", record.reason
    assert record.config is not None and record.config["path"] == "decode (split keys)"
    assert record.error is not None and record.error.ratio is not None and record.error.ratio <= 2.0, record.error
