"""Lookup tables the kernels read: which tiles each program visits, and how partial tiles are masked.

Built once per (pattern, tile shape), untimed, from the pattern's `block_sparse(g)` view at a base block size
g that divides every tile side in use. The view, and so the tables, are of the pattern's q_len x N matrix
(rows: the last q_len positions, row r is position r + q_offset; bottom-right alignment): there are
ceil(q_len / block_m) query tiles of rows and ceil(N / block_n) key tiles. A tile of `block_m` query rows x
`block_n` keys is

- listed when any of its pairs is allowed (exactly the pattern's block layout at that tile shape);
- full when every pair with an in-range query row (< q_len) is allowed and all its keys are < N: the
  kernels apply no mask at all there;
- partial otherwise: the kernel masks it by the pattern's formula (`MaskSpec`, over positions: rows are
  offset by q_offset), or, for irregular patterns, by its bitmask (slot `s` of `mask_words`, (block_m,
  ceil(block_n / 32)) int32 words, bit b of word w = key w * 32 + b inside the tile). Without bitmasks, a
  tile whose every in-range pair is allowed but whose keys run past N has slot BOUNDS_ONLY: the kernel masks
  only the sequence end there, which matters where the formula covers just part of the pattern (bigbird's
  band, beside its kept random blocks).

Per query tile r, `row_cols[row_offsets[r]:row_offsets[r + 1]]` are its key tiles, the first `row_full[r]` of
them full (the forward and dQ passes). Per key tile c, `col_rows[col_offsets[c]:col_offsets[c + 1]]` are
its query tiles, full first (the transposed table of the dK/dV pass). Within each group indices increase.
The tables do not depend on heads: every query head uses them, whichever KV head it reads (GQA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from bench.patterns import builtin as bp

# Mask kinds inside partial tiles; kernels.py branches on them (as constexpr) when it is compiled.
MASK_NONE = 0  # only the sequence bound: every in-range pair of a listed tile is allowed
MASK_BAND = 1  # lo <= i - j <= hi, optionally (i - j) % dilation == 0, optionally or a global part (MaskSpec)
MASK_STRIDED = 2  # i // W == j // W or j % W == W - 1
MASK_AXIAL = 3  # i // C == j // C or i % C == j % C
MASK_BITS = 4  # a bitmask per partial tile
BOUNDS_ONLY = -2  # slot of a partial tile that only the sequence end cuts (formula masks)
# Sub-block states in the status grid at the base block size.
_OUT, _EMPTY, _FULL = -3, -2, -1  # past N / nothing allowed / everything allowed; >= 0: partial, mask index
# Tiles per chunk when bitmasks are assembled: bounds the working memory (~chunk * block_m * block_n bytes).
_MASK_CHUNK_ELEMS = 1 << 24


@dataclass(frozen=True)
class MaskSpec:
    """How a kernel masks partial tiles: a formula kind with its scalars, or per-tile bitmasks.

    Formulas are over positions i = query row + q_offset (q_offset = seq_len - q_len) and j. MASK_BAND with
    a global part allows besides the band every pair with i < global_rows, or with j < global_cols and
    i - j >= global_lo: longformer's global tokens (rows and columns, global_lo below any i - j),
    prefix_lm's prefix (columns only), sink's sink tokens (columns, causal: global_lo 0).
    """

    kind: int
    band_lo: int = 0
    band_hi: int = 0
    dilation: int = 1
    global_rows: int = 0
    global_cols: int = 0
    global_lo: int = 0
    period: int = 1
    q_offset: int = 0

    @property
    def has_global(self) -> bool:
        return self.kind == MASK_BAND and (self.global_rows > 0 or self.global_cols > 0)

    @property
    def name(self) -> str:
        return {MASK_NONE: "bounds", MASK_BAND: "band", MASK_STRIDED: "strided", MASK_AXIAL: "axial",
                MASK_BITS: "bitmask"}[self.kind]


# The built-in patterns with an exact formula (some only when their blocks align with the tiles).
_FORMULA_PATTERNS = frozenset({bp.Dense, bp.Causal, bp.Local, bp.CausalLocal, bp.Dilated, bp.Longformer,
                               bp.BigBird, bp.PrefixLM, bp.Sink, bp.Strided, bp.Axial, bp.BlockRandom})


def mask_spec(pattern, tile_shapes: list[tuple[int, int]]) -> MaskSpec:
    """The cheapest exact mask for `pattern`'s partial tiles at every tile shape in `tile_shapes`.

    Only the built-in patterns have formulas (docs/DESIGN.md's table), and only without packed documents; the
    class is checked, not just the name, so that a pattern that merely shares a name gets bitmasks.
    block_random and bigbird are formulas only when every tile lies inside one of the pattern's blocks
    (tile sides divide the block size and the first row's position q_offset is a multiple of block_m: the
    random part is then constant over a tile, so a partial tile is one it does not keep); otherwise, and for
    random, neighborhood, custom patterns and documents, bitmasks.
    """
    spec = _formula(pattern, tile_shapes)
    return spec if spec.kind == MASK_BITS else replace(spec, q_offset=pattern.q_offset)


def _formula(pattern, tile_shapes: list[tuple[int, int]]) -> MaskSpec:
    kind = type(pattern)
    if pattern.documents is not None or kind not in _FORMULA_PATTERNS:
        return MaskSpec(MASK_BITS)
    n = pattern.seq_len
    half = pattern.window // 2
    below = -n  # below any i - j: a global part without a causal limit
    aligned = all(pattern.block_size % bm == 0 and pattern.block_size % bn == 0 and pattern.q_offset % bm == 0
                  for bm, bn in tile_shapes)
    if kind is bp.Dense:
        return MaskSpec(MASK_NONE)
    if kind is bp.Causal:
        return MaskSpec(MASK_BAND, band_lo=0, band_hi=n)
    if kind is bp.Local:
        return MaskSpec(MASK_BAND, band_lo=-half, band_hi=half)
    if kind is bp.CausalLocal:
        return MaskSpec(MASK_BAND, band_lo=0, band_hi=pattern.window - 1)
    if kind is bp.Dilated:
        return MaskSpec(MASK_BAND, band_lo=-half, band_hi=half, dilation=pattern.dilation)
    if kind is bp.Longformer or (kind is bp.BigBird and aligned):
        g = pattern.global_tokens
        return MaskSpec(MASK_BAND, band_lo=-half, band_hi=half, global_rows=g, global_cols=g, global_lo=below)
    if kind is bp.PrefixLM:  # j < P or j <= i
        return MaskSpec(MASK_BAND, band_lo=0, band_hi=n, global_cols=pattern.prefix, global_lo=below)
    if kind is bp.Sink:  # 0 <= i - j < W, or j < g and j <= i
        return MaskSpec(MASK_BAND, band_lo=0, band_hi=pattern.window - 1, global_cols=pattern.global_tokens,
                        global_lo=0)
    if kind is bp.Strided:
        return MaskSpec(MASK_STRIDED, period=pattern.window)
    if kind is bp.Axial:
        return MaskSpec(MASK_AXIAL, period=pattern.window)
    if kind is bp.BlockRandom and aligned:
        return MaskSpec(MASK_NONE)
    return MaskSpec(MASK_BITS)


@dataclass(frozen=True)
class TileTables:
    """The tables of one tile shape (see the module docstring); int32 tensors on one device."""

    block_m: int
    block_n: int
    row_offsets: Tensor  # (n_qtiles + 1,)
    row_full: Tensor  # (n_qtiles,)
    row_cols: Tensor  # (n_listed,)
    row_slots: Tensor  # (n_listed,) bitmask slot of a partial tile (or BOUNDS_ONLY), -1 for a full one
    col_offsets: Tensor  # (n_ktiles + 1,)
    col_full: Tensor  # (n_ktiles,)
    col_rows: Tensor  # (n_listed,)
    col_slots: Tensor  # (n_listed,)
    mask_words: Tensor  # (n_partial, block_m, words), or (1, 1, 1) zeros when no bitmask is needed
    n_full: int
    n_partial: int

    @property
    def words(self) -> int:
        return math.ceil(self.block_n / 32)

    @property
    def n_listed(self) -> int:
        return self.n_full + self.n_partial

    def to(self, device: torch.device | str) -> TileTables:
        moved = {f: getattr(self, f).to(device) for f in ("row_offsets", "row_full", "row_cols", "row_slots",
                                                          "col_offsets", "col_full", "col_rows", "col_slots",
                                                          "mask_words")}
        return TileTables(self.block_m, self.block_n, n_full=self.n_full, n_partial=self.n_partial, **moved)


def base_block(tile_shapes: list[tuple[int, int]]) -> int:
    """The base block size g of the pattern view: the gcd of every tile side (powers of two: the smallest)."""
    return math.gcd(*[side for shape in tile_shapes for side in shape])


def status_grid(view) -> Tensor:
    """int32 (nqb, nkb) at the view's block size (query blocks of its q_len rows x key blocks of its N keys):
    _EMPTY, _FULL, or the index of the block's mask in view.masks."""
    nqb, nkb = view.num_blocks, math.ceil(view.seq_len / view.block_size)
    grid = torch.full((nqb, nkb), _EMPTY, dtype=torch.int32)
    listed = view.kv_indices >= 0
    rows = torch.arange(nqb).unsqueeze(1).expand_as(view.kv_indices)[listed]
    cols = view.kv_indices[listed].long()
    grid[rows, cols] = torch.where(view.full[listed], torch.tensor(_FULL, dtype=torch.int32),
                                   view.mask_index[listed])
    return grid


def build_tables(view, block_m: int, block_n: int, with_bits: bool) -> TileTables:
    """Tables at tile shape (block_m, block_n) from a pattern's `block_sparse(g)` view, g dividing both.

    The view's q_len rows (`view.rows`) make ceil(q_len / block_m) query tiles, its N keys ceil(N / block_n)
    key tiles.
    """
    g, n = view.block_size, view.seq_len
    if block_m % g or block_n % g:
        raise ValueError(f"tile {block_m}x{block_n} is not a multiple of the view's block size {g}")
    a, b = block_m // g, block_n // g
    n_qtiles, n_ktiles = math.ceil(view.rows / block_m), math.ceil(n / block_n)
    grid = torch.full((n_qtiles * a, n_ktiles * b), _OUT, dtype=torch.int32)
    status = status_grid(view)
    grid[: status.shape[0], : status.shape[1]] = status
    sub = grid.view(n_qtiles, a, n_ktiles, b).permute(0, 2, 1, 3)  # (qtile, ktile, a, b)
    listed = (sub >= _FULL).flatten(2).any(dim=2)
    keys_in_range = (torch.arange(1, n_ktiles + 1) * block_n <= n)[None, :]
    pattern_full = listed & ((sub == _FULL) | (sub == _OUT)).flatten(2).all(dim=2)  # every in-range pair
    full = pattern_full & keys_in_range

    qt, kt = torch.nonzero(listed, as_tuple=True)  # row-major: query tile, then key tile ascending
    is_partial = ~full[qt, kt]
    slots = torch.full(qt.shape, -1, dtype=torch.int32)
    slots[is_partial] = torch.arange(int(is_partial.sum()), dtype=torch.int32)
    if not with_bits:
        slots[pattern_full[qt, kt] & is_partial] = BOUNDS_ONLY

    def csr(major: Tensor, minor: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        order = torch.sort(major * 2 + is_partial.long(), stable=True).indices  # full first, minor ascending
        offsets = torch.zeros(count + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(torch.bincount(major, minlength=count), 0)
        n_full = torch.bincount(major[~is_partial], minlength=count).to(torch.int32)
        return offsets, n_full, minor[order].to(torch.int32), slots[order]

    row_offsets, row_full, row_cols, row_slots = csr(qt, kt, n_qtiles)
    col_offsets, col_full, col_rows, col_slots = csr(kt, qt, n_ktiles)
    n_partial = int(is_partial.sum())
    words = (_pack_masks(view, sub, qt[is_partial], kt[is_partial], block_m, block_n) if with_bits and n_partial
             else torch.zeros(1, 1, 1, dtype=torch.int32))
    return TileTables(block_m, block_n, row_offsets, row_full, row_cols, row_slots, col_offsets, col_full,
                      col_rows, col_slots, words, n_full=len(qt) - n_partial, n_partial=n_partial)


def _pack_masks(view, sub: Tensor, qt: Tensor, kt: Tensor, block_m: int, block_n: int) -> Tensor:
    """int32 (len(qt), block_m, words): the bitmask of each partial tile, assembled from the view's blocks."""
    g, n, n_rows = view.block_size, view.seq_len, view.rows
    words = math.ceil(block_n / 32)
    # Masks by sub-block state: index state + 3 -> out of range, empty, full, then the view's partial masks.
    library = torch.cat([torch.zeros(2, g, g, dtype=torch.bool), torch.ones(1, g, g, dtype=torch.bool),
                         view.masks.to(torch.bool)])
    bit_weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    row_in = torch.arange(block_m)
    col_in = torch.arange(block_n)
    out = torch.empty(len(qt), block_m, words, dtype=torch.int32)
    chunk = max(1, _MASK_CHUNK_ELEMS // (block_m * block_n))
    for start in range(0, len(qt), chunk):
        q, k = qt[start:start + chunk], kt[start:start + chunk]
        states = sub[q, k].long() + 3  # (t, a, b)
        bits = library[states].permute(0, 1, 3, 2, 4).reshape(len(q), block_m, block_n)
        in_range = (((q[:, None] * block_m + row_in)[:, :, None] < n_rows)
                    & ((k[:, None] * block_n + col_in)[:, None, :] < n))
        bits = bits & in_range
        padded = torch.zeros(len(q), block_m, words * 32, dtype=torch.int64)
        padded[:, :, :block_n] = bits
        packed = (padded.view(len(q), block_m, words, 32) * bit_weights).sum(dim=3)  # in [0, 2**32)
        out[start:start + chunk] = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return out
