"""Sparsity patterns, each defined once as a predicate `allowed(i, j)` over query index i and key index j.

Every view an implementation uses - `dense_mask()`, `csr()`, `block_layout(bs)`, `block_sparse(bs)`,
`density`, `block_density(bs)` - is computed from that predicate, so no implementation invents its own
semantics. The predicates use only elementwise torch ops on int64 tensors, which is also what
FlexAttention's `mask_mod` needs, so `flex` can use them as they are.

Random patterns draw from a counter-based hash of (seed, i, j) rather than from a generator's stream: the
predicate can then be evaluated on any sub-block independently and depends only on the seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

# Case fields a pattern may read. `make_pattern` accepts any of them; each pattern uses its own subset.
PATTERN_FIELDS = ("window", "density", "block_size", "dilation", "global_tokens", "seed")

# Views are built one block row at a time over candidate blocks; this bounds their working memory.
_SCAN_BLOCK = 128

_MASK32 = 0xFFFFFFFF


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32  # the product can wrap int64; the low 32 bits stay exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _seed_key(seed: int | Tensor) -> int | Tensor:
    """Mix the seed once so that nearby seeds give unrelated patterns (an int, or a 0-dim int64 tensor).

    Out-of-place ops only: compiled FlexAttention mask_mods cannot lower in-place ones.
    """
    h = seed & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def hash_keep(seed_key: int | Tensor, a: Tensor, b: Tensor, threshold: int | Tensor) -> Tensor:
    """True where hash(seed, a, b) < threshold, a uniform draw with probability threshold / 2**32."""
    h = _fmix32(((a * 0x9E3779B1) ^ seed_key) & _MASK32)
    h = _fmix32((h ^ ((b * 0x85EBCA77) & _MASK32)) & _MASK32)
    return h < threshold


def keep_threshold(p: float | Tensor) -> int | Tensor:
    """round(p * 2**32): the `hash_keep` threshold for probability p.

    p may also be a 0-dim float64 tensor (FlexAttention's mask_mod reads pattern fields from tensors so that
    compiled graphs do not bake them in); both round half to even and p * 2**32 is exact in float64.
    """
    scaled = p * 2**32
    return torch.round(scaled) if isinstance(scaled, Tensor) else round(scaled)


@dataclass(frozen=True)
class BlockSparse:
    """The block-sparse view of a pattern at one block size, as kernels consume it.

    For query block r, its key blocks are `kv_indices[r, :kv_counts[r]]` in increasing order (padded with
    -1). `full[r, t]` says every in-range pair of that block is allowed; otherwise `masks[mask_index[r, t]]`
    is the (bs, bs) bitmask inside it (rows and columns past seq_len are False).
    """

    seq_len: int
    block_size: int
    kv_counts: Tensor  # int32 (nqb,)
    kv_indices: Tensor  # int32 (nqb, max_kv), -1 padded
    full: Tensor  # bool (nqb, max_kv)
    mask_index: Tensor  # int32 (nqb, max_kv), -1 for full or padding
    masks: Tensor  # bool (n_partial, bs, bs)

    @property
    def num_blocks(self) -> int:
        return self.kv_counts.numel()


class Pattern:
    """A sparsity pattern over an N x N attention matrix. Subclasses define `allowed` and their fields."""

    name: ClassVar[str]
    fields: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""

    def __init__(self, seq_len: int, **fields: int | float | None) -> None:
        def get(name: str, default: int) -> int:
            value = fields.get(name)
            return default if value is None else int(value)

        self.seq_len = int(seq_len)
        self.window = get("window", 64)  # defaults as for a case (bench.case.Case)
        density = fields.get("density")
        self.p: float | None = None if density is None else float(density)
        self.block_size = get("block_size", 64)
        self.dilation = get("dilation", 1)
        self.global_tokens = get("global_tokens", 0)
        self.seed = get("seed", 0)
        problems = self.problems()
        if problems:
            field, message = problems[0]
            raise ValueError(f"pattern {self.name}: {field}: {message}")
        self._cache: dict[tuple, object] = {}

    # --- definition -------------------------------------------------------------------------------

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        """Bool tensor, broadcast over int64 query indices i and key indices j."""
        raise NotImplementedError

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for each field value this pattern cannot take; empty when valid."""
        out: list[tuple[str, str]] = []
        if self.seq_len < 1:
            out.append(("seq_len", f"got {self.seq_len}; must be >= 1"))
        if "window" in self.fields and self.window < 1:
            out.append(("window", f"got {self.window}; must be >= 1"))
        if "dilation" in self.fields and self.dilation < 1:
            out.append(("dilation", f"got {self.dilation}; must be >= 1"))
        if "global_tokens" in self.fields and self.global_tokens < 0:
            out.append(("global_tokens", f"got {self.global_tokens}; must be >= 0"))
        if "block_size" in self.fields and self.block_size < 1:
            out.append(("block_size", f"got {self.block_size}; must be >= 1"))
        if "density" in self.fields and self.p is None:
            out.append(("density", f"not set; pattern {self.name} needs a density in [0, 1]"))
        elif "density" in self.fields and not 0.0 <= self.p <= 1.0:  # type: ignore[operator]
            out.append(("density", f"got {self.p}; pattern {self.name} needs a density in [0, 1]"))
        return out

    def band(self) -> tuple[float, float] | None:
        """Range (lo, hi) of i - j outside which nothing is allowed (besides global tokens), if any."""
        return None

    def params(self) -> dict[str, int | float | None]:
        return {f: getattr(self, "p" if f == "density" else f) for f in self.fields}

    @property
    def label(self) -> str:
        """Series label carrying the parameters, e.g. `local_w64`, `block_random_p0.1_b64_s0`."""
        short = {"window": "w", "density": "p", "block_size": "b", "dilation": "d", "global_tokens": "g",
                 "seed": "s"}
        parts = [self.name] + [f"{short[f]}{v:g}" if isinstance(v, float) else f"{short[f]}{v}"
                               for f, v in self.params().items()]
        return "_".join(parts)

    def __repr__(self) -> str:
        return f"<Pattern {self.label} N={self.seq_len}>"

    # --- views --------------------------------------------------------------------------------------

    def _candidate_blocks(self, bs: int) -> Tensor:
        """Bool (nb, nb): a superset of the block layout, so that views need not scan every block."""
        nb = math.ceil(self.seq_len / bs)
        band = self.band()
        if band is None:
            return torch.ones(nb, nb, dtype=torch.bool)
        lo, hi = band
        starts = torch.arange(nb) * bs
        ends = torch.clamp(starts + bs, max=self.seq_len) - 1
        # i - j over the block pair spans [i_start - j_end, i_end - j_start]
        dmin = starts[:, None] - ends[None, :]
        dmax = ends[:, None] - starts[None, :]
        cand = (dmax >= lo) & (dmin <= hi)
        g = self.global_tokens if "global_tokens" in self.fields else 0
        if g > 0:
            cand |= (starts < g)[:, None] | (starts < g)[None, :]
        return cand

    def _block_row_scan(self, bs: int):
        """Yield (block_row, rows, key_blocks, allowed) for each query block, allowed: (rows, kb, bs)."""
        n = self.seq_len
        cand = self._candidate_blocks(bs)
        offs = torch.arange(bs)
        for r in range(cand.shape[0]):
            rows = torch.arange(r * bs, min(n, (r + 1) * bs))
            kb = torch.nonzero(cand[r]).flatten()
            cols = (kb[:, None] * bs + offs[None, :]).flatten()  # (kb * bs,)
            ok = self.allowed(rows[:, None], cols[None, :]) & (cols < n)[None, :]
            yield r, rows, kb, ok.reshape(len(rows), len(kb), bs)

    def dense_mask(self) -> Tensor:
        """Bool (N, N): True where query i may attend to key j."""
        key = ("dense",)
        if key not in self._cache:
            n = self.seq_len
            mask = torch.zeros(n, n, dtype=torch.bool)
            bs = _SCAN_BLOCK
            for _, rows, kb, ok in self._block_row_scan(bs):
                for t, b in enumerate(kb.tolist()):
                    c1 = min(n, (b + 1) * bs)
                    mask[rows[0] : rows[-1] + 1, b * bs : c1] = ok[:, t, : c1 - b * bs]
            self._cache[key] = mask
        return self._cache[key]  # type: ignore[return-value]

    def csr(self) -> tuple[Tensor, Tensor]:
        """(crow_indices int64 (N+1,), col_indices int64 (nnz,)), rows sorted, columns sorted in each row."""
        key = ("csr",)
        if key not in self._cache:
            bs = _SCAN_BLOCK
            counts, cols_all = [], []
            offs = torch.arange(bs)
            for _, _rows, kb, ok in self._block_row_scan(bs):
                flat = ok.reshape(ok.shape[0], -1)  # (rows, kb * bs); columns increase along dim 1
                cols = (kb[:, None] * bs + offs[None, :]).flatten()
                counts.append(flat.sum(1))
                _, c_idx = torch.nonzero(flat, as_tuple=True)  # row-major order: sorted
                cols_all.append(cols[c_idx])
            crow = torch.zeros(self.seq_len + 1, dtype=torch.int64)
            crow[1:] = torch.cumsum(torch.cat(counts), 0)
            self._cache[key] = (crow, torch.cat(cols_all).to(torch.int64))
        return self._cache[key]  # type: ignore[return-value]

    @property
    def nnz(self) -> int:
        key = ("nnz",)
        if key not in self._cache:
            if ("csr",) in self._cache:
                self._cache[key] = int(self.csr()[0][-1])
            else:
                self._cache[key] = sum(int(ok.sum()) for *_, ok in self._block_row_scan(_SCAN_BLOCK))
        return self._cache[key]  # type: ignore[return-value]

    @property
    def density(self) -> float:
        """nnz / N^2."""
        return self.nnz / float(self.seq_len) ** 2

    def block_layout(self, block_size: int) -> Tensor:
        """Bool (ceil(N/bs), ceil(N/bs)): True where the block holds any allowed pair."""
        bs = block_size
        key = ("layout", bs)
        if key not in self._cache:
            nb = math.ceil(self.seq_len / bs)
            layout = torch.zeros(nb, nb, dtype=torch.bool)
            for r, _rows, kb, ok in self._block_row_scan(bs):
                layout[r, kb] = ok.any(dim=2).any(dim=0)
            self._cache[key] = layout
        return self._cache[key]  # type: ignore[return-value]

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
            self._cache[key] = BlockSparse(n, bs, kv_counts, kv_indices, full_t, mask_index, stacked)
        return self._cache[key]  # type: ignore[return-value]


