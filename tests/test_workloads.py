"""Every registered implementation against the float64 oracle on the workloads beyond square multi-head attention.

Grouped-query attention (kv_heads < heads, kv_heads 1), decode and chunked prefill (q_len 1, q_len not a
multiple of the block), packed documents (one of length 1; a count), prefix-LM, attention sinks, NATTEN
neighbourhoods on square and non-square images, a custom pattern with empty rows and a FlexAttention
mask_mod - forward and gradients (dq, dk, dv; dk and dv summed over each KV head's query group), through
`bench.api.attention`. An implementation that cannot run a workload says why (`Unavailable`), reported as
a skip with its reason, never as a pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from bench import registry
from bench.api import attention, case_for
from bench.errors import Unavailable
from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.patterns import Pattern, make_pattern, register_mask_mod, register_pattern


@register_pattern
class LocalWithEmptyRows(Pattern):
    """A custom pattern: local, but every third query position attends to nothing (zeros out, zero grad)."""

    name = "test_local_empty_rows"
    fields = ("window",)
    description = "local(W) except positions i % 3 == 0, which see no key"
    length_free = True

    def allowed(self, i, j):
        return ((i - j).abs() <= self.window // 2) & (i % 3 != 0)


def _checker_mask_mod(p):
    """A mask_mod as attention-gym writes them: alternate blocks, plus the diagonal (q_idx is the row)."""
    bs = p.block_size

    def checker(b, h, q_idx, kv_idx):
        return ((q_idx // bs + kv_idx // bs) % 2 == 0) | (q_idx == kv_idx)

    return checker


register_mask_mod("test_checker_mm", _checker_mask_mod, fields=("block_size",))


@dataclass(frozen=True)
class Workload:
    name: str
    pattern: str
    seq_len: int
    heads: int = 4
    kv_heads: int = 2
    q_len: int | None = None
    fields: dict = field(default_factory=dict)
    documents: object = None
    bf16: bool = False  # also in bfloat16

    def make(self):
        fields = dict(window=16, density=0.3, block_size=16, dilation=1, global_tokens=3, seed=5) | self.fields
        return make_pattern(self.pattern, self.seq_len, q_len=self.q_len, documents=self.documents, **fields)


WORKLOADS = [
    Workload("gqa_causal", "causal", 130, bf16=True),
    Workload("mqa_local", "local", 97, heads=3, kv_heads=1),
    Workload("decode", "causal", 257, q_len=1, bf16=True),
    Workload("chunked_prefill", "causal_local", 130, q_len=37),
    Workload("documents_with_one_token", "causal", 130, documents=[1, 40, 89], bf16=True),
    Workload("documents_count_chunk", "local", 97, kv_heads=1, q_len=50, documents=4),
    Workload("prefix_lm", "prefix_lm", 97, fields={"prefix": 20}),
    Workload("sink_chunk", "sink", 130, q_len=33),
    Workload("neighborhood_square", "neighborhood", 100, fields={"window": 5, "image_width": 10}),
    Workload("neighborhood_wide", "neighborhood", 96, kv_heads=4, fields={"window": 5, "image_width": 12},
             bf16=True),
    Workload("block_random_documents", "block_random", 97, kv_heads=1, documents=[50, 47]),
    Workload("custom_empty_rows_gqa", "test_local_empty_rows", 97),
    Workload("mask_mod_chunk", "test_checker_mm", 97, q_len=40),
]
CASES = [(w, dtype) for w in WORKLOADS for dtype in (["float32", "bfloat16"] if w.bf16 else ["float32"])]
IDS = [f"{w.name}-{dtype}" for w, dtype in CASES]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HEAD_DIM = 24


def inputs(w: Workload, pattern, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, w.heads, pattern.q_len, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(2, w.kv_heads, w.seq_len, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _run_or_skip(impl, q, k, v, pattern):
    try:
        return attention(impl, q, k, v, pattern)
    except Unavailable as exc:
        pytest.skip(f"{impl}: {exc.reason}")


IMPLS = registry.names()
GRAD_IMPLS = [name for name in IMPLS if registry.get(name).fwd_bwd]


@pytest.mark.parametrize("workload, dtype", CASES, ids=IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_forward_matches_oracle(impl, workload, dtype):
    pattern = workload.make()
    q, k, v = inputs(workload, pattern, DTYPES[dtype])
    out = _run_or_skip(impl, q, k, v, pattern)
    assert out.shape == q.shape
    tol = tolerance_for(dtype, registry.get(impl).tf32(case_for(q, pattern, k=k)))
    stats = compare(out, reference_attention(q, k, v, pattern), tol)
    assert stats.nonfinite == 0
    assert stats.passed, f"{impl} {workload.name} {dtype}: rel_l2 {stats.rel_l2} > {stats.tolerance}"


@pytest.mark.parametrize("workload, dtype", CASES, ids=IDS)
@pytest.mark.parametrize("impl", GRAD_IMPLS)
def test_gradients_match_oracle(impl, workload, dtype):
    pattern = workload.make()
    q, k, v = (t.requires_grad_() for t in inputs(workload, pattern, DTYPES[dtype]))
    out = _run_or_skip(impl, q, k, v, pattern)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(reference_attention(*leaves, pattern), leaves, grad_out.double())
    tol = tolerance_for(dtype, registry.get(impl).tf32(case_for(q, pattern, k=k)))
    for name, g, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert g.shape == e.shape, f"{impl} {name}: shape {tuple(g.shape)}, expected {tuple(e.shape)}"
        stats = compare(g, e, tol)
        assert stats.passed, f"{impl} {workload.name} {dtype} {name}: rel_l2 {stats.rel_l2} > {tol}"


def test_empty_rows_of_a_custom_pattern_give_zeros():
    w = next(w for w in WORKLOADS if w.name == "custom_empty_rows_gqa")
    pattern = w.make()
    q, k, v = inputs(w, pattern, torch.float32)
    expected = reference_attention(q, k, v, pattern)
    empty = torch.arange(w.seq_len) % 3 == 0
    assert torch.equal(expected[:, :, empty], torch.zeros_like(expected[:, :, empty]))
    for impl in IMPLS:
        try:
            out = attention(impl, q, k, v, pattern)
        except Unavailable:
            continue
        assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty])), impl
