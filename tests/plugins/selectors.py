"""Test selectors: seeded random selections of every unit and sharing, and selectors whose output is invalid."""

from __future__ import annotations

import math

import torch

from bench.selection import allowed_units, budget_counts, register_selector, selection_heads, topk_indices, unit_size


def _random(q, k, case, q_unit: str, kv_unit: str, shared: str):
    """`budget` units drawn per query unit among those the base pattern allows, seeded by the case."""
    qu = unit_size(q_unit, case.block_size)
    ku = unit_size(kv_unit, case.block_size, getattr(case, "page_size", None))
    allowed = allowed_units(case.make_pattern(), qu, ku)  # (U, KU)
    counts = budget_counts(case.budget, allowed)
    h_sel = selection_heads(shared, q.shape[1], k.shape[1])
    gen = torch.Generator().manual_seed(case.seed + 11)
    scores = torch.rand(q.shape[0], h_sel, *allowed.shape, generator=gen)
    return topk_indices(scores.masked_fill(~allowed, -math.inf), counts)


@register_selector("test_blocks", q_unit="block", kv_unit="block", shared="head")
def test_blocks(q, k, case):
    return _random(q, k, case, "block", "block", "head")


@register_selector("test_rows", q_unit="row", kv_unit="block", shared="kv_group")
def test_rows(q, k, case):
    return _random(q, k, case, "row", "block", "kv_group")


@register_selector("test_tokens", q_unit="row", kv_unit="token", shared="all")
def test_tokens(q, k, case):
    return _random(q, k, case, "row", "token", "all")


@register_selector("test_pages", q_unit="row", kv_unit="page", shared="head")
def test_pages(q, k, case):
    return _random(q, k, case, "row", "page", "head")


@register_selector("test_row_heads", q_unit="row", kv_unit="block", shared="head")
def test_row_heads(q, k, case):
    return _random(q, k, case, "row", "block", "head")


@register_selector("bad_range", q_unit="block", kv_unit="block", shared="head")
def bad_range(q, k, case):
    out = _random(q, k, case, "block", "block", "head")
    out[0, 1, 2, 0] = 10_000
    return out


@register_selector("bad_duplicate", q_unit="block", kv_unit="block", shared="head")
def bad_duplicate(q, k, case):
    out = _random(q, k, case, "block", "block", "head")
    out[0, 0, -1, 1] = out[0, 0, -1, 0]
    return out


@register_selector("bad_shape", q_unit="block", kv_unit="block", shared="head")
def bad_shape(q, k, case):
    return _random(q, k, case, "block", "block", "head")[:, :1]
