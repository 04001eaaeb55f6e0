"""blocked over token selections (impls/blocked/tokens.py: DSA's per-row top tokens): the union of a tile's rows'
tokens gathered once, each row masked to its own. Against the float64 oracle under the selection, forward and
backward, float32 and bfloat16 (within twice the same-dtype reference), GQA and fewer query rows than keys,
selections per query head and shared, rows that keep nothing."""

from __future__ import annotations

import pytest
import torch

from bench import api
from bench.measure.case_cache import CaseCache
from bench.measure.pair import Task, measure_task
from bench.measure.reference import compare, reference_attention
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
    assert record.config is not None and record.config["path"] == "token_union"
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
