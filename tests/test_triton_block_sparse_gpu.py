"""triton_block_sparse on a CUDA GPU: the compiled kernels against the float64 oracle at realistic sizes in
bfloat16 and float16, every candidate tile configuration, grouped-query heads with fewer query rows than keys
(decode, chunked prefill) and packed documents, autotuning, and the split-key decode path. Skipped without a
GPU (they cannot run elsewhere); scripts/gpu_check.sh runs them with `pytest -m gpu`. No timing is asserted.
"""

from __future__ import annotations

import pytest
import torch

from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.patterns import make_pattern
from bench.registry import get
from bench.spec.case import Case
from impls.triton_block_sparse import launch, mode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and mode.uses_interpreter(),
                       reason="TRITON_INTERPRET=1: this process runs the interpreter, not the compiled kernels"),
]

N = 4000  # realistic, and a multiple of no tile side
PATTERNS = {
    "local": dict(window=512),
    "block_random": dict(density=0.1, block_size=64, seed=1),
    "bigbird": dict(window=256, global_tokens=16, density=0.05, block_size=64, seed=2),
    "random": dict(density=0.02, seed=3),
}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def inputs(n: int, dtype: torch.dtype, head_dim: int, heads: int = 8, seed: int = 0, kv_heads: int | None = None,
           q_len: int | None = None):
    """[q, k, v, grad_out]: q and grad_out (1, heads, q_len, D), k and v (1, kv_heads, n, D)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = n if q_len is None else q_len
    hkv = heads if kv_heads is None else kv_heads
    shapes = [(1, heads, rows, head_dim), (1, hkv, n, head_dim), (1, hkv, n, head_dim), (1, heads, rows, head_dim)]
    return [torch.randn(shape, generator=gen, device="cuda").to(dtype) for shape in shapes]


def check(pattern, configs: dict, dtype: torch.dtype, head_dim: int, tol: float, heads: int = 8,
          kv_heads: int | None = None) -> None:
    q, k, v, grad_out = inputs(pattern.seq_len, dtype, head_dim, heads, kv_heads=kv_heads, q_len=pattern.q_len)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    plan = launch.plan_with_configs(pattern, q, configs["fwd"], configs["dkdv"], configs["dq"], k)
    out = launch.BlockSparseAttention.apply(q, k, v, plan)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, pattern)
    expected = torch.autograd.grad(ref, leaves, grad_out.double())
    for name, a, e in [("out", out, ref), *zip(("dq", "dk", "dv"), got, expected, strict=True)]:
        assert a.shape == e.shape, (name, a.shape, e.shape)
        stats = compare(a, e, tol)
        assert stats.passed, f"{pattern!r} {dtype} D={head_dim} {name}: rel_l2 {stats.rel_l2} > {tol}"


FIRST = dict(fwd=launch.FWD_CONFIGS[0], dkdv=launch.DKDV_CONFIGS[0], dq=launch.DQ_CONFIGS[0])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("pattern_name", sorted(PATTERNS))
def test_compiled_kernels_match_oracle(pattern_name, dtype, head_dim):
    pattern = make_pattern(pattern_name, N, **PATTERNS[pattern_name])
    check(pattern, FIRST, dtype, head_dim, tolerance_for(DTYPE_NAMES[dtype]))


# (pattern, fields, structure, kv_heads) with 8 query heads: formulas over rows offset to the last positions,
# bitmasks for documents and neighbourhoods, decode (one query row), GQA and MQA.
STRUCTURED = {
    "causal_chunk": ("causal", {}, dict(q_len=1000), 2),
    "sink_decode": ("sink", dict(window=512, global_tokens=4), dict(q_len=1), 1),
    "prefix_lm_chunk": ("prefix_lm", dict(prefix=700), dict(q_len=1500), 4),
    "causal_documents": ("causal", {}, dict(q_len=2000, documents=[1, 999, 1500, 1500]), 2),
    "neighborhood": ("neighborhood", dict(window=7, image_width=80), {}, 2),
    "block_random_chunk": ("block_random", dict(density=0.1, block_size=64, seed=1), dict(q_len=1000), 8),
}


@pytest.mark.parametrize("case", list(STRUCTURED))
def test_compiled_kernels_with_query_rows_documents_and_kv_heads(case):
    name, fields, structure, kv_heads = STRUCTURED[case]
    pattern = make_pattern(name, N, **structure, **fields)
    check(pattern, FIRST, torch.bfloat16, 128, tolerance_for("bfloat16"), kv_heads=kv_heads)


def test_float32_goes_through_tf32_within_its_tolerance():
    assert get("triton_block_sparse").tf32(Case(dtype="float32", device="cuda"))
    pattern = make_pattern("local", N, window=512)
    check(pattern, FIRST, torch.float32, 64, tolerance_for("float32", tf32=True))


def test_every_candidate_configuration_is_correct():
    """Each tile candidate of each kernel; one the GPU cannot hold (shared memory) must fail to launch,
    never compute wrong numbers, and every kernel keeps at least one candidate that runs."""
    pattern = make_pattern("bigbird", N, **PATTERNS["bigbird"])
    ran, failures = 0, []
    for index in range(len(launch.FWD_CONFIGS)):
        configs = dict(fwd=launch.FWD_CONFIGS[index], dkdv=launch.DKDV_CONFIGS[index], dq=launch.DQ_CONFIGS[index])
        try:
            check(pattern, configs, torch.bfloat16, 128, tolerance_for("bfloat16"), heads=4)
        except AssertionError:  # wrong numbers: a failure whatever the GPU
            raise
        except Exception as exc:  # out of resources on this GPU
            failures.append(f"{index}: {type(exc).__name__}: {exc}")
            continue
        ran += 1
    assert ran, failures
    if torch.cuda.get_device_capability() == (9, 0):  # H100 / H200: every candidate fits (compile_check)
        assert not failures, failures


def test_autotuning_picks_the_fastest_valid_configuration(monkeypatch):
    monkeypatch.setattr(launch, "_TUNED", {})  # tune here, whatever ran before in this process
    impl = get("triton_block_sparse")
    case = Case(batch=1, heads=16, head_dim=64, seq_len=8192, dtype="bfloat16", pattern="block_random",
                density=0.25, block_size=64, mode="fwd_bwd", device="cuda")
    pattern = case.make_pattern()
    q, k, v, grad_out = inputs(case.seq_len, torch.bfloat16, 64, heads=16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    call = impl.prepare(case, pattern, q, k, v)
    extras = impl.record_extras()
    assert extras["interpreter"] is False
    for kernel, candidates in (("fwd", launch.FWD_CONFIGS), ("bwd_dkdv", launch.DKDV_CONFIGS),
                               ("bwd_dq", launch.DQ_CONFIGS)):
        chosen = extras[kernel]
        labels = {c.label: c for c in candidates}
        timings = extras["autotune_ms"][kernel]
        assert set(timings) == set(labels)
        measured = {label: ms for label, ms in timings.items() if isinstance(ms, float)}
        assert measured, timings
        best = min(measured, key=measured.get)
        config = labels[best]
        assert (chosen["block_m"], chosen["block_n"], chosen["num_warps"], chosen["num_stages"]) == (
            config.block_m, config.block_n, config.num_warps, config.num_stages)
    out = call()
    tol = tolerance_for("bfloat16")
    assert compare(out, reference_attention(q.detach(), k.detach(), v.detach(), pattern), tol).passed
    out.backward(grad_out)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize(("pattern_name", "q_len", "heads", "kv_heads"), [
    ("causal", 1, 32, 8),  # Llama-3-8B's decode: 4 query heads packed per KV head
    ("sink", 16, 8, 1),  # a chunk of 16 rows of MQA: 128 packed rows, bitmask-free formula
])
def test_compiled_decode_splits_the_keys_and_matches_the_oracle(pattern_name, q_len, heads, kv_heads):
    n = 65536
    fields = dict(window=4096, global_tokens=4) if pattern_name == "sink" else {}
    case = Case(batch=2, heads=heads, kv_heads=kv_heads, head_dim=128, seq_len=n, q_len=q_len,
                pattern=pattern_name, dtype="bfloat16", device="cuda", **fields)
    pattern = case.make_pattern()
    q, k, v, _ = inputs(n, torch.bfloat16, 128, heads=heads, kv_heads=kv_heads, q_len=q_len)
    q, k, v = (t.expand(2, *t.shape[1:]).contiguous() for t in (q, k, v))
    impl = get("triton_block_sparse")
    out = impl.prepare(case, pattern, q, k, v)()
    extras = impl.record_extras()
    assert extras["path"] == "decode (split keys)" and extras["splits"] > 1, extras
    assert any(isinstance(ms, float) for ms in extras["autotune_ms"]["decode"].values()), extras
    assert compare(out, reference_attention(q, k, v, pattern), tolerance_for("bfloat16")).passed
