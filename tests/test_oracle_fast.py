"""The oracle selectors made fast (bench.selection.oracle: the keys each chunk may attend to only, probabilities in
place, float64 where float32 leaves a near tie at the budget's boundary) choose what they chose before and what an
exact float64 oracle chooses: on every shape of the selector tests, random and structured inputs, block and per-row
units, two budgets; and a near tie is decided in float64."""

from __future__ import annotations

import math

import pytest
import torch

from bench.selection import oracle
from bench.selection.base import selection_heads
from bench.selection.units import allowed_units, budget_counts, topk_indices
from bench.spec.case import Case
from tests.test_selectors import SHAPES, inputs


def _masses_before(q, k, pattern, q_unit, kv_unit, shared, dtype=torch.float32):
    """The oracle's masses as computed before it was made fast: every key, softmax over the row, then summed."""
    b, h, q_len, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = h // hkv
    q_units, kv_units = math.ceil(q_len / q_unit), math.ceil(n / kv_unit)
    rows = (torch.arange(q_units)[:, None] * q_unit + torch.arange(q_unit)[None, :]).flatten()
    valid = rows < q_len
    rows = rows.clamp(max=q_len - 1)
    mask = pattern.mask(rows[:, None], torch.arange(n)[None, :]) & valid[:, None]
    qg = q[:, :, rows].to(dtype).reshape(b, hkv, group * len(rows), d)
    scores = (qg @ k.to(dtype).transpose(-1, -2) / math.sqrt(d)).view(b, h, len(rows), n)
    probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1).nan_to_num_(0.0)
    probs = torch.nn.functional.pad(probs, (0, kv_units * kv_unit - n))
    per_unit = probs.view(b, h, q_units, q_unit, kv_units, kv_unit).sum(dim=(3, 5))
    h_sel = selection_heads(shared, h, hkv)
    return per_unit.view(b, h_sel, h // h_sel, q_units, kv_units).sum(dim=2)


def _topk_before(q, k, pattern, q_unit, kv_unit, shared, counts, dtype=torch.float32):
    masses = _masses_before(q, k, pattern, q_unit, kv_unit, shared, dtype)
    masses = masses.masked_fill(~allowed_units(pattern, q_unit, kv_unit), -math.inf)
    wanted = counts if counts.dim() > 1 else counts.expand(masses.shape[:-1])
    return topk_indices(masses, wanted.expand(masses.shape[:-1]))


def _as_set(picked):
    """Each row's units ascending, -1 last (topk leaves them by mass)."""
    past = torch.iinfo(picked.dtype).max
    ordered = torch.where(picked < 0, past, picked).sort(dim=-1).values
    return torch.where(ordered == past, -1, ordered)


@pytest.mark.parametrize("budget", [0.125, 0.5])
@pytest.mark.parametrize("kind", ["random", "structured"])
@pytest.mark.parametrize("per_row", [False, True], ids=["blocks", "rows"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_fast_oracle_chooses_what_it_chose_before_and_what_float64_chooses(shape, per_row, kind, budget):
    case = Case(**SHAPES[shape], seed=3)  # type: ignore[arg-type]
    q, k = inputs(case, kind)
    pattern = case.make_pattern()
    q_unit, bs = (1 if per_row else case.block_size), case.block_size
    counts = budget_counts(budget, allowed_units(pattern, q_unit, bs))
    fast = oracle.oracle_topk_indices(q, k, pattern, q_unit, bs, "head", counts)
    before = _topk_before(q, k, pattern, q_unit, bs, "head", counts)
    exact = _topk_before(q, k, pattern, q_unit, bs, "head", counts, torch.float64)
    assert torch.equal(fast, _as_set(exact))  # the oracle lists each set of units in ascending order
    assert torch.equal(fast, _as_set(before))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_fast_masses_equal_the_softmax_masses_within_rounding(shape):
    case = Case(**SHAPES[shape], seed=5)  # type: ignore[arg-type]
    q, k = inputs(case, "random")
    pattern = case.make_pattern()
    masses = torch.cat([m for _, m in oracle.unit_masses(q, k, pattern, case.block_size, case.block_size,
                                                         "kv_group")], dim=2)
    reference = _masses_before(q, k, pattern, case.block_size, case.block_size, "kv_group", torch.float64)
    assert torch.allclose(masses.double(), reference, atol=1e-6, rtol=1e-5)
    # every query unit with keys sums to its rows times its heads: the whole of each row's softmax is counted
    totals = masses.sum(dim=-1)
    assert bool(((totals - totals.round()).abs() < 1e-4).all())


def test_a_near_tie_at_the_boundary_is_found_and_a_clear_choice_is_not():
    masses = torch.tensor([[[[0.5, 0.3, 0.3 - 1e-7, 0.0]], [[0.5, 0.3, 0.1, 0.1]]]])  # (1, 2, 1, 4)
    wanted = torch.tensor([[[2], [2]]])
    ties = oracle._near_ties(masses, wanted, 1e-6)  # each mass within 1e-6 of its exact value
    assert ties.tolist() == [[[True], [False]]]
    assert not oracle._near_ties(masses.masked_fill(torch.arange(4) == 2, -math.inf), wanted, 1e-6).any()
    assert not oracle._near_ties(masses, wanted, 1e-8).any()  # a tighter bound: 1e-7 apart is no tie


def test_a_planted_near_tie_is_decided_by_float64():
    """Key block 1 repeats block 0 but for a hair (1e-9) against the queries, which favour both: float32 sees equal
    masses and keeps block 1 (as the oracle did before); float64 sees block 0 ahead, and so does the oracle now."""
    torch.manual_seed(0)
    case = Case(batch=1, heads=1, head_dim=8, seq_len=64, pattern="causal", block_size=16)
    pattern = case.make_pattern()
    k = torch.randn(1, 1, 64, 8, dtype=torch.float64)
    k[:, :, 16:32] = k[:, :, 0:16]
    q = k[:, :, 0:16].mean(dim=2, keepdim=True) * 4 + 0.1 * torch.randn(1, 1, 64, 8, dtype=torch.float64)
    k[:, :, 16] -= 1e-9 * q[0, 0, 40] / q[0, 0, 40].norm()
    counts = torch.ones(4, dtype=torch.int64)
    exact = _topk_before(q, k, pattern, 16, 16, "head", counts, torch.float64)
    assert exact.flatten().tolist() == [0, 0, 0, 0]
    assert _topk_before(q, k, pattern, 16, 16, "head", counts).flatten().tolist() == [0, 0, 1, 1]  # float32's
    assert torch.equal(oracle.oracle_topk_indices(q, k, pattern, 16, 16, "head", counts), exact)
