"""The log-sum-exp merge ring attention relies on: partial attention over disjoint key sets, merged, equals
attention over all of them - empty rows included, where neither the output nor the gradient may be NaN."""

from __future__ import annotations

import pytest
import torch

from bench.measure.oracle.reference import compare, reference_attention
from bench.patterns import make_pattern
from impls.parallel_common import attend, attend_with_lse, merge


@pytest.mark.parametrize("splits", [[37], [10, 27], [5, 0, 16, 16]])
def test_merged_blocks_equal_attention_over_all_keys(splits):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 37, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    pattern = make_pattern("causal_local", 37, window=5)
    mask = pattern.dense_mask()
    mask[7] = False  # a row with no allowed key at all: output 0, gradient 0
    out = lse = None
    start = 0
    for size in splits:
        cols = slice(start, start + size)
        o, l = attend_with_lse(q, k[:, :, cols], v[:, :, cols], mask[:, cols])
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
        start += size
    expected = attend(q, k, v, mask)
    assert compare(out, expected.detach(), 1e-12).passed
    assert torch.all(out[:, :, 7] == 0) and torch.all(torch.isinf(lse[:, :, 7]))
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        assert compare(g, w, 1e-10).passed


def test_attend_matches_the_oracle_in_bfloat16():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 50, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    pattern = make_pattern("local", 50, window=9)
    out = attend(q, k, v, pattern.dense_mask())
    assert out.dtype == torch.bfloat16
    assert compare(out, reference_attention(q, k, v, pattern), 2e-2).passed
