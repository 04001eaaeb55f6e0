"""triton_block_sparse on CPU: lookup tables against the pattern exactly, tile configurations, and the kernels
(through the Triton interpreter) against the float64 oracle, forward and gradients.

The conformance test already runs this implementation with its interpreter configuration; here the kernels
run with small asymmetric tiles (many tiles, partial ones at the sequence end), with every GPU candidate tile
shape, on a pattern with empty rows, with grouped-query heads, fewer query rows than keys (decode, chunked
prefill) and packed documents, and through the measuring worker's code path. GPU-only checks are in
test_triton_block_sparse_gpu.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.measure.pair import CaseCache, Task, measure_task
from bench.patterns import Pattern, make_pattern
from bench.registry import get
from bench.run.console import summary_table
from bench.spec.case import Case
from impls.triton_block_sparse import decode, launch, mode, tables
from impls.triton_block_sparse.launch import TileConfig
from tests.conftest import ROOT
from tests.pattern_zoo import BUILTIN, valid_fields

FIELDS = dict(window=12, density=0.3, block_size=16, dilation=3, global_tokens=2, seed=5)
N = 75  # a multiple of no tile side: every kernel meets partial tiles at the end of the sequence
CPU_ONLY = pytest.mark.skipif(not mode.uses_interpreter(),
                              reason="this process runs compiled kernels; these tests use the interpreter "
                                     "(run them on CPU or with TRITON_INTERPRET=1)")


def pattern_for(name: str, n: int = N, **structure) -> Pattern:
    """Built-in pattern `name` over n tokens with FIELDS, made valid (axial and neighborhood need n = R*C);
    `structure`: q_len, documents."""
    return make_pattern(name, n, **structure, **valid_fields(name, n, **FIELDS))


# --- lookup tables --------------------------------------------------------------------------------------


# --- configurations -------------------------------------------------------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**base, "PYTHONPATH": str(ROOT), **env})


RUN_ONE_FORWARD = """
import torch
from bench.patterns import make_pattern
from impls.triton_block_sparse import launch
pattern = make_pattern("local", 40, window=8)
q = torch.randn(1, 1, 40, 16)
plan = launch.plan_attention(pattern, q, q, q, needs_grad=False)
print(launch.BlockSparseAttention.apply(q, q, q, plan).shape)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")
def test_interpreter_mode_is_chosen_before_anything_imports_triton():
    """Triton fixes its library functions' mode when first imported: importing impls first must make a later
    triton import (FlexAttention's compiler, the environment capture) an interpreter-mode one."""
    proc = _python("import impls\nimport triton.language as tl\nprint(type(tl.zeros).__name__)" + RUN_ONE_FORWARD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "InterpretedFunction" in proc.stdout and "torch.Size([1, 1, 40, 16])" in proc.stdout
    from bench.measure.machine.env import capture

    assert capture("cpu").versions.triton  # from package metadata, without importing triton


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")
def test_triton_imported_first_in_compiled_mode_is_a_clear_error():
    proc = _python("import triton.language\n" + RUN_ONE_FORWARD)
    assert proc.returncode != 0
    assert "imported in this process before TRITON_INTERPRET=1 was set" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_every_candidate_compiles_for_hopper():
    """Ahead-of-time compilation to a cubin for sm_90 (no GPU needed): every kernel and tile candidate,
    bitmask variant (the largest), each score modification, head_dim 128, within the per-block shared memory of
    H100/H200."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")  # fusion on: Triton 3.9's default, stated
    proc = subprocess.run([sys.executable, "-m", "impls.triton_block_sparse.compile_check", "--arch", "90",
                           "--head-dim", "128", "--dtype", "bfloat16"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    # every candidate without a score modification, with softcap and with a bias table; the decode kernel's
    # without and with softcap, for 16 and 128 packed rows; the two small kernels
    expected = 2 + 3 * (len(launch.FWD_CONFIGS) + len(launch.DKDV_CONFIGS) + len(launch.DQ_CONFIGS))
    expected += 2 * 2 * len(decode.DECODE_CONFIGS)
    assert len(results) == expected
    for r in results:
        assert r["ok"] and r["has_cubin"], r
        assert r["shared"] > 0, r
        if r["mod_kind"] == 0 and r["kernel"] != "attn_fwd_decode":  # every prefill candidate fits H100/H200
            assert r["shared"] <= r["shared_limit"], r
    # 128 packed rows on 128-key tiles outgrow it (the tuner skips a candidate that does not launch): each packed
    # size keeps a candidate that fits, with and without softcap
    decode_runs = [r for r in results if r["kernel"] == "attn_fwd_decode"]
    for mod in (0, 1):
        for packed in (16, decode.DECODE_MAX_PACKED):
            assert any(r["shared"] <= r["shared_limit"] for r in decode_runs
                       if r["mod_kind"] == mod and r["packed_rows"] == packed), (mod, packed)
    # a bias table takes shared memory too (m128n128 forward: 288 KiB): the tuner skips a candidate the card cannot
    # hold (launch._tune_candidates), so each kernel needs at least one that fits, for each modification
    for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"):
        for mod in (1, 2):
            fits = [r for r in results if r["kernel"] == kernel and r["mod_kind"] == mod
                    and r["shared"] <= r["shared_limit"]]
            assert fits, (kernel, mod)


# --- kernels against the oracle (interpreter) ---------------------------------------------------------

SMALL = dict(fwd=TileConfig(32, 16, 4, 1), dkdv=TileConfig(16, 32, 4, 1), dq=TileConfig(32, 16, 4, 1))


def check_against_oracle(pattern: Pattern, plan_configs: dict, dtype: torch.dtype, head_dim: int,
                         batch: int = 1, heads: int = 2, kv_heads: int | None = None) -> tuple:
    """Output and gradients against the float64 oracle: q (B, H, q_len, D), k and v (B, Hkv, N, D).
    Returns the output and the gradients (dq, dk, dv)."""
    hkv = heads if kv_heads is None else kv_heads
    gen = torch.Generator().manual_seed(3)
    q, grad_out = (torch.randn(batch, heads, pattern.q_len, head_dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(batch, hkv, pattern.seq_len, head_dim, generator=gen).to(dtype) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    plan = launch.plan_with_configs(pattern, q, plan_configs["fwd"], plan_configs["dkdv"], plan_configs["dq"], k)
    out = launch.BlockSparseAttention.apply(q, k, v, plan)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, pattern)
    expected = torch.autograd.grad(ref, leaves, grad_out.double())
    tol = tolerance_for({torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype])
    for name, a, e in [("out", out, ref), *zip(("dq", "dk", "dv"), got, expected, strict=True)]:
        assert a.shape == e.shape, (name, a.shape, e.shape)
        stats = compare(a, e, tol)
        assert stats.passed, f"{pattern!r} {dtype} D={head_dim} {name}: rel_l2 {stats.rel_l2} > {tol}"
    return out, got


@CPU_ONLY
@pytest.mark.parametrize("head_dim", [16, 80])  # exact, and padded to 128 inside the kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("pattern_name", BUILTIN)
def test_kernels_match_oracle_with_small_tiles(pattern_name, dtype, head_dim):
    check_against_oracle(pattern_for(pattern_name), SMALL, dtype, head_dim)


# (pattern, structure, heads, kv_heads): formulas over offset rows, bitmasks, decode, documents, GQA and MQA.
STRUCTURED_CASES = [
    ("causal", dict(q_len=37), 4, 2),
    ("causal_local", dict(q_len=1), 3, 1),  # decode: one query row
    ("local", dict(q_len=37), 4, 4),
    ("dilated", dict(q_len=50), 2, 1),
    ("longformer", dict(q_len=37), 4, 2),  # global rows: positions < g lie before the queries
    ("prefix_lm", dict(q_len=60), 4, 2),
    ("sink", dict(q_len=33), 4, 1),
    ("strided", dict(q_len=37), 2, 2),
    ("axial", dict(q_len=37), 4, 2),
    ("block_random", dict(q_len=43), 4, 2),  # tiles larger than the pattern's blocks: bitmasks
    ("bigbird", dict(q_len=37), 4, 2),
    ("random", dict(q_len=1), 2, 1),
    ("neighborhood", dict(q_len=40), 4, 2),
    ("causal", dict(q_len=50, documents=[1, 30, 44]), 4, 1),
    ("local", dict(documents=4), 4, 2),
]


@CPU_ONLY
@pytest.mark.parametrize("pattern_name, structure, heads, kv_heads", STRUCTURED_CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items())}-h{c[2]}kv{c[3]}"
                              for c in STRUCTURED_CASES])
def test_kernels_with_query_rows_documents_and_kv_heads(pattern_name, structure, heads, kv_heads):
    pattern = pattern_for(pattern_name, **structure)
    out, _ = check_against_oracle(pattern, SMALL, torch.float32, 16, batch=2, heads=heads, kv_heads=kv_heads)
    assert out.shape == (2, heads, pattern.q_len, 16)


@CPU_ONLY
def test_gqa_gradients_are_deterministic_sums_over_the_group():
    """dK/dV of a KV head sum its query heads in one program, in a fixed order: bitwise equal across runs,
    and the sum of what each query head alone (as its own KV head) would give."""
    pattern = pattern_for("causal", q_len=50)
    first = check_against_oracle(pattern, SMALL, torch.float32, 16, heads=4, kv_heads=2)
    second = check_against_oracle(pattern, SMALL, torch.float32, 16, heads=4, kv_heads=2)
    for a, b in zip((first[0], *first[1]), (second[0], *second[1]), strict=True):
        assert torch.equal(a, b)
    gen = torch.Generator().manual_seed(4)
    q, grad_out = (torch.randn(1, 4, 50, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, N, 16, generator=gen).requires_grad_() for _ in range(2))
    plan = launch.plan_with_configs(pattern, q, **SMALL)
    dk, dv = torch.autograd.grad(launch.BlockSparseAttention.apply(q, k, v, plan), (k, v), grad_out)
    k_rep, v_rep = (t.detach().repeat_interleave(2, dim=1).requires_grad_() for t in (k, v))
    dk_rep, dv_rep = torch.autograd.grad(launch.BlockSparseAttention.apply(q, k_rep, v_rep, plan), (k_rep, v_rep),
                                         grad_out)
    assert torch.allclose(dk, dk_rep.view(1, 2, 2, N, 16).sum(2), atol=1e-5)
    assert torch.allclose(dv, dv_rep.view(1, 2, 2, N, 16).sum(2), atol=1e-5)


@CPU_ONLY
def test_plan_says_rows_keys_and_group_and_checks_shapes():
    pattern = pattern_for("sink", q_len=33)
    q = torch.randn(1, 4, 33, 16)
    k = torch.randn(1, 2, N, 16)
    plan = launch.plan_with_configs(pattern, q, **SMALL, k=k)
    info = plan.describe()
    assert (info["q_len"], info["seq_len"], info["kv_group"]) == (33, N, 2)
    assert (info["fwd"]["query_tiles"], info["fwd"]["key_tiles"]) == (math.ceil(33 / 32), math.ceil(N / 16))
    assert (info["bwd_dkdv"]["query_tiles"], info["bwd_dkdv"]["key_tiles"]) == (math.ceil(33 / 16), math.ceil(N / 32))
    assert info["fwd"]["mask"] == "band"
    with pytest.raises(ValueError, match="33 query rows over 75 keys"):
        launch.BlockSparseAttention.apply(torch.randn(1, 4, 34, 16), k, k, plan)


@CPU_ONLY
@pytest.mark.parametrize("q_len", [None, 43], ids=["square", "rows43"])  # 43 rows: row 0 is position 32
@pytest.mark.parametrize("pattern_name, kind", [("block_random", "bounds"), ("bigbird", "band")])
def test_random_blocks_aligned_with_tiles_use_formula_masks(pattern_name, kind, q_len):
    """16-tiles over the pattern's 16-blocks: kept random blocks are whole tiles, the rest a formula."""
    configs = dict(fwd=TileConfig(16, 16, 4, 1), dkdv=TileConfig(16, 16, 4, 1), dq=TileConfig(16, 16, 4, 1))
    pattern = pattern_for(pattern_name, q_len=q_len)
    assert tables.mask_spec(pattern, [(16, 16)]).name == kind
    check_against_oracle(pattern, configs, torch.float32, 32, heads=2, kv_heads=1)


@CPU_ONLY
@pytest.mark.parametrize("index", range(3))
def test_gpu_candidate_tiles_are_correct_in_the_interpreter(index):
    """The GPU's tile shapes (up to 128, bitmasks where block_random's 64-blocks do not align)."""
    configs = dict(fwd=launch.FWD_CONFIGS[index], dkdv=launch.DKDV_CONFIGS[index], dq=launch.DQ_CONFIGS[index])
    pattern = make_pattern("bigbird", 200, window=40, global_tokens=3, density=0.2, block_size=64, seed=1)
    check_against_oracle(pattern, configs, torch.float16, 64, heads=1)


class LateCausal(Pattern):
    """Not in the table: rows before `start` may attend to nothing (irregular, so bitmasks)."""

    name = "late_causal"
    start = 20

    def allowed(self, i, j):
        return (j <= i) & (i >= self.start)


@CPU_ONLY
def test_rows_without_keys_give_zero_output_and_gradient():
    pattern = LateCausal(N)
    assert tables.mask_spec(pattern, [(32, 16)]).name == "bitmask"
    check_against_oracle(pattern, SMALL, torch.float32, 32)
    q, k, v = (torch.randn(1, 2, N, 32, requires_grad=True) for _ in range(3))
    out = launch.BlockSparseAttention.apply(q, k, v, launch.plan_with_configs(pattern, q, **SMALL))
    out.sum().backward()
    assert out[:, :, : LateCausal.start].abs().max() == 0
    assert q.grad[:, :, : LateCausal.start].abs().max() == 0
    assert out[:, :, LateCausal.start :].abs().amax(dim=-1).min() > 0  # every row with keys has an output


@CPU_ONLY
def test_non_contiguous_inputs():
    """q, k, v as views of a (B, N, H, D) tensor: strides are passed to the kernels, not copied away."""
    pattern = pattern_for("local")
    base = torch.randn(1, N, 2, 3, 32)  # (B, N, H, qkv, D)
    q, k, v = (base[:, :, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D) views
    assert not q.is_contiguous()
    plan = launch.plan_with_configs(pattern, q, SMALL["fwd"])
    out = launch.BlockSparseAttention.apply(q, k, v, plan)
    assert compare(out, reference_attention(q, k, v, pattern), 1e-4).passed


@CPU_ONLY
def test_non_contiguous_grouped_inputs_with_fewer_query_rows():
    """GQA from packed projections: q the last 40 rows of a (B, N, H, D) view, k and v of a (B, N, Hkv, 2, D)
    one; the kernels read KV head h // G through the strides."""
    pattern = pattern_for("causal_local", q_len=40)
    q = torch.randn(2, N, 4, 32)[:, -40:].transpose(1, 2)
    kv = torch.randn(2, N, 2, 2, 32)
    k, v = (kv[:, :, :, i].transpose(1, 2) for i in range(2))
    assert not (q.is_contiguous() or k.is_contiguous())
    plan = launch.plan_with_configs(pattern, q, SMALL["fwd"])
    out = launch.BlockSparseAttention.apply(q, k, v, plan)
    assert out.shape == (2, 4, 40, 32)
    assert compare(out, reference_attention(q, k, v, pattern), 1e-4).passed


# --- the implementation in the harness --------------------------------------------------------------------

@CPU_ONLY
def test_record_says_interpreter_and_carries_the_config():
    case = Case(batch=1, heads=2, head_dim=32, seq_len=90, pattern="block_random", density=0.3, block_size=32,
                mode="fwd_bwd", device="cpu")
    task = Task.of(case, "triton_block_sparse",
                {"warmup": 0, "repeat": 1, "max_time_s": 0.01, "check": True})
    record = measure_task(task, CaseCache())
    assert record.status == "ok", (record.reason, record.details)
    assert record.interpreter is True
    config = record.config
    assert config["interpreter"] is True
    tile = launch.INTERPRETER_CONFIG
    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        assert (config[kernel]["block_m"], config[kernel]["block_n"]) == (tile.block_m, tile.block_n)
        assert config[kernel]["mask"] == "bitmask"  # tiles over several 32-blocks: irregular inside a tile
    case_tiles = make_pattern("block_random", 90, density=0.3, block_size=32).block_layout(tile.block_m)
    assert config["fwd"]["tiles_full"] + config["fwd"]["tiles_partial"] == int(case_tiles.sum())
    assert record.error.rel_l2 <= record.error.tolerance == 1e-4
    table = summary_table([record], {case.case_id: case.label}, ["triton_block_sparse"])
    assert "Triton interpreter on CPU" in str(table.caption)


def test_unsupported_cases_say_why(monkeypatch):
    impl = get("triton_block_sparse")
    assert "head_dim 16..128 (got 8)" in impl.unsupported(Case(head_dim=8, device="cpu"))
    assert "head_dim 16..128 (got 256)" in impl.unsupported(Case(head_dim=256, device="cpu"))
    assert "at most 65535" in impl.unsupported(Case(batch=2, heads=40000, device="cpu"))
    monkeypatch.setattr(mode, "uses_interpreter", lambda: False)
    assert "TRITON_INTERPRET=1" in impl.unsupported(Case(device="cpu"))
    assert impl.unsupported(Case(device="cuda", dtype="bfloat16")) is None
    assert impl.tf32(Case(device="cuda", dtype="float32")) is True
    assert impl.tf32(Case(device="cuda", dtype="bfloat16")) is False


@CPU_ONLY
def test_without_cuda_the_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    module = mode.kernels()
    assert isinstance(module.attn_fwd, InterpretedFunction)
    assert os.environ.get("TRITON_INTERPRET") == "1"
