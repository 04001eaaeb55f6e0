"""flex falls back wherever torch.compile fails, with mask_mods that really fail to compile on this torch (2.13,
CPU): attention-gym's dilated sliding window (its predicate fails in Inductor's C++ build; the tabulated lookup
compiles) and block diffusion (the predicate and the table both fail: a LoweringException; FlexAttention then runs
uncompiled), at q_len < seq_len; and over a block selection, its prefix LM (uncompiled). Each output equals
the float64 oracle's and the record's config says which path ran and why."""

from __future__ import annotations

import pytest
import torch

import impls.flex as flex_module
from bench.measure.oracle.reference import reference_attention
from bench.patterns import make_pattern, register_mask_mod
from bench.selection import Selection
from bench.spec.case import Case

masks = pytest.importorskip("attn_gym.masks", reason="attention-gym is in the test extra")
from attn_gym.masks.block_diffusion import generate_block_diffusion_mask  # noqa: E402

register_mask_mod("test_agym_dilated", lambda p: masks.generate_dilated_sliding_window(p.window, p.dilation),
                  fields=("window", "dilation"))
register_mask_mod("test_agym_prefix_lm", lambda p: masks.generate_prefix_lm_mask(p.prefix), fields=("prefix",))
register_mask_mod("test_agym_block_diffusion", lambda p: generate_block_diffusion_mask(p.seq_len // 2, 32),
                  fields=())

SHAPE = {"seq_len": 200, "q_len": 77, "heads": 2, "head_dim": 16, "block_size": 64, "device": "cpu"}


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, case.heads, case.n_queries, case.head_dim, generator=gen)
    k, v = (torch.randn(1, case.heads, case.seq_len, case.head_dim, generator=gen) for _ in range(2))
    return q, k, v


def _close_to_oracle(out: torch.Tensor, q, k, v, pattern) -> None:
    rows = torch.arange(pattern.q_len)
    expected = reference_attention(q.double(), k.double(), v.double(), pattern, rows)
    assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_predicate_inductor_cannot_build_falls_back_to_the_table():
    case = Case(pattern="test_agym_dilated", window=33, dilation=2, **SHAPE)
    pattern = case.make_pattern()
    q, k, v = _inputs(case)
    impl = flex_module.Flex()
    call = impl.prepare(case, pattern, q, k, v)
    _close_to_oracle(call(), q, k, v, pattern)
    # the table compiles on its own; after other cases' graphs in the same process Inductor has failed on it too,
    # and FlexAttention then ran uncompiled: either way the record names the path and the predicate's failure
    tabulated = impl._extras["mask_mod"].startswith("tabulated (the predicate did not compile: ")
    uncompiled = str(impl._extras["compiled"]).startswith("uncompiled (torch.compile failed: predicate: ")
    assert tabulated != uncompiled, impl._extras
    _close_to_oracle(call(), q, k, v, pattern)  # decided once: the second call takes the same path


def test_where_the_table_fails_too_flexattention_runs_uncompiled_and_says_why():
    case = Case(pattern="test_agym_block_diffusion", **SHAPE)
    pattern = case.make_pattern()
    q, k, v = _inputs(case)
    impl = flex_module.Flex()
    call = impl.prepare(case, pattern, q, k, v)
    _close_to_oracle(call(), q, k, v, pattern)
    compiled = impl._extras["compiled"]
    assert compiled.startswith("uncompiled (torch.compile failed: predicate: "), compiled
    assert "tabulated: " in compiled and impl._extras["mask_mod"] == "predicate"


def test_a_selection_whose_mask_mod_does_not_compile_runs_uncompiled():
    # attention-gym's prefix LM under a block selection at q_len < seq_len: Inductor's C++ build fails
    case = Case(pattern="test_agym_prefix_lm", prefix=40, **SHAPE)
    pattern = case.make_pattern()
    q, k, v = _inputs(case)
    # every allowed key block for every query block: the selection's attention is the base pattern's
    layout = pattern.block_layout(64)
    indices = torch.full((1, 1, *layout.shape), -1, dtype=torch.int32)
    for qb in range(layout.shape[0]):
        kept = torch.nonzero(layout[qb]).flatten()
        indices[0, 0, qb, : len(kept)] = kept.to(torch.int32)
    selection = Selection(indices.expand(1, case.heads, *layout.shape).contiguous(), 64, 64, "head")
    impl = flex_module.Flex()
    attend = impl.prepare_selected(case, pattern, q, k, v)
    _close_to_oracle(attend(selection), q, k, v, pattern)
    assert impl._extras["compiled"].startswith("uncompiled (torch.compile failed: predicate: "), impl._extras
    _close_to_oracle(attend(selection), q, k, v, pattern)


def test_the_tabulated_mask_mod_is_the_patterns_matrix():
    pattern = make_pattern("test_agym_dilated", 200, q_len=77, window=33, dilation=2)
    mask_mod = flex_module.tabulated_mask_mod(pattern, 64, torch.device("cpu"))
    rows, cols = torch.arange(77)[:, None], torch.arange(200)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    assert torch.equal(mask_mod(zero, zero, rows, cols), pattern.dense_mask())
