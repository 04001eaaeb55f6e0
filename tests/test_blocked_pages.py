"""blocked over page selections (impls/blocked/pages.py: Quest's pages per row and query head): in inference each
(row, head) a paged decode over its pages, the contiguous cache read as the page pool; elsewhere the pages' tokens
through the token paths. Against the float64 oracle under the selection and the base pattern."""

from __future__ import annotations

import pytest
import torch

from bench.measure.case.case_cache import CaseCache
from bench.measure.oracle.reference import reference_attention
from bench.measure.pair import Task, measure_task
from bench.patterns import make_pattern
from bench.selection import Selection, effective_mask
from bench.spec.case import Case
from impls.blocked.pages import page_rows_attention, page_rows_unavailable, tokens_of_pages

QUICK = {"warmup": 0, "repeat": 1, "max_time_s": 0.001, "memory": "worker"}


def _page_selection(b: int, heads: int, nq: int, pages: int, kept: int, seed: int) -> Selection:
    """Random pages per (row, head), some in the future of a causal row, -1 in the middle, a row with none."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.argsort(torch.rand(b, heads, nq, pages, generator=gen), dim=-1)[..., :kept]
    idx[..., 1] = -1
    idx[:, 1, 6, :] = -1  # head 1, row 6: nothing kept
    return Selection(idx.to(torch.int32), 1, 16, "head")


def _visible_pages_first(b: int, heads: int, nq: int, q_offset: int, pages: int, kept: int, seed: int
                         ) -> Selection:
    """Each (head, row)'s visible pages in random order (its own page among them, or left out where more are
    visible than it keeps), -1 after them: kept entries first but unsorted, as Quest's top-k leaves them."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((b, heads, nq, kept), -1, dtype=torch.int32)
    for r in range(nq):
        for head in range(heads):
            chosen = torch.randperm(min((q_offset + r) // 16 + 1, pages), generator=gen)[:kept]
            idx[:, head, r, : len(chosen)] = chosen.to(torch.int32)
    idx[:, 1, 6, :] = -1
    return Selection(idx, 1, 16, "head")


@pytest.mark.parametrize("layout", ["gaps_and_future_pages", "visible_pages_first"])
@pytest.mark.parametrize("base", ["causal", "causal_chunk", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_as_paged_decodes_match_the_oracle(base, dtype, layout):
    """Pages past a causal row dropped, the row's own page cut at its position (q_len < N: chunked prefill
    positions), GQA (each query head its own pages, reading its KV head's), a row that keeps nothing; selections
    with -1 and future pages among the kept (left out) and selections whose pages come first in any order (kept
    as they are, the row's own page moved last)."""
    gen = torch.Generator().manual_seed(3)
    b, h, hkv, n, d = 2, 4, 2, 96, 32
    nq = 40 if base == "causal_chunk" else n
    pattern = make_pattern("dense" if base == "dense" else "causal", n, q_len=nq)
    q = torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    if layout == "gaps_and_future_pages":
        selection = _page_selection(b, h, nq, n // 16, 3, seed=4)
    else:
        selection = _visible_pages_first(b, h, nq, n - nq if base != "dense" else n, n // 16, 3, seed=4)
    q_, k_, v_ = (t.to(dtype) for t in (q, k, v))
    assert page_rows_unavailable(selection, pattern, q_, k_, "fwd") is None
    out, lse = page_rows_attention(selection, pattern, q_, k_, v_, d ** -0.5)
    allowed = lambda r: effective_mask(selection, pattern, r, h, hkv)  # noqa: E731
    reference = reference_attention(q_.double(), k_.double(), v_.double(), pattern, extra_mask=allowed)
    assert float((out.double() - reference).abs().max()) < (1e-5 if dtype == torch.float32 else 2e-2)
    assert out[:, 1, 6].abs().max() == 0 and bool(torch.isinf(lse[:, 1, 6]).all())  # nothing kept: zero, -inf
    scores = (q.double() @ k.double().repeat_interleave(h // hkv, dim=1).transpose(-1, -2)) * d ** -0.5
    exact_lse = torch.logsumexp(scores.masked_fill(~allowed(torch.arange(nq)), float("-inf")), dim=-1)
    finite = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert float((lse.double()[finite] - exact_lse[finite]).abs().max()) < (1e-4 if dtype == torch.float32 else 3e-2)


def test_patterns_the_page_path_cannot_cut_go_through_the_pages_tokens():
    q = torch.zeros(1, 2, 64, 32)
    k = torch.zeros(1, 2, 64, 32)
    selection = _page_selection(1, 2, 64, 4, 2, seed=0)
    local = make_pattern("local", 64, window=16)
    assert "local" in page_rows_unavailable(selection, local, q, k, "fwd")
    assert "inference only" in page_rows_unavailable(selection, make_pattern("causal", 64), q, k, "fwd_bwd")
    ragged = torch.zeros(1, 2, 60, 32)
    assert "whole number of pages" in page_rows_unavailable(selection, make_pattern("causal", 60), q[:, :, :60],
                                                            ragged, "fwd")
    tokens = tokens_of_pages(Selection(torch.tensor([[[[3, -1, 0]]]], dtype=torch.int32), 1, 16, "all"), 60)
    assert tokens.kv_unit == 1
    assert tokens.indices[0, 0, 0].tolist() == [*range(48, 60), *[-1] * 4, *[-1] * 16, *range(16)]


@pytest.mark.parametrize("pattern, mode, path", [("causal", "fwd", "page_rows"), ("local", "fwd", "token_union"),
                                                 ("causal", "fwd_bwd", "token_union")])
def test_quest_through_blocked_matches_the_oracle(pattern, mode, path):
    case = Case(seq_len=256, heads=4, kv_heads=2, head_dim=32, block_size=64, pattern=pattern, selector="quest",
                budget=0.25, dtype="float32", mode=mode, device="cpu", **({"window": 64} if pattern == "local" else {}))
    record = measure_task(Task.of(case, "blocked", QUICK), CaseCache())
    assert record.status == "ok", record.reason
    assert record.config is not None and record.config["path"] == path
    assert record.error is not None and record.error.ratio is not None and record.error.ratio <= 2.0, record.error
