"""Patterns: every view agrees exactly with the others and with the table's formula (DESIGN.md)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from bench.patterns import PATTERNS, make_pattern

N_VALUES = [1, 37, 97, 130]
FIELDS = dict(window=12, density=0.3, block_size=16, dilation=3, global_tokens=2, seed=5)


def table_formula(name: str, n: int, f: dict) -> torch.Tensor:
    """The table of DESIGN.md written out pair by pair (deterministic patterns)."""
    w, d, g = f["window"], f["dilation"], f["global_tokens"]
    rule = {
        "dense": lambda i, j: True,
        "causal": lambda i, j: j <= i,
        "local": lambda i, j: abs(i - j) <= w // 2,
        "causal_local": lambda i, j: 0 <= i - j < w,
        "dilated": lambda i, j: abs(i - j) <= w // 2 and (i - j) % d == 0,
        "strided": lambda i, j: i // w == j // w or j % w == w - 1,
        "longformer": lambda i, j: abs(i - j) <= w // 2 or i < g or j < g,
        "axial": lambda i, j: i // w == j // w or i % w == j % w,
    }[name]
    return torch.tensor([[bool(rule(i, j)) for j in range(n)] for i in range(n)], dtype=torch.bool).reshape(n, n)


def fields_for(name: str, n: int) -> dict:
    f = dict(FIELDS)
    if name == "axial":
        f["window"] = next(c for c in range(max(1, math.isqrt(n)), n + 1) if n % c == 0)
    return f


def csr_to_dense(crow: torch.Tensor, col: torch.Tensor, n: int) -> torch.Tensor:
    mask = torch.zeros(n, n, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(n), crow.diff())
    mask[rows, col] = True
    return mask


def layout_from_mask(mask: torch.Tensor, bs: int) -> torch.Tensor:
    n = mask.shape[0]
    nb = -(-n // bs)
    padded = torch.zeros(nb * bs, nb * bs, dtype=torch.bool)
    padded[:n, :n] = mask
    return padded.reshape(nb, bs, nb, bs).any(dim=3).any(dim=1)


DETERMINISTIC = ["dense", "causal", "local", "causal_local", "dilated", "strided", "longformer", "axial"]


def test_table_covers_every_pattern():
    assert set(PATTERNS) == set(DETERMINISTIC) | {"block_random", "bigbird", "random"}


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_views_match_table_formula(name, n):
    f = fields_for(name, n)
    pattern = make_pattern(name, n, **f)
    expected = table_formula(name, n, f)
    assert torch.equal(pattern.dense_mask(), expected)
    crow, col = pattern.csr()
    assert crow.dtype == torch.int64 and col.dtype == torch.int64
    assert torch.equal(csr_to_dense(crow, col, n), expected)
    assert pattern.nnz == int(expected.sum())
    assert pattern.density == int(expected.sum()) / n**2


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_views_agree_with_each_other(name, n):
    pattern = make_pattern(name, n, **fields_for(name, n))
    mask = pattern.dense_mask()
    i = torch.arange(n)
    assert torch.equal(mask, pattern.allowed(i[:, None], i[None, :]))
    crow, col = pattern.csr()
    assert torch.equal(csr_to_dense(crow, col, n), mask)
    for r in range(n):  # columns sorted within each row
        row = col[crow[r] : crow[r + 1]]
        assert torch.all(row[1:] > row[:-1])
    for bs in (1, 7, 16, 64):
        layout = pattern.block_layout(bs)
        assert torch.equal(layout, layout_from_mask(mask, bs))
        assert pattern.block_density(bs) == float(layout.sum()) / layout.numel()


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_block_sparse_view_rebuilds_the_mask(name):
    n, bs = 97, 16
    pattern = make_pattern(name, n, **fields_for(name, n))
    view = pattern.block_sparse(bs)
    mask = pattern.dense_mask()
    rebuilt = torch.zeros(view.num_blocks * bs, view.num_blocks * bs, dtype=torch.bool)
    for r in range(view.num_blocks):
        count = int(view.kv_counts[r])
        assert torch.all(view.kv_indices[r, count:] == -1)
        cols = view.kv_indices[r, :count]
        assert torch.all(cols[1:] > cols[:-1])
        for t in range(count):
            c = int(cols[t])
            full = bool(view.full[r, t])
            block = torch.ones(bs, bs, dtype=torch.bool) if full else view.masks[int(view.mask_index[r, t])]
            rebuilt[r * bs : (r + 1) * bs, c * bs : (c + 1) * bs] = block
    assert torch.equal(rebuilt[:n, :n], mask)
    layout = pattern.block_layout(bs)
    assert torch.equal(view.kv_counts, layout.sum(1).to(torch.int32))


@pytest.mark.parametrize("name", ["random", "block_random", "bigbird"])
def test_random_patterns_depend_only_on_their_seed(name):
    n = 256
    f = dict(FIELDS, global_tokens=0, window=1)
    a = make_pattern(name, n, **f).dense_mask()
    b = make_pattern(name, n, **f).dense_mask()
    c = make_pattern(name, n, **dict(f, seed=6)).dense_mask()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert bool(a.diagonal().all())  # the diagonal (or diagonal blocks) is always kept


def test_random_density_is_near_p():
    n, p = 512, 0.2
    pattern = make_pattern("random", n, density=p, seed=1)
    expected = p + (1 - p) / n  # the diagonal is always kept
    sigma = math.sqrt(p * (1 - p) / (n * n))
    assert abs(pattern.density - expected) < 6 * sigma


def test_block_random_keeps_whole_blocks_with_probability_p():
    n, bs, p = 64 * 40, 64, 0.25
    pattern = make_pattern("block_random", n, density=p, block_size=bs, seed=3)
    layout = pattern.block_layout(bs)
    off_diag = layout[~torch.eye(40, dtype=torch.bool)].float().mean().item()
    assert abs(off_diag - p) < 0.05
    mask = pattern.dense_mask().reshape(40, bs, 40, bs)
    per_block = mask.sum(dim=(1, 3))
    assert set(per_block.unique().tolist()) <= {0, bs * bs}  # kept blocks are whole


def test_large_banded_pattern_views_are_cheap():
    # The views scan only candidate blocks; a dense scan of 65536^2 would not finish in a test.
    pattern = make_pattern("local", 65536, window=256)
    layout = pattern.block_layout(128)
    assert layout.shape == (512, 512)
    assert int(layout.sum()) == 512 * 3 - 2
    assert pattern.nnz == sum(min(65535, i + 128) - max(0, i - 128) + 1 for i in range(65536))


@pytest.mark.parametrize("bad, message", [
    (dict(name="nope"), "unknown pattern 'nope'; known patterns: axial, bigbird"),
    (dict(name="local", window=0), "window: got 0; must be >= 1"),
    (dict(name="random"), "density: not set; pattern random needs a density"),
    (dict(name="axial", window=10), "axial needs seq_len = R*C"),
])
def test_bad_fields_are_named(bad, message):
    name = bad.pop("name")
    with pytest.raises(ValueError, match=re.escape(message)):
        make_pattern(name, 97, **bad)


def test_labels_carry_parameters():
    assert make_pattern("local", 64, window=64).label == "local_w64"
    assert make_pattern("block_random", 64, density=0.1, block_size=64).label == "block_random_p0.1_b64_s0"
