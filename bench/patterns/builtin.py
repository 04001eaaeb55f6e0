"""The built-in patterns: the table of docs/DESIGN.md, one predicate each (i = query position, j = key position)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bench.patterns.base import Pattern
from bench.patterns.hashing import hash_keep, keep_threshold, seed_key
from bench.patterns.registry import builtin


@builtin
class Dense(Pattern):
    name = "dense"
    description = "every query attends to every key"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        return (i >= 0) & (j >= 0)


@builtin
class Causal(Pattern):
    name = "causal"
    description = "j <= i"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        return j <= i

    def band(self) -> tuple[float, float]:
        return (0, math.inf)


@builtin
class Local(Pattern):
    name = "local"
    fields = ("window",)
    description = "abs(i - j) <= W // 2 (seed 001's loop)"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        return (i - j).abs() <= self.window // 2

    def band(self) -> tuple[float, float]:
        return (-(self.window // 2), self.window // 2)


@builtin
class CausalLocal(Pattern):
    name = "causal_local"
    fields = ("window",)
    description = "0 <= i - j < W (flash-attn window_size=(W-1, 0))"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        d = i - j
        return (d >= 0) & (d < self.window)

    def band(self) -> tuple[float, float]:
        return (0, self.window - 1)


@builtin
class Dilated(Pattern):
    name = "dilated"
    fields = ("window", "dilation")
    description = "abs(i - j) <= W // 2 and (i - j) % d == 0"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        d = i - j
        return (d.abs() <= self.window // 2) & (d % self.dilation == 0)

    def band(self) -> tuple[float, float]:
        return (-(self.window // 2), self.window // 2)


@builtin
class Strided(Pattern):
    name = "strided"
    fields = ("window",)
    description = "i // W == j // W, or j % W == W - 1 (Sparse Transformer 'fixed')"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        w = self.window
        return (i // w == j // w) | (j % w == w - 1)


@builtin
class Longformer(Pattern):
    name = "longformer"
    fields = ("window", "global_tokens")
    description = "local(W), or i < g, or j < g"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        g = self.global_tokens
        return ((i - j).abs() <= self.window // 2) | (i < g) | (j < g)

    def band(self) -> tuple[float, float]:
        return (-(self.window // 2), self.window // 2)


@builtin
class BlockRandom(Pattern):
    name = "block_random"
    fields = ("density", "block_size", "seed")
    description = "block (i//bs, j//bs) kept with probability p; diagonal blocks always kept"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        bi, bj = i // self.block_size, j // self.block_size
        return (bi == bj) | hash_keep(seed_key(self.seed), bi, bj, keep_threshold(self.p))

    def _position_candidates(self, bs: int) -> Tensor:
        # The kept blocks at the pattern's own block size are cheap to list; a view block is a candidate
        # when it overlaps any of them.
        pbs = self.block_size
        b = torch.arange(math.ceil(self.seq_len / pbs))
        kept = self.allowed(b[:, None] * pbs, b[None, :] * pbs).to(torch.int64)
        return _overlap_any(kept, pbs, *self._row_spans(bs), *self._col_spans(bs))


@builtin
class BigBird(Pattern):
    name = "bigbird"
    fields = ("window", "global_tokens", "density", "block_size", "seed")
    description = "longformer(W, g) or block_random(p)"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        g = self.global_tokens
        local = ((i - j).abs() <= self.window // 2) | (i < g) | (j < g)
        bi, bj = i // self.block_size, j // self.block_size
        return local | (bi == bj) | hash_keep(seed_key(self.seed), bi, bj, keep_threshold(self.p))

    def _position_candidates(self, bs: int) -> Tensor:
        structure = {"q_len": self.q_len}
        banded = Longformer(self.seq_len, window=self.window, global_tokens=self.global_tokens, **structure)
        rand = BlockRandom(self.seq_len, density=self.p, block_size=self.block_size, seed=self.seed, **structure)
        return banded._position_candidates(bs) | rand._position_candidates(bs)


@builtin
class Random(Pattern):
    name = "random"
    fields = ("density", "seed")
    description = "each pair kept with probability p; the diagonal always kept"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        return (i == j) | hash_keep(seed_key(self.seed), i, j, keep_threshold(self.p))


@builtin
class Axial(Pattern):
    name = "axial"
    fields = ("window",)
    description = "seq_len = R*C with C = window: same row (i // C == j // C) or same column (i % C == j % C)"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        c = self.window
        return (i // c == j // c) | (i % c == j % c)

    def length_problems(self, length: int) -> list[tuple[str, str]]:
        if self.window >= 1 and length % self.window:
            return [("seq_len", f"got {length}; axial needs seq_len = R*C, a multiple of window C = {self.window}")]
        return []


@builtin
class PrefixLM(Pattern):
    name = "prefix_lm"
    fields = ("prefix",)
    description = "j < P or j <= i (bidirectional prefix of P tokens, causal after it)"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        return (j < self.prefix) | (j <= i)

    def band(self) -> tuple[float, float]:
        return (0, math.inf)

    def has_global_tokens(self) -> bool:
        return self.prefix > 0

    def _position_candidates(self, bs: int) -> Tensor:
        cand = self._band_candidates(bs)
        assert cand is not None
        cs, _ = self._col_spans(bs)
        return cand | (cs < self.prefix)[None, :]


@builtin
class Sink(Pattern):
    name = "sink"
    fields = ("window", "global_tokens")
    description = "(0 <= i - j < W) or (j < g and j <= i) (StreamingLLM: g sink tokens + causal window)"

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        d = i - j
        return ((d >= 0) & (d < self.window)) | ((j < self.global_tokens) & (d >= 0))

    def band(self) -> tuple[float, float]:
        return (0, self.window - 1)

    def _position_candidates(self, bs: int) -> Tensor:
        cand = self._band_candidates(bs)
        assert cand is not None
        _, row_ends = self._row_spans(bs)
        cs, _ = self._col_spans(bs)
        return cand | ((cs < self.global_tokens)[None, :] & (cs[None, :] <= row_ends[:, None]))


@builtin
class Neighborhood(Pattern):
    """NATTEN's neighbourhood attention on an image of R = seq_len / C rows of C = image_width tokens.

    Each query sees exactly k*k keys: the k x k window around it, shifted inwards at the image's borders.
    """

    name = "neighborhood"
    fields = ("window", "image_width")
    description = ("NATTEN k x k window (k = window, odd) on an image of seq_len / image_width rows: "
                   "abs(clamp(r_i, k//2, R-1-k//2) - r_j) <= k//2 and the same for columns")
    length_free = False  # the image height is seq_len / image_width

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        c = self.image_width
        h = self.window // 2
        rows = self.seq_len // c
        ri, ci, rj, cj = i // c, i % c, j // c, j % c
        ri = torch.clamp(ri, min=h, max=rows - 1 - h)
        ci = torch.clamp(ci, min=h, max=c - 1 - h)
        return ((ri - rj).abs() <= h) & ((ci - cj).abs() <= h)

    def band(self) -> tuple[float, float] | None:
        if self.image_width is None:
            return None
        # A key is at most k-1 rows and k-1 columns from its query (the window shifts at the borders).
        reach = (self.window - 1) * (self.image_width + 1)
        return (-reach, reach)

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        if self.image_width is None:
            out.append(("image_width", "not set; neighborhood needs image_width, the number of tokens in an image "
                                       "row (the image is seq_len / image_width rows)"))
        elif self.image_width < 1:
            out.append(("image_width", f"got {self.image_width}; must be >= 1"))
        if self.window % 2 == 0:
            out.append(("window", f"got {self.window}; the neighbourhood kernel size must be odd"))
        return out

    def length_problems(self, length: int) -> list[tuple[str, str]]:
        c = self.image_width
        if c is None or c < 1 or self.window % 2 == 0:
            return []
        if length % c:
            return [("seq_len", f"got {length}; neighborhood needs seq_len = R * image_width, a multiple of "
                                f"image_width {c}")]
        rows = length // c
        if self.window > min(rows, c):
            return [("window", f"got {self.window}; the kernel may not be larger than the image "
                               f"({rows} rows x {c} columns): allowed odd sizes up to {min(rows, c)}")]
        return []


def _overlap_any(kept: Tensor, pbs: int, rs: Tensor, re: Tensor, cs: Tensor, ce: Tensor) -> Tensor:
    """Which view blocks (row positions rs..re, column positions cs..ce) overlap a kept pattern block.

    kept: int64 (npb, npb) at the pattern's block size pbs.
    """
    # 2-D prefix sums answer "any kept block in this rectangle" for every view block at once.
    pre = torch.zeros(kept.shape[0] + 1, kept.shape[1] + 1, dtype=torch.int64)
    pre[1:, 1:] = kept.cumsum(0).cumsum(1)
    r_lo, r_hi = rs // pbs, re // pbs + 1
    c_lo, c_hi = cs // pbs, ce // pbs + 1
    total = pre[r_hi[:, None], c_hi[None, :]] - pre[r_lo[:, None], c_hi[None, :]] \
        - pre[r_hi[:, None], c_lo[None, :]] + pre[r_lo[:, None], c_lo[None, :]]
    return total > 0