# --- the pattern table (DESIGN.md) ----------------------------------------------------------------------

PATTERNS: dict[str, type[Pattern]] = {}


def _pattern(cls: type[Pattern]) -> type[Pattern]:
    PATTERNS[cls.name] = cls
    return cls


@_pattern
class Dense(Pattern):
    name = "dense"
    description = "every query attends to every key"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        return (i >= 0) & (j >= 0)


@_pattern
class Causal(Pattern):
    name = "causal"
    description = "j <= i"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        return j <= i

    def band(self) -> tuple[float, float]:
        return (0, math.inf)


@_pattern
class Local(Pattern):
    name = "local"
    fields = ("window",)
    description = "abs(i - j) <= W // 2 (seed 001's loop)"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        return (i - j).abs() <= self.window // 2

    def band(self) -> tuple[float, float]:
        return (-(self.window // 2), self.window // 2)


@_pattern
class CausalLocal(Pattern):
    name = "causal_local"
    fields = ("window",)
    description = "0 <= i - j < W (flash-attn window_size=(W-1, 0))"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        d = i - j
        return (d >= 0) & (d < self.window)

    def band(self) -> tuple[float, float]:
        return (0, self.window - 1)


@_pattern
class Dilated(Pattern):
    name = "dilated"
    fields = ("window", "dilation")
    description = "abs(i - j) <= W // 2 and (i - j) % d == 0"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        d = i - j
        return (d.abs() <= self.window // 2) & (d % self.dilation == 0)

    def band(self) -> tuple[float, float]:
        return (-(self.window // 2), self.window // 2)


@_pattern
class Strided(Pattern):
    name = "strided"
    fields = ("window",)
    description = "i // W == j // W, or j % W == W - 1 (Sparse Transformer 'fixed')"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        w = self.window
        return (i // w == j // w) | (j % w == w - 1)


@_pattern
class Longformer(Pattern):
    name = "longformer"
    fields = ("window", "global_tokens")
    description = "local(W), or i < g, or j < g"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        g = self.global_tokens
        return ((i - j).abs() <= self.window // 2) | (i < g) | (j < g)

    def band(self) -> tuple[float, float]:
        return (-(self.window // 2), self.window // 2)


@_pattern
class BlockRandom(Pattern):
    name = "block_random"
    fields = ("density", "block_size", "seed")
    description = "block (i//bs, j//bs) kept with probability p; diagonal blocks always kept"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        bi, bj = i // self.block_size, j // self.block_size
        threshold = keep_threshold(self.p)  # type: ignore[arg-type]
        return (bi == bj) | hash_keep(_seed_key(self.seed), bi, bj, threshold)

    def _candidate_blocks(self, bs: int) -> Tensor:
        # The kept blocks at the pattern's own block size are cheap to list; a view block is a candidate
        # when it overlaps any of them.
        pbs = self.block_size
        npb = math.ceil(self.seq_len / pbs)
        b = torch.arange(npb)
        kept = self.allowed(b[:, None] * pbs, b[None, :] * pbs).to(torch.int64)
        return _overlap_any(kept, pbs, bs, self.seq_len)


@_pattern
class BigBird(Pattern):
    name = "bigbird"
    fields = ("window", "global_tokens", "density", "block_size", "seed")
    description = "longformer(W, g) or block_random(p)"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        g = self.global_tokens
        local = ((i - j).abs() <= self.window // 2) | (i < g) | (j < g)
        bi, bj = i // self.block_size, j // self.block_size
        threshold = keep_threshold(self.p)  # type: ignore[arg-type]
        return local | (bi == bj) | hash_keep(_seed_key(self.seed), bi, bj, threshold)

    def _candidate_blocks(self, bs: int) -> Tensor:
        banded = Longformer(self.seq_len, window=self.window, global_tokens=self.global_tokens)
        rand = BlockRandom(self.seq_len, density=self.p, block_size=self.block_size, seed=self.seed)
        return banded._candidate_blocks(bs) | rand._candidate_blocks(bs)


@_pattern
class Random(Pattern):
    name = "random"
    fields = ("density", "seed")
    description = "each pair kept with probability p; the diagonal always kept"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        threshold = keep_threshold(self.p)  # type: ignore[arg-type]
        return (i == j) | hash_keep(_seed_key(self.seed), i, j, threshold)


@_pattern
class Axial(Pattern):
    name = "axial"
    fields = ("window",)
    description = "seq_len = R*C with C = window: same row (i // C == j // C) or same column (i % C == j % C)"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        c = self.window
        return (i // c == j // c) | (i % c == j % c)

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        if not out and self.seq_len % self.window:
            out.append(("seq_len", f"got {self.seq_len}; axial needs seq_len = R*C, a multiple of "
                                   f"window C = {self.window}"))
        return out


def _overlap_any(kept: Tensor, pbs: int, bs: int, n: int) -> Tensor:
    """Which (bs-sized) view blocks overlap a kept (pbs-sized) pattern block; kept: int64 (npb, npb)."""
    nb = math.ceil(n / bs)
    # 2-D prefix sums answer "any kept block in this rectangle" for every view block at once.
    pre = torch.zeros(kept.shape[0] + 1, kept.shape[1] + 1, dtype=torch.int64)
    pre[1:, 1:] = kept.cumsum(0).cumsum(1)
    starts = torch.arange(nb) * bs
    lo = starts // pbs
    hi = (torch.clamp(starts + bs, max=n) - 1) // pbs + 1
    total = pre[hi[:, None], hi[None, :]] - pre[lo[:, None], hi[None, :]] - pre[hi[:, None], lo[None, :]] \
        + pre[lo[:, None], lo[None, :]]
    return total > 0


def make_pattern(name: str, seq_len: int, **fields: int | float | None) -> Pattern:
    """The pattern `name` of the table over seq_len tokens; fields are the case fields it reads.

    Raises ValueError naming the allowed names or the bad field.
    """
    if name not in PATTERNS:
        raise ValueError(f"unknown pattern {name!r}; known patterns: {', '.join(sorted(PATTERNS))}")
    unknown = sorted(set(fields) - set(PATTERN_FIELDS))
    if unknown:
        raise ValueError(f"make_pattern got unknown field(s) {unknown}; pattern fields are {list(PATTERN_FIELDS)}")
    return PATTERNS[name](seq_len, **fields)
