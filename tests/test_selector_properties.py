"""Properties every fast selector keeps (bench/selection/): a full budget selects what the base allows, forced units,
sharing and units as registered, determinism, chunking and dtype invariance, and what each refuses."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import bench.selection.units as units_module
from bench.selection import Selection, get_selector, run_selector, selection_heads
from bench.selection.dsa import indexer_weights
from bench.spec.case import Case
from tests.test_selectors import FAST, SHAPES, inputs, literal_xattention, make_case, one_thread, select  # noqa: F401 - one_thread: the module's autouse fixture


def selected_mask(selection: Selection, case: Case) -> torch.Tensor:
    kv_units = math.ceil(case.seq_len / selection.kv_unit)
    return selection.unit_mask(kv_units)

def allowed_mask(case: Case, name: str) -> torch.Tensor:
    info = get_selector(name)
    return units_module.allowed_units(case.make_pattern(), info.q_unit_size(case), info.kv_unit_size(case))

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["moba", "quest", "nsa", "dsa", "msa"])
def test_a_budget_of_everything_selects_what_the_pattern_allows(name: str, shape: str) -> None:
    for budget in (1.0, 10_000):
        case = make_case(shape, name, budget=budget)
        q, k = inputs(case, "random")
        chosen = selected_mask(select(q, k, case), case)  # (B, H_sel, Nq, KU)
        assert torch.equal(chosen, allowed_mask(case, name).expand_as(chosen))

@pytest.mark.parametrize("shape", SHAPES)
def test_xattention_threshold_one_keeps_every_block_with_a_score(shape: str) -> None:
    """Every allowed block with a score above 0 (and the forced ones); here block 1's keys point away from every
    query, so that its softmax weights underflow to 0 and it is left out."""
    case = make_case(shape, "xattention", threshold=1.0, block_size=8)
    q, k = inputs(case, "random")
    q, k = q.abs(), k.abs()
    k[:, :, 8:16] *= -1e5  # its logits, about -1e4 below the rest: 0 after the softmax even in float64
    chosen = selected_mask(select(q, k, case), case)
    zero = 0
    for (b, h, u), unit in literal_xattention(q, k, case).items():
        expected = [c for c, (s, ok) in enumerate(zip(unit.scores, unit.allowed, strict=True))
                    if ok and (s > 0 or c in unit.forced)]
        assert chosen[b, h, u].nonzero().flatten().tolist() == expected
        zero += unit.allowed[1] and unit.scores[1] == 0 and 1 not in unit.forced
    assert zero > 0 or shape == "local_mqa_q23"  # its window never reaches block 1 from a later query block

@pytest.mark.parametrize("name", ["moba", "quest", "nsa", "msa"])
def test_own_unit_is_forced_even_when_it_scores_lowest(name: str) -> None:
    """Keys of the row's own unit point away from every query: it scores lowest, and is kept all the same."""
    case = make_case("causal_gqa_ragged", name, budget=2)
    q, k = inputs(case, "random")
    q = q.abs()
    k = k.abs()
    size = get_selector(name).kv_unit_size(case)
    k[:, :, 64:] = -k[:, :, 64:]  # the last unit of 16 keys (positions 64..69) and, for rows there, their own
    indices = select(q, k, case).indices
    for row in range(64, 70):
        assert (indices[:, :, row] == 64 // size).any(dim=-1).all()

def test_nsa_keeps_first_and_local_blocks_and_shares_per_group() -> None:
    case = make_case("causal_gqa_ragged", "nsa", budget=3)
    q, k = inputs(case, "random")
    indices = select(q, k, case).indices
    assert indices.shape[:3] == (2, 2, 70)  # per KV group: H_sel = kv_heads
    for row in range(32, 70):  # own block >= 2: first, previous and own are three distinct blocks
        own = row // 16
        assert sorted(indices[0, 0, row].tolist()) == sorted([0, own - 1, own])

def test_nsa_budget_under_the_forced_blocks_keeps_own_then_previous() -> None:
    case = make_case("causal_gqa_ragged", "nsa", budget=2)
    q, k = inputs(case, "random")
    indices = select(q, k, case).indices
    assert sorted(indices[1, 1, 50].tolist()) == [2, 3]
    assert sorted(indices[1, 1, 20].tolist()) == [0, 1]

@pytest.mark.parametrize("name", FAST)
def test_registration_says_units_and_sharing(name: str) -> None:
    info = get_selector(name)
    expected = {"moba": ("row", "block", "head", "budget"), "quest": ("row", "page", "head", "budget"),
                "nsa": ("row", "block", "kv_group", "budget"), "dsa": ("row", "token", "all", "budget"),
                "msa": ("row", "block", "kv_group", "budget"),
                "xattention": ("block", "block", "head", "threshold")}[name]
    assert (info.q_unit, info.kv_unit, info.shared, info.takes) == expected
    assert not info.reference
    case = make_case("causal_gqa_ragged", name, budget=2, threshold=0.9)
    q, k = inputs(case, "random")
    selection = select(q, k, case)
    assert selection.indices.shape[1] == selection_heads(info.shared, case.heads, case.n_kv_heads)

def test_quest_reads_the_case_page_size() -> None:
    """A case with page_size (decode and paged caches) sets Quest's page; without one it is 16."""

    base = make_case("causal_gqa_ragged", "quest", budget=2)
    paged = replace(base, page_size=8)
    q, k = inputs(base, "random")
    assert select(q, k, base).kv_unit == 16
    selection = run_selector(get_selector("quest"), q, k, paged)
    assert selection.kv_unit == 8
    assert int(selection.indices.max()) == 69 // 8

def test_dsa_is_deterministic_per_seed() -> None:
    case = make_case("causal_gqa_ragged", "dsa", budget=6, seed=4)
    q, k = inputs(case, "random")
    first = select(q, k, case).indices
    assert torch.equal(first, select(q, k, case).indices)
    other = select(q, k, replace(case, seed=5)).indices
    assert not torch.equal(first, other)  # another seed, other indexer weights

def test_dsa_indexer_sizes() -> None:
    proj, gate, reads = indexer_weights(0, heads=32, kv_heads=8, head_dim=128)
    assert proj.shape == (8 * 128, 128) and gate.shape == (8, 128)
    assert reads.tolist() == [0, 4, 8, 12, 16, 20, 24, 28]  # one query head per KV group
    assert indexer_weights(0, heads=2, kv_heads=1, head_dim=8)[2].tolist() == [0, 1]

@pytest.mark.parametrize("name", FAST)
def test_chunked_equals_whole(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few rows (each scoring only its allowed span of keys) select what one chunk does."""
    case = make_case("causal_gqa_ragged", name, budget=0.4, threshold=0.8)
    q, k = inputs(case, "random")
    whole = select(q, k, case).indices
    monkeypatch.setattr(units_module, "SCORE_ELEMENTS", 300)
    assert units_module.row_chunks(70, 2 * 4 * 5)[:2] == [(0, 7), (7, 14)]
    assert torch.equal(select(q, k, case).indices, whole)

@pytest.mark.parametrize(("q_unit", "kv_unit"), [(1, 1), (3, 5), (70, 1), (45, 4), (16, 16)])
def test_allowed_units_in_chunks_equal_the_dense_mask(q_unit: int, kv_unit: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few rows, a query unit spanning several chunks (a decode's whole query, units that straddle
    two chunks) included, give what the dense mask reduced to units gives."""
    case = make_case("causal_gqa_ragged", "moba", budget=0.4)
    pattern = case.make_pattern()
    dense = pattern.dense_mask()  # (q_len, N)
    q_units, kv_units = math.ceil(dense.shape[0] / q_unit), math.ceil(dense.shape[1] / kv_unit)
    padded = torch.nn.functional.pad(dense, (0, kv_units * kv_unit - dense.shape[1],
                                             0, q_units * q_unit - dense.shape[0]))
    expected = padded.view(q_units, q_unit, kv_units, kv_unit).any(dim=3).any(dim=1)
    monkeypatch.setattr(units_module, "CHUNK_ELEMENTS", 7 * dense.shape[1])  # 7 rows a chunk
    assert torch.equal(units_module.allowed_units(case.make_pattern(), q_unit, kv_unit), expected)

@pytest.mark.parametrize("name", FAST)
def test_low_precision_inputs_select_as_their_float32_values(name: str) -> None:
    case = make_case("causal_gqa_ragged", name, budget=3, threshold=0.9)
    q, k = inputs(case, "random")
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    assert torch.equal(select(q, k, case).indices, select(q.float(), k.float(), case).indices)

def test_xattention_needs_a_threshold() -> None:
    case = make_case("causal_gqa_ragged", "xattention")
    q, k = inputs(case, "random")
    with pytest.raises(ValueError, match="set `threshold`"):
        get_selector("xattention").fn(q, k, case)
