"""blocked over token selections (impls/blocked/tokens.py: DSA's per-row top tokens): in inference each row read
as a decode step over its own tokens (the decode kernel given their rows); else the union of a tile's rows' tokens
gathered once, each row masked to its own. Against the float64 oracle under the selection, forward and
backward, float32 and bfloat16 (within twice the same-dtype reference), GQA and fewer query rows than keys,
selections per query head and shared, rows that keep nothing."""

from __future__ import annotations

import pytest
import torch

from bench import api
from bench.measure.case.case_cache import CaseCache
from bench.measure.oracle.reference import compare, reference_attention
from bench.measure.pair import Task, measure_task
from bench.patterns import make_pattern
from bench.selection import Selection, effective_mask
from bench.spec.case import Case
from impls.blocked.tokens import _tile_tokens

QUICK = {"warmup": 0, "repeat": 1, "max_time_s": 0.001, "memory": "worker"}
SHAPES = {"gqa_causal_n300": dict(seq_len=300, heads=4, kv_heads=2),
          "chunk_q77_n257": dict(seq_len=257, q_len=77, heads=6, kv_heads=3)}


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_dsa_through_the_token_path_matches_the_oracle(shape, dtype, mode):
    case = Case(head_dim=32, block_size=32, pattern="causal", selector="dsa", budget=0.125, dtype=dtype, mode=mode,
                device="cpu", **SHAPES[shape])
    record = measure_task(Task.of(case, "blocked", QUICK), CaseCache())
    assert record.status == "ok", record.reason
    # inference reads each row as a decode step over its tokens; training goes through the torch ops
    assert record.config is not None and record.config["path"] == ("token_rows" if mode == "fwd" else "token_union")
    error = record.error
    assert error is not None and error.ratio is not None and error.ratio <= 2.0, error
    if mode == "fwd_bwd":
        assert error.grads is not None and all(g.ratio is not None and g.ratio <= 2.0 for g in error.grads.values())


def test_per_head_token_selections_and_rows_that_keep_nothing():
    gen = torch.Generator().manual_seed(0)
    pattern = make_pattern("causal", 96, q_len=40)
    q = torch.randn(1, 4, 40, 16, generator=gen)
    k, v = (torch.randn(1, 2, 96, 16, generator=gen) for _ in range(2))
    idx = torch.argsort(torch.rand(1, 4, 40, 96, generator=gen), dim=-1)[..., :6].sort(dim=-1).values
    idx[:, 1, 5] = -1  # head 1, row 5: nothing kept
    selection = Selection(idx.to(torch.int32), 1, 1, "head")
    out = api.attention("blocked", q, k, v, pattern, selection, block_size=16)
    expected = reference_attention(q, k, v, pattern, extra_mask=lambda r: effective_mask(selection, pattern, r, 4, 2))
    assert compare(out, expected, 1e-4).passed
    assert out[0, 1, 5].abs().max() == 0  # a row with no allowed key: zero, as the oracle


def test_the_union_lists_each_kept_token_once_and_says_which_row_kept_it():
    kept = torch.tensor([[5, 2, -1], [2, 9, 7], [-1, -1, -1]])
    union, member = _tile_tokens(kept, 10)
    assert union.tolist() == [2, 5, 7, 9]
    assert member.tolist() == [[True, True, False, False], [True, False, True, True], [False] * 4]


@pytest.mark.parametrize("union_factor", [0.0, 1e9], ids=["per_row", "union"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_token_paths_match_the_oracle_forward_and_backward(monkeypatch, union_factor, dtype):
    """A tile goes through the union of its rows' tokens or through each row's own (UNION_FACTOR): forced each
    way, on ragged rows (-1 in the middle as well as at the end), GQA, a shared selection."""
    import impls.blocked.tokens as tokens

    monkeypatch.setattr(tokens, "UNION_FACTOR", union_factor)
    monkeypatch.setattr(tokens, "ROW_TILE", 16)
    gen = torch.Generator().manual_seed(1)
    pattern = make_pattern("causal", 80)
    q = torch.randn(1, 4, 80, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 80, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    idx = torch.argsort(torch.rand(1, 1, 80, 80, generator=gen), dim=-1)[..., :10].sort(dim=-1).values
    idx[..., 3] = -1  # padding in the middle of every row
    idx[:, :, 7, :] = -1  # a row that keeps nothing
    selection = Selection(idx.to(torch.int32), 1, 1, "all")
    expected = reference_attention(q, k, v, pattern, extra_mask=lambda r: effective_mask(selection, pattern, r, 4, 2))
    q_, k_, v_ = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, _ = tokens.token_attention(selection, pattern, q_, k_, v_, 16 ** -0.5)
    assert compare(out, expected, 1e-4 if dtype == torch.float32 else 2e-2).passed
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = tokens.token_attention(selection, pattern, q64, k64, v64, 16 ** -0.5)
    assert compare(ref, expected, 1e-10).passed  # float64 through the same path: the oracle's own answer
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref.backward(grad)
    out.backward(grad.to(dtype))
    for ours, exact in ((q_, q64), (k_, k64), (v_, v64)):
        err = (ours.grad.double() - exact.grad).norm() / exact.grad.norm()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


@pytest.mark.parametrize("shared", ["all", "kv_group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_as_decode_steps_match_the_oracle(shared, dtype):
    """token_rows_attention: ragged rows (-1 in the middle and at the end), a row that keeps nothing, future
    tokens the causal base does not allow (dropped), one selection for every KV head or one per KV group."""
    from impls.blocked.tokens import rows_as_sequences_unavailable, token_rows_attention

    gen = torch.Generator().manual_seed(2)
    b, h, hkv, n, d = 2, 4, 2, 90, 32
    pattern = make_pattern("causal", n)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    lists = 1 if shared == "all" else hkv
    idx = torch.argsort(torch.rand(b, lists, n, n, generator=gen), dim=-1)[..., :12]  # future tokens among them
    idx[..., 4] = -1
    idx[:, :, 9, :] = -1  # a row that keeps nothing
    selection = Selection(idx.to(torch.int32), 1, 1, shared)
    expected = reference_attention(q, k, v, pattern, extra_mask=lambda r: effective_mask(selection, pattern, r, h,
                                                                                         hkv))
    q_, k_, v_ = (t.to(dtype) for t in (q, k, v))
    assert rows_as_sequences_unavailable(selection, q_, k_, "fwd") is None
    out, lse = token_rows_attention(selection, pattern, q_, k_, v_, d ** -0.5)
    reference = reference_attention(q_.double(), k_.double(), v_.double(), pattern, extra_mask=lambda r:
                                    effective_mask(selection, pattern, r, h, hkv))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((out.double() - reference).abs().max()) < tolerance
    assert float((out.double() - expected).norm() / expected.norm()) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert out[:, :, 9].abs().max() == 0 and bool(torch.isinf(lse[:, :, 9]).all())  # nothing kept: zero, -inf
    assert rows_as_sequences_unavailable(selection, q_, k_, "fwd_bwd") is not None
