"""Decode at the memory wall: blocked's decode path, paged KV caches, the bytes a call must move and the roofs."""

from __future__ import annotations

import pytest
import torch

from bench import api
from bench.cli import main
from bench.inputs.paged import kv_lengths, page_kv
from bench.measure.case.flops import min_bytes, pattern_kv_rows
from bench.measure.machine.calibrate import peak_for
from bench.measure.oracle.reference import reference_attention
from bench.patterns import make_pattern
from bench.registry import get
from bench.results.environment import Calibration
from bench.spec.case import Case
from tests.conftest import write_suite

PATTERNS = {"causal": {}, "causal_local": {"window": 300}, "sink": {"window": 200, "global_tokens": 4},
            "block_random": {"density": 0.3}, "local": {"window": 100}}


def _qkv(dtype, b=2, h=8, hkv=2, nq=1, n=1000, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=gen).to(dtype) for s in ((b, h, nq, d), (b, hkv, n, d), (b, hkv, n, d)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nq", [1, 5, 16])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_the_decode_path_matches_the_oracle(pattern, nq, dtype):
    q, k, v = _qkv(dtype, nq=nq)
    p = make_pattern(pattern, 1000, q_len=nq, **PATTERNS[pattern])
    case = api.case_for(q, p, "fwd", k)
    impl = get("blocked")
    out = impl.prepare(case, p, q, k, v)()
    assert impl.record_extras()["path"] == "decode"
    ref = reference_attention(q, k, v, p)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((out.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nq", [1, 2])
@pytest.mark.parametrize("pattern", ["causal", "block_random", "sink"])
def test_a_long_contiguous_list_streams_over_several_steps_and_splits(pattern, nq, dtype):
    """A KV head of 4 or 8 query rows over 5000 keys: the contiguous cache's steps of up to 1024 keys (decode.cpp,
    Stepping::stream), a partial last step, partial blocks inside a step, and one sequence's keys split over the
    threads (B1, one KV head)."""
    q, k, v = _qkv(dtype, b=1, h=4, hkv=1, nq=nq, n=5000, seed=1)
    p = make_pattern(pattern, 5000, q_len=nq, **PATTERNS[pattern])
    impl = get("blocked")
    out = impl.prepare(api.case_for(q, p, "fwd", k), p, q, k, v)()
    assert impl.record_extras()["path"] == "decode"
    ref = reference_attention(q, k, v, p)
    assert float((out.double() - ref).norm() / ref.norm()) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_documents_and_an_empty_row_in_decode():
    q, k, v = _qkv(torch.float32, nq=4, n=300)
    p = make_pattern("causal_local", 300, q_len=4, window=2, documents=[150, 149, 1])
    out = get("blocked").prepare(api.case_for(q, p, "fwd", k), p, q, k, v)()
    assert torch.allclose(out.double(), reference_attention(q, k, v, p), atol=1e-5)


# heads 6 on 2 KV heads, 2 queries: 6 rows per KV head, one quad of rows and two scored one by one (decode.cpp)
@pytest.mark.parametrize("heads", [8, 6])
@pytest.mark.parametrize("lengths", [None, [1000, 700, 33]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_paged_cache_read_through_its_page_table(lengths, dtype, heads):
    q, k, v = _qkv(dtype, b=3, h=heads, nq=2)
    case = Case(batch=3, heads=heads, kv_heads=2, head_dim=64, seq_len=1000, q_len=2, pattern="causal", device="cpu",
                dtype="float32" if dtype == torch.float32 else "bfloat16", page_size=16,
                kv_lens=tuple(lengths) if lengths else None)
    sizes = kv_lengths(case.kv_lens, 3, 1000, 2, 0)
    paged = page_kv(k, v, 16, sizes, seed=5)
    assert paged.page_table.shape == (3, 63) and int((paged.page_table >= 0).sum()) == sum(-(-n // 16) for n in sizes)
    assert sorted(paged.page_table[paged.page_table >= 0].tolist()) == list(range(paged.k_pages.shape[0]))
    impl = get("blocked")
    assert impl.paged_native(case)
    patterns = None if lengths is None else [make_pattern("causal", n, q_len=2) for n in sizes]
    out = impl.prepare_paged(case, case.make_pattern(), q, paged, patterns)()
    for b, n in enumerate(sizes):
        ref = reference_attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n],
                                  make_pattern("causal", n, q_len=2))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((out[b : b + 1].double() - ref).norm() / ref.norm()) < tol
    # gathering the pages back gives the logical cache
    k_back, v_back = torch.zeros_like(k), torch.zeros_like(v)
    paged.gather_(k_back, v_back)
    for b, n in enumerate(sizes):
        assert torch.equal(k_back[b, :, :n], k[b, :, :n]) and torch.equal(v_back[b, :, :n], v[b, :, :n])


def test_a_paged_suite_runs_every_implementation_through_the_pool_or_a_gather(tmp_path):
    suite = {"name": "paged", "impls": ["dense", "sdpa", "blocked", "flex"],
             "defaults": {"heads": 8, "kv_heads": 2, "head_dim": 64, "pattern": "causal", "seq_len": 640,
                          "q_len": 1, "batch": 2, "page_size": 16},
             "sweep": {"kv_lens": [None, [640, 100]]},
             "measure": {"repeat": 2, "warmup": 0, "max_time_s": 0.1, "memory": "worker"}}
    records = api.run(write_suite(tmp_path, suite), out=tmp_path / "results", quiet=True)
    by = {(r.impl, r.params["kv_lens"] is not None): r for r in records}
    for impl in ("dense", "sdpa", "blocked", "flex"):
        assert by[(impl, False)].status == "ok", by[(impl, False)].reason
    assert by[("blocked", True)].status == "ok" and by[("blocked", True)].config["paged"]
    assert by[("sdpa", True)].status == "skipped" and "kv_lens" in by[("sdpa", True)].reason
    # q_len 1 over 640 keys: q and the output (2 x 8 heads x 64 x 4 bytes each), K and V rows once per KV head
    assert by[("blocked", False)].bytes == 2 * (2 * 8 * 64 * 4) + 2 * (640 * 2 * 2) * 64 * 4
    assert by[("blocked", True)].bytes == 2 * (2 * 8 * 64 * 4) + 2 * ((640 + 100) * 2) * 64 * 4


def test_min_bytes_counts_each_allowed_key_row_once_per_kv_head():
    case = Case(batch=2, heads=32, kv_heads=8, head_dim=128, seq_len=32768, q_len=1, pattern="causal_local",
                window=4096, dtype="bfloat16")
    rows = pattern_kv_rows(case, case.make_pattern())
    assert rows == 4096 * 2 * 8  # the window's keys, per sequence and KV head
    assert min_bytes(case, rows) == 2 * (2 * 32 * 128 * 2) + 2 * rows * 128 * 2
    grads = Case(**{**case.params(), "mode": "fwd_bwd", "q_len": None, "pattern": "causal"})
    assert min_bytes(grads, 10) == 2 * min_bytes(Case(**{**grads.params(), "mode": "fwd"}), 10)


def test_the_binding_roof():
    calibration = Calibration(device="cpu", matmul={"bfloat16": {"flops_per_s": 400e9}},
                              read={"all_threads": {"bytes_per_s": 20e9}})
    decode = peak_for(1e9, "bfloat16", "cpu", False, calibration, None, 10e9, 1e6, 10**8)
    assert decode.bound == "memory" and decode.bandwidth_fraction == pytest.approx(0.5)
    assert decode.bandwidth_source == "calibrated all-thread read"
    prefill = peak_for(200e9, "bfloat16", "cpu", False, calibration, None, 1e9, 1e12, 10**8)
    assert prefill.bound == "compute" and prefill.fraction == pytest.approx(0.5)
    h200 = peak_for(1e12, "bfloat16", "cuda", False, None, ("NVIDIA H200", 141 * 2**30), 2e12, 1e9, 10**9)
    assert str(h200.bandwidth_source).endswith("datasheet memory bandwidth") and h200.bound == "memory"


@pytest.mark.parametrize("changes, words", [
    ({"page_size": 24}, ["page_size", "power of two"]),
    ({"page_size": 128, "block_size": 48}, ["page_size", "align"]),
    ({"page_size": 16, "kv_lens": [512]}, ["kv_lens", "1 lengths for batch 2"]),
    ({"page_size": 16, "kv_lens": [512, 900]}, ["kv_lens", "900", "between q_len 1 and seq_len 512"]),
    ({"kv_lens": [512, 300]}, ["kv_lens", "no page_size"]),
    ({"page_size": 16, "mode": "fwd_bwd"}, ["page_size", "mode fwd"]),
])
def test_bad_paging_fields_exit_2(tmp_path, capsys, changes, words):
    defaults = {"heads": 4, "head_dim": 16, "seq_len": 512, "q_len": 1, "batch": 2, "pattern": "causal", **changes}
    suite = write_suite(tmp_path, {"name": "bad", "impls": ["blocked"], "defaults": defaults})
    assert main(["run", str(suite), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
