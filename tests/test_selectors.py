"""The built-in fast selectors (moba, quest, nsa, dsa, msa, xattention) against slow, literal re-statements of their
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
from dataclasses import dataclass

import pytest
import torch

from bench.inputs.spec import StructuredKnobs
from bench.inputs.structured import structured_inputs
from bench.selection import Selection, get_selector, run_selector
from bench.selection.dsa import indexer_weights
from bench.selection.xattention import tile_stride
from bench.spec.case import Case

FAST = ("moba", "quest", "nsa", "dsa", "msa", "xattention")


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


def literal_msa(q: torch.Tensor, k: torch.Tensor, case: Case) -> dict[tuple[int, int, int], Unit]:
    """MSA: a key's score is the summed q . k of the KV group's query heads; a block's, the max over the keys the
    base pattern lets the row see; own block then the one before forced; top budget."""
    bs, n, offset = case.block_size, case.seq_len, case.seq_len - case.n_queries
    group = case.heads // case.n_kv_heads
    allowed, mask = literal_row_units(case, bs), base_mask(case)
    out = {}
    for b in range(case.batch):
        for g in range(case.n_kv_heads):
            for r in range(case.n_queries):
                scores = []
                for c in range(len(allowed[r])):
                    seen = [j for j in range(c * bs, min(n, (c + 1) * bs)) if mask[r, j]]
                    per_key = [sum(float(q[b, h, r].double() @ k[b, g, j].double())
                                   for h in range(g * group, (g + 1) * group)) for j in seen]
                    scores.append(max(per_key) if per_key else 0.0)  # a block it sees none of: not allowed
                own = (r + offset) // bs
                forced = [c for c in (own, own - 1) if c >= 0 and allowed[r][c]]
                out[b, g, r] = Unit(scores, allowed[r], forced, literal_count(case.budget, sum(allowed[r])))
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
           "msa": literal_msa, "xattention": literal_xattention}


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

BUDGETS = {"moba": (3, 0.5), "quest": (2, 0.25), "nsa": (4, 0.6), "dsa": (9, 0.3), "msa": (3, 0.4)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["moba", "quest", "nsa", "dsa", "msa"])
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
