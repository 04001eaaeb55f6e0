"""The built-in fast selectors (moba, quest, nsa, dsa, xattention) against slow, literal re-statements of their
methods (loops over rows, heads and units, float64), on random and structured inputs and odd shapes.

Each literal statement is written from the paper's and reference code's description (docs/selectors.md), not
from the selector's code: per (batch, selection head, query unit) it gives every key unit's score, which units the
base pattern allows, the forced ones (in priority order) and the count the budget keeps. A selection matches when
it keeps exactly that count, the forced units, only allowed ones, and otherwise the units of largest score (a
near-tie within float32 rounding may go either way), with -1 only after the kept units.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch

import bench.selection.units as units_module
from bench.inputs.spec import StructuredKnobs
from bench.inputs.structured import structured_inputs
from bench.selection import Selection, get_selector, run_selector, selection_heads
from bench.selection.dsa import indexer_weights
from bench.selection.xattention import tile_stride
from bench.spec.case import Case

FAST = ("moba", "quest", "nsa", "dsa", "xattention")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: one thread is faster than a pool contending for shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Unit:
    """One (batch, selection head, query unit) of a literal statement."""

    scores: list[float]  # per key unit
    allowed: list[bool]
    forced: list[int]  # allowed forced units, highest priority first
    count: int  # units the budget keeps (budget selectors)


# --- shapes and inputs -----------------------------------------------------------------------------------------

# (id, case fields): q_len < seq_len incl. decode, seq_len not a multiple of the block, GQA with kv_heads 1 and
# = heads, causal and causal_local base patterns
SHAPES = {
    "causal_gqa_ragged": dict(batch=2, heads=4, kv_heads=2, head_dim=16, seq_len=70, pattern="causal", block_size=16),
    "local_mqa_q23": dict(batch=1, heads=2, kv_heads=1, head_dim=8, seq_len=64, q_len=23, pattern="causal_local",
                          window=24, block_size=16),
    "decode_mha": dict(batch=1, heads=3, kv_heads=3, head_dim=16, seq_len=53, q_len=1, pattern="causal",
                       block_size=8),
    "causal_q37_b12": dict(batch=1, heads=4, kv_heads=1, head_dim=8, seq_len=61, q_len=37, pattern="causal",
                           block_size=12),
}


def make_case(shape: str, selector: str, **fields: object) -> Case:
    return Case(**{**SHAPES[shape], "selector": selector, **fields})  # type: ignore[arg-type]


def inputs(case: Case, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, q_len, D), k (B, Hkv, N, D) float32: seeded random, or the structured generator's."""
    if kind == "structured":
        x = structured_inputs(batch=case.batch, heads=case.heads, kv_heads=case.n_kv_heads, seq_len=case.seq_len,
                              q_len=case.n_queries, head_dim=case.head_dim, block_size=case.block_size,
                              seed=case.seed, knobs=StructuredKnobs(needles=2, needle_queries=4))
        return x.q, x.k
    gen = torch.Generator().manual_seed(case.seed + 11)
    q = torch.randn(*case.q_shape(), generator=gen)
    k = torch.randn(case.batch, case.n_kv_heads, case.seq_len, case.head_dim, generator=gen)
    return q, k


def select(q: torch.Tensor, k: torch.Tensor, case: Case) -> Selection:
    """The selector's Selection, validated (every output of these tests passes `Selection.validate`)."""
    selection = run_selector(get_selector(case.selector or ""), q, k, case)
    selection.validate(case.batch, case.heads, case.n_kv_heads, case.n_queries, case.seq_len)
    assert selection.indices.dtype == torch.int32
    return selection


# --- literal statements ----------------------------------------------------------------------------------------

def literal_count(budget: int | float | None, allowed: int) -> int:
    """An int budget clamped to what the unit allows; a fraction of it, rounded up, at least 1."""
    if budget is None:
        return allowed
    if isinstance(budget, int):
        return min(budget, allowed)
    return min(allowed, max(1, math.ceil(allowed * budget)))


def base_mask(case: Case) -> torch.Tensor:
    """bool (q_len, N): the base pattern's predicate at every (row, key)."""
    rows, keys = torch.arange(case.n_queries), torch.arange(case.seq_len)
    return case.make_pattern().mask(rows[:, None], keys[None, :])


def unit_allowed(mask: torch.Tensor, rows: range, first: int, last: int) -> bool:
    """Does the base pattern allow any (row, key) pair of these rows with keys [first, last)?"""
    return bool(mask[rows.start : rows.stop, first:last].any())


