"""Our Triton kernel's tile tables and masks (impls/triton_block_sparse/tables.py), exact against every pattern's matrix
at several tile shapes, structures (q_len < seq_len, documents) and partial tiles; the mask each tile gets and the
tile configurations."""

from __future__ import annotations

import math

import pytest
import torch

from bench.patterns import Causal, Pattern, make_pattern
from impls.triton_block_sparse import launch, tables
from tests.pattern_zoo import BUILTIN
from tests.test_triton_block_sparse import FIELDS, LateCausal, N, pattern_for


def tile_views(mask: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the dense (q_len, N) mask: (listed, full, tiles) per (query tile, key tile); tiles (nq, bm, nk, bn)."""
    rows, n = mask.shape
    nq, nk = math.ceil(rows / bm), math.ceil(n / bn)
    padded = torch.zeros(nq * bm, nk * bn, dtype=torch.bool)
    padded[:rows, :n] = mask
    tiles = padded.view(nq, bm, nk, bn)
    listed = tiles.any(dim=3).any(dim=1)
    row_valid = (torch.arange(nq * bm) < rows).view(nq, bm, 1, 1)
    keys_in_range = (torch.arange(1, nk + 1) * bn <= n)[None, :]
    full = (tiles | ~row_valid).all(dim=3).all(dim=1) & keys_in_range & listed
    return listed, full, tiles

def unpack(words: torch.Tensor, block_n: int) -> torch.Tensor:
    """(bm, words) int32 -> (bm, block_n) bool."""
    bits = (words.long()[:, :, None] >> torch.arange(32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :block_n].bool()

def listing(offsets: torch.Tensor, full_counts: torch.Tensor, items: torch.Tensor, slots: torch.Tensor):
    """Per major index: [(minor, is_full, slot)] in table order."""
    out = []
    for major in range(len(offsets) - 1):
        lo, hi = int(offsets[major]), int(offsets[major + 1])
        n_full = int(full_counts[major])
        out.append([(int(items[t]), t - lo < n_full, int(slots[t])) for t in range(lo, hi)])
    return out

TILE_SHAPES = [(16, 16), (32, 16), (16, 32), (64, 32)]

STRUCTURES = ["square", "rows37", "decode", "docs_rows50"]

def structured_pattern(name: str, structure: str) -> Pattern:
    """The q_len x N matrix of `structure`: square (97 x 97), the last 37 of 97 positions (chunked prefill:
    rows offset by 60, a multiple of no tile side), one query row (decode), or packed documents (one of
    length 1) under chunked prefill (50 rows). Axial and neighborhood get documents that are whole images."""
    if structure != "docs_rows50":
        return pattern_for(name, 97, q_len={"square": None, "rows37": 37, "decode": 1}[structure])
    if name == "axial":
        return make_pattern(name, 96, q_len=50, documents=[24, 48, 24], **{**FIELDS, "window": 12})
    if name == "neighborhood":
        return make_pattern(name, 96, q_len=50, documents=[36, 60], **{**FIELDS, "window": 3, "image_width": 12})
    return pattern_for(name, 97, q_len=50, documents=[1, 30, 41, 25])

@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("shape", TILE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pattern_name", BUILTIN)
def test_tables_match_the_pattern_exactly(pattern_name, shape, structure):
    pattern = structured_pattern(pattern_name, structure)
    n = pattern.seq_len
    bm, bn = shape
    t = tables.build_tables(pattern.block_sparse(tables.base_block([shape])), bm, bn, with_bits=True)
    mask = pattern.dense_mask()
    assert mask.shape == (pattern.q_len, n)
    listed, full, tiles = tile_views(mask, bm, bn)
    n_q, n_k = math.ceil(pattern.q_len / bm), math.ceil(n / bn)
    assert listed.shape == (n_q, n_k) and len(t.row_full) == n_q and len(t.col_full) == n_k
    if bm == bn:
        assert torch.equal(listed, pattern.block_layout(bm))

    rows = listing(t.row_offsets, t.row_full, t.row_cols, t.row_slots)
    cols = listing(t.col_offsets, t.col_full, t.col_rows, t.col_slots)
    got_listed = torch.zeros_like(listed)
    got_full = torch.zeros_like(full)
    slot_of: dict[tuple[int, int], int] = {}
    for r, entries in enumerate(rows):
        # full tiles first, then partial; key tiles increasing within each group
        flags = [f for _, f, _ in entries]
        assert flags == sorted(flags, reverse=True)
        for group in (True, False):
            idx = [c for c, f, _ in entries if f == group]
            assert idx == sorted(idx)
        for c, is_full, slot in entries:
            got_listed[r, c] = True
            got_full[r, c] = is_full
            assert (slot == -1) == is_full
            slot_of[(r, c)] = slot
    assert torch.equal(got_listed, listed)
    assert torch.equal(got_full, full)
    assert t.n_full == int(full.sum()) and t.n_partial == int((listed & ~full).sum())
    assert sorted(s for s in slot_of.values() if s >= 0) == list(range(t.n_partial))

    # the transposed table lists the same tiles, with the same fullness and slots
    for c, entries in enumerate(cols):
        assert [f for _, f, _ in entries] == sorted((f for _, f, _ in entries), reverse=True)
        for r, is_full, slot in entries:
            assert is_full == bool(full[r, c]) and slot == slot_of[(r, c)]
    assert sum(len(e) for e in cols) == int(listed.sum())

    # each partial tile's bitmask is the pattern inside it (False past the sequence end)
    for (r, c), slot in slot_of.items():
        if slot >= 0:
            assert torch.equal(unpack(t.mask_words[slot], bn), tiles[r, :, c, :]), (r, c)

    # without bitmasks, the partial tiles that only the sequence end cuts are marked for the formula kernels
    formula = tables.build_tables(pattern.block_sparse(tables.base_block([shape])), bm, bn, with_bits=False)
    assert torch.equal(formula.row_cols, t.row_cols) and torch.equal(formula.col_rows, t.col_rows)
    outside = ((torch.arange(n_q * bm) >= pattern.q_len).view(n_q, bm, 1, 1)
               | (torch.arange(n_k * bn) >= n).view(1, 1, n_k, bn))
    cut_by_end = (tiles | outside).all(dim=3).all(dim=1) & listed & ~full
    for r, entries in enumerate(listing(formula.row_offsets, formula.row_full, formula.row_cols,
                                        formula.row_slots)):
        for c, is_full, slot in entries:
            assert (slot == tables.BOUNDS_ONLY) == bool(cut_by_end[r, c]) and (slot == -1) == is_full

def test_tables_do_not_depend_on_the_base_block():
    pattern = pattern_for("bigbird", 130)
    a = tables.build_tables(pattern.block_sparse(16), 64, 32, with_bits=True)
    b = tables.build_tables(pattern.block_sparse(32), 64, 32, with_bits=True)
    for field in ("row_offsets", "row_full", "row_cols", "row_slots", "col_offsets", "col_full", "col_rows",
                  "col_slots", "mask_words"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field

def test_tables_reject_a_tile_the_view_cannot_build():
    with pytest.raises(ValueError, match="tile 48x32 is not a multiple of the view's block size 32"):
        tables.build_tables(pattern_for("local").block_sparse(32), 48, 32, with_bits=False)

@pytest.mark.parametrize("pattern_name, shape, kind", [
    ("dense", (64, 64), "bounds"), ("causal", (64, 64), "band"), ("local", (32, 16), "band"),
    ("causal_local", (64, 64), "band"), ("dilated", (64, 64), "band"), ("longformer", (64, 64), "band"),
    ("strided", (64, 64), "strided"), ("axial", (64, 64), "axial"), ("random", (16, 16), "bitmask"),
    ("block_random", (16, 16), "bounds"), ("block_random", (32, 16), "bitmask"),
    ("bigbird", (16, 16), "band"), ("bigbird", (64, 64), "bitmask"), ("prefix_lm", (64, 64), "band"),
    ("sink", (64, 64), "band"), ("neighborhood", (16, 16), "bitmask"),
])
def test_mask_choice(pattern_name, shape, kind):
    spec = tables.mask_spec(pattern_for(pattern_name), [shape])
    assert spec.name == kind
    if pattern_name == "dilated":
        assert (spec.band_lo, spec.band_hi, spec.dilation) == (-6, 6, 3)
    if pattern_name in ("longformer", "bigbird") and kind == "band":
        assert (spec.global_rows, spec.global_cols) == (2, 2) and spec.global_lo <= -N
    if pattern_name == "prefix_lm":
        assert (spec.band_lo, spec.global_rows, spec.global_cols) == (0, 0, 20) and spec.global_lo <= -N
    if pattern_name == "sink":
        assert (spec.band_lo, spec.band_hi, spec.global_rows, spec.global_cols, spec.global_lo) == (0, 11, 0, 2, 0)
    assert spec.q_offset == 0

class NamedCausal(Causal):
    """Shares a built-in name but not its predicate: a formula chosen by name would be wrong."""

    def allowed(self, i, j):
        return (j <= i) & (j % 2 == 0)

def test_mask_choice_never_takes_a_formula_that_may_be_wrong():
    # packed documents: nothing of a formula over positions crosses a document boundary correctly
    for name in ("causal", "local", "dense", "sink", "prefix_lm", "block_random"):
        assert tables.mask_spec(pattern_for(name, documents=[30, 45]), [(16, 16)]).name == "bitmask", name
    # a class that is not the built-in one, whatever its name; and patterns unknown to the kernel
    assert tables.mask_spec(NamedCausal(N), [(64, 64)]).name == "bitmask"
    assert tables.mask_spec(LateCausal(N), [(64, 64)]).name == "bitmask"
    # rows offset by q_offset: random blocks align with tiles only when q_offset is a multiple of block_m
    assert tables.mask_spec(pattern_for("block_random", 96, q_len=48), [(16, 16)]).name == "bounds"
    assert tables.mask_spec(pattern_for("block_random", 96, q_len=40), [(16, 16)]).name == "bitmask"
    assert tables.mask_spec(pattern_for("bigbird", 96, q_len=37), [(16, 16)]).name == "bitmask"
    # formulas over positions carry the offset of row 0
    assert tables.mask_spec(pattern_for("causal", 96, q_len=37), [(16, 16)]).q_offset == 59

def formula_mask(spec: tables.MaskSpec, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """kernels._allowed for a formula, in torch: rows of the matrix, key positions (broadcast)."""
    i, j = rows + spec.q_offset, cols
    if spec.kind == tables.MASK_BAND:
        d = i - j
        ok = (d >= spec.band_lo) & (d <= spec.band_hi) & (d % spec.dilation == 0)
        return ok | (i < spec.global_rows) | ((j < spec.global_cols) & (d >= spec.global_lo))
    if spec.kind == tables.MASK_STRIDED:
        return (i // spec.period == j // spec.period) | (j % spec.period == spec.period - 1)
    if spec.kind == tables.MASK_AXIAL:
        return (i // spec.period == j // spec.period) | (i % spec.period == j % spec.period)
    assert spec.kind == tables.MASK_NONE
    return torch.ones(torch.broadcast_shapes(rows.shape, cols.shape), dtype=torch.bool)

@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("shape", [(16, 16), (32, 16), (64, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pattern_name", BUILTIN)
def test_the_chosen_mask_is_exact_in_every_partial_tile(pattern_name, shape, structure):
    """Whatever mask_spec picks, a formula or bitmasks, it equals the pattern in each partial tile the kernels
    mask by it (no choice returns early: a bitmask choice is checked through its bits)."""
    pattern = structured_pattern(pattern_name, structure)
    spec = tables.mask_spec(pattern, [shape])
    bits = spec.kind == tables.MASK_BITS
    bm, bn = shape
    t = tables.build_tables(pattern.block_sparse(tables.base_block([shape])), bm, bn, with_bits=bits)
    mask = pattern.dense_mask()
    partial = 0
    for r, entries in enumerate(listing(t.row_offsets, t.row_full, t.row_cols, t.row_slots)):
        rows = torch.arange(r * bm, min(pattern.q_len, (r + 1) * bm))
        for c, is_full, slot in entries:
            cols = torch.arange(c * bn, min(pattern.seq_len, (c + 1) * bn))
            expected = mask[rows[:, None], cols[None, :]]
            if is_full or slot == tables.BOUNDS_ONLY:
                assert expected.all(), (r, c)
                continue
            partial += 1
            got = unpack(t.mask_words[slot], bn)[: len(rows), : len(cols)] if bits else \
                formula_mask(spec, rows[:, None], cols[None, :])
            assert torch.equal(got, expected), (r, c)
    assert partial > 0 or bool(mask.all()) or spec.kind != tables.MASK_BITS  # bitmasks are chosen for partial tiles

def test_tile_configs_are_valid():
    groups = {"fwd": launch.FWD_CONFIGS, "dkdv": launch.DKDV_CONFIGS, "dq": launch.DQ_CONFIGS}
    for name, configs in groups.items():
        assert configs and len(set(configs)) == len(configs), name
        for c in (*configs, launch.INTERPRETER_CONFIG):
            for side in (c.block_m, c.block_n):
                assert 16 <= side <= 128 and side & (side - 1) == 0, (name, c)  # tl.dot and tl.arange
            assert c.num_warps in (2, 4, 8) and 1 <= c.num_stages <= 5, (name, c)
    everything = [(c.block_m, c.block_n) for cs in groups.values() for c in cs]
    assert tables.base_block(everything) == 32  # one pattern view at 32 serves every candidate
    assert launch.padded_head_dim(16) == 16 and launch.padded_head_dim(24) == 32
    assert launch.padded_head_dim(80) == 128 and launch.padded_head_dim(128) == 128
