"""The reference selectors' float32 fast path is bounded (bench.selection.oracle, [R5 1/6]): where float32's error
could swap what oracle_topk or oracle_topp keeps, the masses are computed again in float64, so both agree with an
all-float64 oracle, on inputs scaled to scores of |s| up to 300 with planted near-ties, a selection per head and
per KV group; without the bound they would not."""

from __future__ import annotations

import math

import pytest
import torch

from bench.patterns import make_pattern
from bench.selection import allowed_units, topk_indices
from bench.selection import oracle as oracle_module
from bench.selection.oracle import _ascending, _top_p, oracle_topk_indices, oracle_topp, unit_masses
from bench.spec.case import Case

N, D, BS = 512, 64, 32


def _inputs(seed: int, heads: int, kv_heads: int, max_score: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (1, H, N, D), k (1, Hkv, N, D) in float32, scaled so that the largest |score| is about `max_score`; each
    odd key block is the even one before it with its keys in another order and every value moved one float32 step
    up or down at random: the two blocks' exact masses differ by about float32's error on a mass at these scores
    (its rounding differs between them), and far more than float64's."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, N, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, kv_heads, N, D, generator=gen, dtype=torch.float64)
    group = heads // kv_heads
    scores = q.view(1, kv_heads, group * N, D) @ k.transpose(-1, -2) / math.sqrt(D)
    scale = math.sqrt(max_score / float(scores.abs().max()))
    q, k = (q * scale).float(), (k * scale).float()
    blocks = k.view(1, kv_heads, N // BS, BS, D)
    odd = blocks[:, :, 0::2][:, :, :, torch.randperm(BS, generator=gen)]
    up = torch.rand(odd.shape, generator=gen) < 0.5
    blocks[:, :, 1::2] = torch.nextafter(odd, torch.where(up, math.inf, -math.inf))
    return q, k


def _float64_topk(q, k, pattern, shared: str, counts: torch.Tensor) -> torch.Tensor:
    allowed = allowed_units(pattern, 1, BS)
    out = []
    for chunk, masses in unit_masses(q, k, pattern, 1, BS, shared, dtype=torch.float64):
        masses = masses.masked_fill(~allowed[chunk], -math.inf)
        out.append(_ascending(topk_indices(masses, counts[chunk].expand(masses.shape[:-1]))))
    return torch.cat(out, dim=2)


def _float64_topp(q, k, pattern, threshold: float) -> torch.Tensor:
    allowed = allowed_units(pattern, BS, BS)
    out = [_top_p(m.masked_fill(~allowed[c], -1.0), threshold)
           for c, m in unit_masses(q, k, pattern, BS, BS, "head", dtype=torch.float64)]
    return torch.cat(out, dim=2)


def _mismatches(got: torch.Tensor, expected: torch.Tensor) -> int:
    """Query units whose kept sets differ."""
    width = max(got.shape[-1], expected.shape[-1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=-1)  # noqa: E731
    sets = lambda t: pad(t).sort(dim=-1).values  # noqa: E731
    return int((sets(got) != sets(expected)).any(dim=-1).sum())


CASES = [("head", 4, 4, 300.0), ("kv_group", 4, 2, 300.0), ("head", 4, 4, 40.0), ("kv_group", 8, 2, 150.0)]


@pytest.mark.parametrize("shared, heads, kv_heads, max_score", CASES)
def test_oracle_topk_agrees_with_the_all_float64_oracle(shared, heads, kv_heads, max_score):
    pattern = make_pattern("dense", N)
    q, k = _inputs(0, heads, kv_heads, max_score)
    counts = torch.full((N,), 3)  # odd: the boundary falls inside a planted pair
    got = oracle_topk_indices(q, k, pattern, 1, BS, shared, counts)
    assert _mismatches(got, _float64_topk(q, k, pattern, shared, counts)) == 0


def test_without_the_bound_float32_would_decide_some_planted_ties(monkeypatch):
    """What the bound is for: with it set to nothing, some rows keep the wrong one of a planted pair."""
    pattern = make_pattern("dense", N)
    q, k = _inputs(0, 4, 4, 300.0)
    counts = torch.full((N,), 3)
    expected = _float64_topk(q, k, pattern, "head", counts)
    monkeypatch.setattr(oracle_module, "mass_error_bound", lambda *args: 0.0)
    assert _mismatches(oracle_topk_indices(q, k, pattern, 1, BS, "head", counts), expected) > 0


@pytest.mark.parametrize("threshold", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("max_score", [40.0, 300.0])
def test_oracle_topp_agrees_with_the_all_float64_oracle(threshold, max_score):
    pattern = make_pattern("causal", N)
    q, k = _inputs(1, 4, 4, max_score)
    case = Case(heads=4, head_dim=D, seq_len=N, pattern="causal", block_size=BS, selector="oracle_topp",
                threshold=threshold)
    assert _mismatches(oracle_topp(q, k, case), _float64_topp(q, k, pattern, threshold)) == 0
