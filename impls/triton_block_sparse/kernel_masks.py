"""What every kernel of kernels.py shares: the mask kinds and score modifications (constexpr globals, the only
globals jit code may read) and `_allowed`, the predicate of a partial tile's mask.

Import it, like kernels.py, only through `mode.kernels()` (TRITON_INTERPRET decides what the decorator builds).
"""

import triton
import triton.language as tl

from impls.triton_block_sparse import score_mods, tables

# Mask kinds inside partial tiles (tables.MaskSpec.kind); jit code may only read constexpr globals.
BAND = tl.constexpr(tables.MASK_BAND)
STRIDED = tl.constexpr(tables.MASK_STRIDED)
AXIAL = tl.constexpr(tables.MASK_AXIAL)
BITS = tl.constexpr(tables.MASK_BITS)  # (BLOCK_M, BLOCK_N) bits per partial tile, 32 keys per int32 word
BOUNDS_ONLY = tl.constexpr(tables.BOUNDS_ONLY)  # slot of a tile only the sequence end cuts (formula kinds)
# Score modifications (MOD_KIND), applied to the scaled scores before the mask: softcap c * tanh(s / c), with
# cap2 = c * log2(e) since scores are in log2 units; or a bias by head and distance (ALiBi, T5's relative bias)
# read from BIAS (H, 2N - 1) (log2 units, entry pos - key + N - 1). tanh(x) = 1 - 2 / (exp(2x) + 1).
MOD_NONE = tl.constexpr(score_mods.MOD_NONE)
MOD_SOFTCAP = tl.constexpr(score_mods.MOD_SOFTCAP)
MOD_BIAS = tl.constexpr(score_mods.MOD_BIAS)
TWO_LOG2E = tl.constexpr(2.8853900817779268)


@triton.jit
def _allowed(rows, cols, slot, mask_words, q_offset, band_lo, band_hi, dilation, global_rows, global_cols,
             global_lo, period, MASK_KIND: tl.constexpr, HAS_DILATION: tl.constexpr, HAS_GLOBAL: tl.constexpr,
             TILE_M: tl.constexpr, TILE_N: tl.constexpr, WORDS: tl.constexpr):
    """Whether query `rows` may attend to key `cols` (broadcast against each other), inside a partial tile.

    `rows` are rows of the q_len x N matrix; formulas compare positions, rows + q_offset. For MASK_BITS the
    tile's bitmask is `slot` in mask_words (n_partial, TILE_M, WORDS); rows and cols are then taken relative
    to the tile (their offsets modulo the tile shape). For formulas, slot BOUNDS_ONLY marks a tile whose every
    pair is allowed (the caller applies the sequence end).
    """
    if MASK_KIND == BAND:
        pos = rows + q_offset
        diff = pos - cols
        ok = (diff >= band_lo) & (diff <= band_hi)
        if HAS_DILATION:
            ok = ok & (diff % dilation == 0)
        if HAS_GLOBAL:
            ok = ok | (pos < global_rows) | ((cols < global_cols) & (diff >= global_lo))
    elif MASK_KIND == STRIDED:
        pos = rows + q_offset
        ok = ((pos // period) == (cols // period)) | ((cols % period) == period - 1)
    elif MASK_KIND == AXIAL:
        pos = rows + q_offset
        ok = ((pos // period) == (cols // period)) | ((pos % period) == (cols % period))
    elif MASK_KIND == BITS:
        local_r = rows % TILE_M
        local_c = cols % TILE_N
        words = tl.load(mask_words + slot.to(tl.int64) * (TILE_M * WORDS) + local_r * WORDS + local_c // 32)
        ok = ((words >> (local_c % 32)) & 1) != 0
    else:
        ok = (rows >= 0) & (cols >= 0)
    if MASK_KIND != BITS:
        ok = ok | (slot == BOUNDS_ONLY)  # the caller still masks keys past the sequence end
    return ok
