"""The views of a pattern that implementations use, all computed from its matrix (`Pattern.mask`).

They are built one block row at a time over candidate blocks (a superset of the block layout the pattern
derives from its band, its global tokens or its documents), so no view but `dense_mask` builds a
q_len x seq_len buffer, and a banded pattern over 64K tokens costs a few block rows' work.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from bench.patterns.heap import release_free_heap

if TYPE_CHECKING:
    from bench.patterns.documents import DocumentIndex

# Views are built one block row at a time over candidate blocks; this bounds their working memory.
SCAN_BLOCK = 128
TRIM_EVERY_ROWS = 64  # block rows between releases of the heap's free pages


@dataclass(frozen=True)
class BlockSparse:
    """The block-sparse view of a pattern at one block size, as kernels consume it.

    For query block r (rows r*bs .. of the q_len x seq_len matrix), its key blocks are
    `kv_indices[r, :kv_counts[r]]` in increasing order (padded with -1). `full[r, t]` says every in-range
    pair of that block is allowed; otherwise `masks[mask_index[r, t]]` is the (bs, bs) bitmask inside it
    (rows past q_len and columns past seq_len are False).
    """

    seq_len: int
    block_size: int
    kv_counts: Tensor  # int32 (nqb,)
    kv_indices: Tensor  # int32 (nqb, max_kv), -1 padded
    full: Tensor  # bool (nqb, max_kv)
    mask_index: Tensor  # int32 (nqb, max_kv), -1 for full or padding
    masks: Tensor  # bool (n_partial, bs, bs)
    q_len: int | None = None  # rows of the matrix; None: seq_len

    @property
    def num_blocks(self) -> int:
        """Query blocks (rows of the table)."""
        return self.kv_counts.numel()

    @property
    def rows(self) -> int:
        return self.seq_len if self.q_len is None else self.q_len


class PatternViews:
    """The views, as a mixin of `Pattern` (which provides the matrix and the structure read here)."""

    seq_len: int
    q_len: int
    q_offset: Any
    global_tokens: Any
    documents: tuple[int, ...] | None
    _cache: dict[tuple, Any]

    def mask(self, rows: Tensor, cols: Tensor) -> Tensor:
        raise NotImplementedError

    def band(self) -> tuple[float, float] | None:
        raise NotImplementedError

    def has_global_tokens(self) -> bool:
        raise NotImplementedError

    def _document_index(self, device: torch.device) -> DocumentIndex:
        raise NotImplementedError

    # --- candidate blocks -----------------------------------------------------------------------------

    def _row_spans(self, bs: int) -> tuple[Tensor, Tensor]:
        """First and last position of each query block (rows of the matrix, offset to positions)."""
        starts = torch.arange(math.ceil(self.q_len / bs)) * bs
        ends = torch.clamp(starts + bs, max=self.q_len) - 1
        return starts + self.q_offset, ends + self.q_offset

    def _col_spans(self, bs: int) -> tuple[Tensor, Tensor]:
        starts = torch.arange(math.ceil(self.seq_len / bs)) * bs
        return starts, torch.clamp(starts + bs, max=self.seq_len) - 1

    def _band_candidates(self, bs: int) -> Tensor | None:
        band = self.band()
        if band is None:
            return None
        lo, hi = band
        rs, re = self._row_spans(bs)
        cs, ce = self._col_spans(bs)
        # i - j over the block pair spans [i_start - j_end, i_end - j_start]
        return ((re[:, None] - cs[None, :]) >= lo) & ((rs[:, None] - ce[None, :]) <= hi)

    def _position_candidates(self, bs: int) -> Tensor:
        """Bool (nqb, nkb): a superset of the block layout over absolute positions (no documents)."""
        cand = self._band_candidates(bs)
        if cand is None:
            return torch.ones(math.ceil(self.q_len / bs), math.ceil(self.seq_len / bs), dtype=torch.bool)
        if self.has_global_tokens():
            g = self.global_tokens
            rs, _ = self._row_spans(bs)
            cs, _ = self._col_spans(bs)
            cand |= (rs < g)[:, None] | (cs < g)[None, :]
        return cand

    def _candidate_blocks(self, bs: int) -> Tensor:
        """Bool (nqb, nkb): a superset of the block layout, so that views need not scan every block."""
        if self.documents is None:
            return self._position_candidates(bs)
        # Inside documents only what is shift-invariant carries over: the band of i - j.
        index = self._document_index(torch.device("cpu"))
        rs, re = self._row_spans(bs)
        cs, ce = self._col_spans(bs)
        first_r, last_r = index.doc_id[rs], index.doc_id[re]
        first_c, last_c = index.doc_id[cs], index.doc_id[ce]
        cand = (first_r[:, None] <= last_c[None, :]) & (first_c[None, :] <= last_r[:, None])
        band = None if self.has_global_tokens() else self._band_candidates(bs)
        return cand if band is None else cand & band

    def _block_row_scan(self, bs: int) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
        """Yield (block_row, rows, key_blocks, allowed) for each query block, allowed: (rows, kb, bs)."""
        n = self.seq_len
        cand = self._candidate_blocks(bs)
        offs = torch.arange(bs)
        for r in range(cand.shape[0]):
            if r % TRIM_EVERY_ROWS == TRIM_EVERY_ROWS - 1:
                release_free_heap()  # each row's temporaries outgrow the last's holes (bench.patterns.heap)
            rows = torch.arange(r * bs, min(self.q_len, (r + 1) * bs))
            kb = torch.nonzero(cand[r]).flatten()
            cols = (kb[:, None] * bs + offs[None, :]).flatten()  # (kb * bs,)
            in_range = cols < n
            ok = self.mask(rows[:, None], cols.clamp(max=n - 1)[None, :]) & in_range[None, :]
            yield r, rows, kb, ok.reshape(len(rows), len(kb), bs)

    # --- views ------------------------------------------------------------------------------------

    def dense_mask(self) -> Tensor:
        """Bool (q_len, N): True where query row r may attend to key j."""
        key = ("dense",)
        if key not in self._cache:
            n, bs = self.seq_len, SCAN_BLOCK
            mask = torch.zeros(self.q_len, n, dtype=torch.bool)
            for _, rows, kb, ok in self._block_row_scan(bs):
                for t, b in enumerate(kb.tolist()):
                    c1 = min(n, (b + 1) * bs)
                    mask[rows[0] : rows[-1] + 1, b * bs : c1] = ok[:, t, : c1 - b * bs]
            self._cache[key] = mask
        return self._cache[key]

    def csr(self) -> tuple[Tensor, Tensor]:
        """(crow_indices int64 (q_len+1,), col_indices int64 (nnz,)), rows sorted, columns sorted in each row."""
        key = ("csr",)
        if key not in self._cache:
            bs = SCAN_BLOCK
            counts, cols_all = [], []
            offs = torch.arange(bs)
            for _, _rows, kb, ok in self._block_row_scan(bs):
                flat = ok.reshape(ok.shape[0], -1)  # (rows, kb * bs); columns increase along dim 1
                cols = (kb[:, None] * bs + offs[None, :]).flatten()
                counts.append(flat.sum(1))
                _, c_idx = torch.nonzero(flat, as_tuple=True)  # row-major order: sorted
                cols_all.append(cols[c_idx])
            crow = torch.zeros(self.q_len + 1, dtype=torch.int64)
            crow[1:] = torch.cumsum(torch.cat(counts), 0)
            self._cache[key] = (crow, torch.cat(cols_all).to(torch.int64))
        return self._cache[key]

    @property
    def nnz(self) -> int:
        """Allowed pairs of the q_len x seq_len matrix."""
        key = ("nnz",)
        if key not in self._cache:
            if ("csr",) in self._cache:
                self._cache[key] = int(self.csr()[0][-1])
            else:
                self._count_pairs_and_keys()
        return self._cache[key]

    def used_keys(self) -> Tensor:
        """Bool (N,): True where some query row may attend to key j."""
        key = ("used_keys",)
        if key not in self._cache:
            self._count_pairs_and_keys()
        return self._cache[key]

    def _count_pairs_and_keys(self) -> None:
        """nnz and used_keys in one scan of the candidate blocks: at long contexts each scan is seconds."""
        n, bs = self.seq_len, SCAN_BLOCK
        offs = torch.arange(bs)
        used = torch.zeros(math.ceil(n / bs) * bs, dtype=torch.bool)
        total = 0
        for _, _rows, kb, ok in self._block_row_scan(bs):
            total += int(ok.sum())
            cols = (kb[:, None] * bs + offs[None, :]).flatten()
            used[cols] |= ok.any(dim=0).flatten()  # ok is False past N
        self._cache[("nnz",)] = total
        self._cache[("used_keys",)] = used[:n]

    @property
    def density(self) -> float:
        """nnz / (q_len * seq_len)."""
        return self.nnz / (float(self.q_len) * self.seq_len)

    def block_layout(self, block_size: int) -> Tensor:
        """Bool (ceil(q_len/bs), ceil(N/bs)): True where the block holds any allowed pair."""
        bs = block_size
        key = ("layout", bs)
        if key not in self._cache:
            layout = torch.zeros(math.ceil(self.q_len / bs), math.ceil(self.seq_len / bs), dtype=torch.bool)
            for r, _rows, kb, ok in self._block_row_scan(bs):
                layout[r, kb] = ok.any(dim=2).any(dim=0)
            self._cache[key] = layout
        return self._cache[key]

    def block_density(self, block_size: int) -> float:
        """Fraction of blocks holding any allowed pair."""
        layout = self.block_layout(block_size)
        return float(layout.sum()) / layout.numel()

    def block_sparse(self, block_size: int) -> BlockSparse:
        """The lookup table and in-block bitmasks of the block layout (see `BlockSparse`)."""
        key = ("block_sparse", block_size)
        if key not in self._cache:
            bs, n = block_size, self.seq_len
            offs = torch.arange(bs)
            per_row: list[tuple[Tensor, Tensor, Tensor]] = []
            masks: list[Tensor] = []
            for _, rows, kb, ok in self._block_row_scan(bs):
                keep = ok.any(dim=2).any(dim=0)
                kb, ok = kb[keep], ok[:, keep]  # ok: (rows, kept, bs)
                col_valid = (kb[:, None] * bs + offs[None, :]) < n  # (kept, bs)
                full = (ok | ~col_valid[None]).all(dim=2).all(dim=0)
                index = torch.full((len(kb),), -1, dtype=torch.int32)
                for t in torch.nonzero(~full).flatten().tolist():
                    block = torch.zeros(bs, bs, dtype=torch.bool)
                    block[: len(rows)] = ok[:, t]
                    index[t] = len(masks)
                    masks.append(block)
                per_row.append((kb, full, index))
            nqb = len(per_row)
            max_kv = max((len(kb) for kb, _, _ in per_row), default=0)
            kv_counts = torch.tensor([len(kb) for kb, _, _ in per_row], dtype=torch.int32)
            kv_indices = torch.full((nqb, max_kv), -1, dtype=torch.int32)
            full_t = torch.zeros(nqb, max_kv, dtype=torch.bool)
            mask_index = torch.full((nqb, max_kv), -1, dtype=torch.int32)
            for r, (kb, full, index) in enumerate(per_row):
                c = len(kb)
                kv_indices[r, :c] = kb.to(torch.int32)
                full_t[r, :c] = full
                mask_index[r, :c] = index
            stacked = torch.stack(masks) if masks else torch.zeros(0, bs, bs, dtype=torch.bool)
            self._cache[key] = BlockSparse(n, bs, kv_counts, kv_indices, full_t, mask_index, stacked,
                                           q_len=self.q_len)
        return self._cache[key]