def literal_row_units(case: Case, size: int) -> list[list[bool]]:
    """allowed[row][unit] for key units of `size` keys."""
    n, units, mask = case.seq_len, math.ceil(case.seq_len / size), base_mask(case)
    return [[unit_allowed(mask, range(r, r + 1), u * size, min(n, (u + 1) * size)) for u in range(units)]
            for r in range(case.n_queries)]


def literal_moba(q: torch.Tensor, k: torch.Tensor, case: Case) -> dict[tuple[int, int, int], Unit]:
    """moba_naive: gate = q . mean(block keys); the own block forced; the budget blocks of largest gate."""
    bs, n, offset = case.block_size, case.seq_len, case.seq_len - case.n_queries
    group = case.heads // case.n_kv_heads
    allowed = literal_row_units(case, bs)
    out = {}
    for b in range(case.batch):
        for h in range(case.heads):
            for r in range(case.n_queries):
                gates = []
                for c in range(len(allowed[r])):
                    mean = k[b, h // group, c * bs : min(n, (c + 1) * bs)].double().mean(dim=0)
                    gates.append(float(q[b, h, r].double() @ mean))
                own = (r + offset) // bs
                forced = [own] if allowed[r][own] else []
                out[b, h, r] = Unit(gates, allowed[r], forced, literal_count(case.budget, sum(allowed[r])))
    return out


def literal_quest(q: torch.Tensor, k: torch.Tensor, case: Case) -> dict[tuple[int, int, int], Unit]:
    """Quest: score = sum_d max(q_d min_d, q_d max_d) over the page's channel-wise key extremes; own page forced."""
    page, n, offset = 16, case.seq_len, case.seq_len - case.n_queries  # Quest's default page
    group = case.heads // case.n_kv_heads
    allowed = literal_row_units(case, page)
    out = {}
    for b in range(case.batch):
        for h in range(case.heads):
            for r in range(case.n_queries):
                scores = []
                for c in range(len(allowed[r])):
                    keys = k[b, h // group, c * page : min(n, (c + 1) * page)].double()
                    lo, hi = keys.min(dim=0).values, keys.max(dim=0).values
                    qd = q[b, h, r].double()
                    scores.append(float(torch.maximum(qd * lo, qd * hi).sum()))
                own = (r + offset) // page
                forced = [own] if allowed[r][own] else []
                out[b, h, r] = Unit(scores, allowed[r], forced, literal_count(case.budget, sum(allowed[r])))
    return out


def literal_nsa(q: torch.Tensor, k: torch.Tensor, case: Case) -> dict[tuple[int, int, int], Unit]:
    """NSA eqs. 8-11: softmax of q . k_cmp / sqrt(D) over whole blocks (k_cmp the block's mean key), summed over
    the KV group's heads; own, previous and first blocks forced in that order; top budget."""
    bs, n, offset, d = case.block_size, case.seq_len, case.seq_len - case.n_queries, case.head_dim
    group = case.heads // case.n_kv_heads
    allowed = literal_row_units(case, bs)
    out = {}
    for b in range(case.batch):
        for g in range(case.n_kv_heads):
            for r in range(case.n_queries):
                position = r + offset
                blocks = len(allowed[r])
                whole = [allowed[r][c] and min(n, (c + 1) * bs) <= position + 1 for c in range(blocks)]
                importance = [0.0] * blocks
                for h in range(g * group, (g + 1) * group):
                    logits = {}
                    for c in range(blocks):
                        if whole[c]:
                            k_cmp = k[b, g, c * bs : min(n, (c + 1) * bs)].double().mean(dim=0)
                            logits[c] = float(q[b, h, r].double() @ k_cmp) / math.sqrt(d)
                    if logits:
                        top = max(logits.values())
                        total = sum(math.exp(v - top) for v in logits.values())
                        for c, v in logits.items():
                            importance[c] += math.exp(v - top) / total
                own = position // bs
                forced = [c for c in dict.fromkeys([own, own - 1, 0]) if c >= 0 and allowed[r][c]]
                out[b, g, r] = Unit(importance, allowed[r], forced, literal_count(case.budget, sum(allowed[r])))
    return out


def literal_dsa(q: torch.Tensor, k: torch.Tensor, case: Case) -> dict[tuple[int, int, int], Unit]:
    """The lightning indexer I(t, s) = sum_j w_tj ReLU(q^I_tj . k^I_s) with the seeded weights; token top-k."""
    hkv, d, n = case.n_kv_heads, case.head_dim, case.seq_len
    proj, gate, reads = indexer_weights(case.seed, case.heads, hkv, d)
    proj = proj.double()
    group, h_i, d_i = case.heads // hkv, len(reads), proj.shape[1]
    allowed = literal_row_units(case, 1)
    out = {}
    for b in range(case.batch):
        k_index = torch.stack([k[b, :, s].double().flatten() @ proj for s in range(n)])  # keys of all KV heads
        for r in range(case.n_queries):
            scores = torch.zeros(n, dtype=torch.float64)
            for j in range(h_i):
                head = int(reads[j])
                slot = torch.zeros(hkv * d, dtype=torch.float64)  # the head's query in its KV group's slot
                slot[(head // group) * d : (head // group + 1) * d] = q[b, head, r].double()
                q_index = slot @ proj
                w = 1 / (1 + math.exp(-float(q[b, head, r].double() @ gate[j].double()) / math.sqrt(d)))
                w = w / math.sqrt(h_i) / math.sqrt(d_i)
                scores = scores + w * (k_index @ q_index).clamp(min=0)  # ReLU, every key s at once
            out[b, 0, r] = Unit(scores.tolist(), allowed[r], [], literal_count(case.budget, sum(allowed[r])))
    return out


def literal_xattention(q: torch.Tensor, k: torch.Tensor, case: Case) -> dict[tuple[int, int, int], Unit]:
    """xattn_estimate: per strided query row, a softmax over the key tiles it may see of the antidiagonal sums
    sum_i q[rS + S-1-i] . k[sS + i] / (sqrt(D) S); summed per (query block, key block); first and diagonal block
    forced. `count` is unused (a threshold selector)."""
    bs, n, q_len, d = case.block_size, case.seq_len, case.n_queries, case.head_dim
    offset, group = n - q_len, case.heads // case.n_kv_heads
    stride = tile_stride(bs)
    q_blocks, kv_blocks, kv_tiles = math.ceil(q_len / bs), math.ceil(n / bs), math.ceil(n / stride)
    run_rows = lambda run: range(run * stride, min(q_len, (run + 1) * stride))  # noqa: E731
    mask = base_mask(case)
    tile_ok = {(run, s): unit_allowed(mask, run_rows(run), s * stride, min(n, (s + 1) * stride))
               for run in range(math.ceil(q_len / stride)) for s in range(kv_tiles)}
    out = {}
    for b in range(case.batch):
        for h in range(case.heads):
            for u in range(q_blocks):
                mass = [0.0] * kv_blocks
                for run in range(u * bs // stride, min((u + 1) * bs, q_len + stride - 1) // stride):
                    logits = {}
                    for s in range(kv_tiles):
                        if not tile_ok[run, s]:
                            continue
                        total = 0.0
                        for i in range(stride):
                            row, key = run * stride + stride - 1 - i, s * stride + i
                            if row < q_len and key < n:
                                total += float(q[b, h, row].double() @ k[b, h // group, key].double())
                        logits[s] = total / (math.sqrt(d) * stride)
                    if logits:
                        top = max(logits.values())
                        norm = sum(math.exp(v - top) for v in logits.values())
                        for s, v in logits.items():
                            mass[s * stride // bs] += math.exp(v - top) / norm
                rows = range(u * bs, min(q_len, (u + 1) * bs))
                allowed = [unit_allowed(mask, rows, c * bs, min(n, (c + 1) * bs)) for c in range(kv_blocks)]
                diagonal = (rows[-1] + offset) // bs
                forced = [c for c in dict.fromkeys([0, diagonal]) if allowed[c]]
                out[b, h, u] = Unit(mass, allowed, forced, 0)
    return out


LITERAL = {"moba": literal_moba, "quest": literal_quest, "nsa": literal_nsa, "dsa": literal_dsa,
           "xattention": literal_xattention}


# --- matching ----------------------------------------------------------------------------------------------------

def kept_units(row: list[int]) -> list[int]:
    """The kept indices of one query unit, asserting -1 appears only after them."""
    kept = [i for i in row if i >= 0]
    assert row == kept + [-1] * (len(row) - len(kept)), f"padding before a kept unit: {row}"
    assert len(set(kept)) == len(kept)
    return kept


def assert_topk(indices: torch.Tensor, literal: dict[tuple[int, int, int], Unit]) -> None:
    """Every unit keeps its count, its forced units (by priority where the count is short), only allowed units,
    and otherwise those of largest literal score (ties within float32 rounding either way)."""
    assert set(literal) == {tuple(i) for i in torch.cartesian_prod(*map(torch.arange, indices.shape[:3])).tolist()}
    for (b, h, u), unit in literal.items():
        kept = kept_units(indices[b, h, u].tolist())
        where = f"unit {(b, h, u)}: kept {kept}"
        assert len(kept) == unit.count, where
        assert all(unit.allowed[i] for i in kept), f"{where}, allowed {unit.allowed}"
        assert set(unit.forced[: unit.count]) <= set(kept), f"{where}, forced {unit.forced}"
        others = set(kept) - set(unit.forced)
        rest = {i for i, ok in enumerate(unit.allowed) if ok} - set(kept)
        tol = 1e-4 * (1 + max(abs(s) for s in unit.scores))
        if others and rest:
            assert min(unit.scores[i] for i in others) >= max(unit.scores[i] for i in rest) - tol, where


def assert_threshold(indices: torch.Tensor, literal: dict[tuple[int, int, int], Unit], threshold: float) -> None:
    """Every unit keeps its forced units first, then others by decreasing score, the fewest whose mass reaches
    `threshold` of the unit's total (within float32 rounding of the boundary)."""
    for (b, h, u), unit in literal.items():
        kept = kept_units(indices[b, h, u].tolist())
        where = f"unit {(b, h, u)}: kept {kept}, forced {unit.forced}"
        assert set(kept[: len(unit.forced)]) == set(unit.forced), where
        others = kept[len(unit.forced):]
        assert all(unit.allowed[i] for i in kept), where
        total = sum(s for s, ok in zip(unit.scores, unit.allowed, strict=True) if ok)
        tol = 1e-4 * (1 + total)
        rest = [unit.scores[i] for i, ok in enumerate(unit.allowed) if ok and i not in kept]
        if others and rest:
            assert min(unit.scores[i] for i in others) >= max(rest) - tol, where
        mass = sum(unit.scores[i] for i in kept)
        # reaches the threshold, or keeps every allowed unit of nonzero score
        assert mass >= threshold * total - tol or all(s == 0 for s in rest), f"{where}: {mass} of {total}"
        if others:  # the fewest: without its last unit it falls short
            assert mass - unit.scores[others[-1]] < threshold * total + tol, f"{where}: {mass} of {total}"


# --- against the literal statements ----------------------------------------------------------------------------

BUDGETS = {"moba": (3, 0.5), "quest": (2, 0.25), "nsa": (4, 0.6), "dsa": (9, 0.3)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["moba", "quest", "nsa", "dsa"])
def test_budget_selectors_match_literal(name: str, shape: str) -> None:
    for i, budget in enumerate(BUDGETS[name]):
        for kind in ("random", "structured"):
            if kind == "structured" and shape != "causal_gqa_ragged":
                continue  # the structured generator at one shape; the odd shapes on random inputs
            case = make_case(shape, name, budget=budget, seed=i)
            q, k = inputs(case, kind)
            assert_topk(select(q, k, case).indices, LITERAL[name](q, k, case))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threshold", [0.5, 0.9])
def test_xattention_matches_literal(shape: str, threshold: float) -> None:
    kinds = ("random", "structured") if shape == "causal_gqa_ragged" else ("random",)
    for kind in kinds:
        case = make_case(shape, "xattention", threshold=threshold, block_size=8)
        q, k = inputs(case, kind)
        assert_threshold(select(q, k, case).indices, literal_xattention(q, k, case), threshold)


def test_xattention_block_not_a_multiple_of_the_stride() -> None:
    """A block of 12 tiles with stride gcd(12, 8) = 4."""
    case = make_case("causal_q37_b12", "xattention", threshold=0.8)
    assert tile_stride(case.block_size) == 4
    q, k = inputs(case, "random")
    assert_threshold(select(q, k, case).indices, literal_xattention(q, k, case), 0.8)


# --- properties ------------------------------------------------------------------------------------------------

def selected_mask(selection: Selection, case: Case) -> torch.Tensor:
    kv_units = math.ceil(case.seq_len / selection.kv_unit)
    return selection.unit_mask(kv_units)


def allowed_mask(case: Case, name: str) -> torch.Tensor:
    info = get_selector(name)
    return units_module.allowed_units(case.make_pattern(), info.q_unit_size(case), info.kv_unit_size(case))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["moba", "quest", "nsa", "dsa"])
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


@pytest.mark.parametrize("name", ["moba", "quest", "nsa"])
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", FAST)
def test_cuda_matches_literal(name: str) -> None:
    case = make_case("causal_gqa_ragged", name, budget=BUDGETS.get(name, (3,))[0], threshold=0.9, block_size=8
                     if name == "xattention" else 16)
    q, k = inputs(case, "random")
    selection = run_selector(get_selector(name), q.cuda(), k.cuda(), case)
    assert selection.indices.is_cuda
    indices = selection.indices.cpu()
    literal = LITERAL[name](q, k, case)
    if name == "xattention":
        assert_threshold(indices, literal, 0.9)
    else:
        assert_topk(indices, literal)
