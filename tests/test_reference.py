"""The float64 oracle: textbook attention, chunking invisible, row sampling seeded and bounded."""

from __future__ import annotations

import math

import torch

from bench.measure.oracle import reference
from bench.measure.oracle.reference import compare, reference_attention, rows_to_check, tolerance_for
from bench.patterns import Pattern, make_pattern


def textbook(q, k, v, mask):
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v.double()


def test_oracle_is_textbook_attention():
    pattern = make_pattern("causal_local", 50, window=7)
    q, k, v = torch.randn(3, 2, 3, 50, 8).unbind(0)
    expected = textbook(q, k, v, pattern.dense_mask())
    assert torch.allclose(reference_attention(q, k, v, pattern), expected, rtol=1e-12, atol=1e-12)


def test_chunking_does_not_change_the_result(monkeypatch):
    pattern = make_pattern("random", 70, density=0.2, seed=2)
    q, k, v = torch.randn(3, 1, 2, 70, 8).unbind(0)
    whole = reference_attention(q, k, v, pattern)
    monkeypatch.setattr(reference, "CHUNK_BYTES", 8 * 2 * 70 * 3)  # three rows per chunk
    assert torch.allclose(reference_attention(q, k, v, pattern), whole, rtol=1e-13, atol=1e-13)


def test_rows_subset_matches_full_rows():
    pattern = make_pattern("local", 90, window=10)
    q, k, v = torch.randn(3, 1, 2, 90, 8).unbind(0)
    rows = torch.tensor([0, 5, 44, 89])
    full = reference_attention(q, k, v, pattern)
    assert torch.allclose(reference_attention(q, k, v, pattern, rows), full[:, :, rows])


def test_empty_rows_give_zeros_and_finite_gradients():
    class NoKeys(Pattern):  # a pattern whose odd rows attend to nothing
        name = "no_keys"

        def allowed(self, i, j):
            return (i % 2 == 0) & (j <= i)

    q, k, v = (torch.randn(1, 1, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = reference_attention(q, k, v, NoKeys(6))
    assert torch.all(out[:, :, 1::2] == 0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_row_sampling_is_seeded_bounded_and_keeps_ends():
    assert torch.equal(rows_to_check(1, 1, 100), torch.arange(100))
    big = rows_to_check(1, 8, 16384, seed=3)
    assert big[0] == 0 and big[-1] == 16383
    assert torch.all(big[1:] > big[:-1])
    assert 64 <= len(big) <= 16384 and len(big) * 8 * 16384 <= 2 * reference.FULL_CHECK_LIMIT
    assert torch.equal(big, rows_to_check(1, 8, 16384, seed=3))
    assert not torch.equal(big, rows_to_check(1, 8, 16384, seed=4))


def test_compare_flags_nan_and_tolerances():
    expected = torch.ones(1, 1, 4, 2, dtype=torch.float64)
    bad = torch.ones(1, 1, 4, 2)
    bad[0, 0, 1, 1] = float("nan")
    stats = compare(bad, expected, 1e-4)
    assert not stats.passed and stats.nonfinite == 1 and stats.rel_l2 is None
    assert compare(expected * (1 + 1e-5), expected, 1e-4).passed
    assert not compare(expected * 1.01, expected, 1e-4).passed
    assert tolerance_for("float32") == 1e-4 and tolerance_for("float32", tf32=True) == 2e-3
    assert tolerance_for("float16") == 5e-3 and tolerance_for("bfloat16") == 2e-2

