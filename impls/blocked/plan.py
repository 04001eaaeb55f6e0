"""Plans for `blocked`: which keys each query block multiplies against, and the masks, built once in prepare.

Two kinds, chosen from the pattern:
- `BandPlan`, for patterns allowed only where lo <= i - j <= hi (local, causal_local, dilated, longformer
  without global tokens): query block r needs the contiguous key span [r*bs - hi, r*bs + bs - 1 - lo], of
  `span = bs + hi - lo` keys, taken at compute time as overlapping windows of K (no copy).
- `GatherPlan`, for any pattern, from `pattern.block_sparse(bs)`: each query block's key blocks are
  gathered into one batch. Query blocks are bucketed by key-block count, so padding a bucket to its
  largest count wastes little.

Masks are additive biases (0 allowed, -inf forbidden), added only where a block is partially allowed and
only over the key columns that hold a forbidden pair, stored once where blocks share them. A query row
with no allowed key is left unmasked (softmax would give 0/0 = NaN, in backward too) and zeroed at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Bytes of float32 scores one step may hold: with the probabilities as large again, a step stays within a
# core's 2 MiB L2 and the shared L3 (2 MiB measured fastest on this 2-core machine, 8 MiB 8% slower).
STEP_BYTES = 2 * 2**20
# A bucket of query blocks takes a block with more key blocks while its padding stays under this fraction.
MAX_PADDING = 0.125
# Column ranges a bias piece may be split into before one range from the first to the last is used.
MAX_COLUMN_RUNS = 4


@dataclass(frozen=True)
class BiasPiece:
    """An additive mask over query blocks [r0, r1) and key columns [c0, c1) of a step's scores."""

    r0: int
    r1: int
    c0: int
    c1: int
    bias: Tensor  # float32 (1 or r1 - r0, bs, c1 - c0): 0 allowed, -inf forbidden; one row = all alike


@dataclass
class BandPlan:
    n: int
    block: int  # bs: query rows per block
    n_blocks: int  # ceil(N / bs)
    span: int  # keys per query block
    pad_front: int  # zero keys before key 0 (= hi)
    pieces: list[BiasPiece]  # rows are query block indices
    empty_rows: Tensor | None  # bool (N,): rows with no allowed key; None when there are none
    scale: float
    blocks_per_step: int  # query blocks (all heads counted) whose scores fit in STEP_BYTES

    path = "band"

    @property
    def computed_pairs(self) -> int:
        """(query, key) products per head, padding included."""
        return self.n_blocks * self.block * self.span


@dataclass
class GatherStep:
    rows: Tensor  # int64 (R,) query block indices
    kv: Tensor  # int64 (R, c) key block indices; padding slots point at block 0 and are masked
    pieces: list[BiasPiece]  # rows relative to this step's R rows
    heads_per_step: int  # heads computed together so that their scores fit in STEP_BYTES
    keys: int  # keys per query row: c * bs


@dataclass
class GatherPlan:
    n: int
    block: int
    n_blocks: int
    steps: list[GatherStep]
    empty_rows: Tensor | None
    scale: float
    computed_pairs: int

    path = "gather"


def column_runs(forbidden: Tensor) -> list[tuple[int, int]]:
    """Ranges [c0, c1) of the last dim of `forbidden` (..., keys) holding any True."""
    cols = forbidden.flatten(0, -2).any(dim=0).tolist()
    runs: list[tuple[int, int]] = []
    for c, masked in enumerate(cols):
        if masked and runs and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1)
        elif masked:
            runs.append((c, c + 1))
    return [(runs[0][0], runs[-1][1])] if len(runs) > MAX_COLUMN_RUNS else runs


def bias_pieces(allowed: Tensor, r0: int, device: torch.device) -> list[BiasPiece]:
    """Pieces masking `allowed` (R, bs or 1, keys), for rows r0 .. r0 + R; only the masked columns."""
    forbidden = ~allowed
    if not bool(forbidden.any()):
        return []
    if forbidden.shape[0] > 1 and bool((forbidden == forbidden[:1]).all()):
        forbidden = forbidden[:1]  # every row alike: stored once, broadcast
    zero = torch.zeros((), dtype=torch.float32)
    return [BiasPiece(r0, r0 + allowed.shape[0], c0, c1,
                      torch.where(forbidden[:, :, c0:c1], -math.inf, zero).contiguous().to(device))
            for c0, c1 in column_runs(forbidden)]


def _uniform_runs(allowed: Tensor) -> list[tuple[int, int]]:
    """Runs [r0, r1) of consecutive query blocks with identical masks; lone blocks next to each other merge.

    A band's interior blocks share one mask (stored once); its edge blocks differ and go together.
    """
    same = (allowed[1:] == allowed[:-1]).flatten(1).all(dim=1).tolist()
    runs = [[0, 1]]
    for r, equal in enumerate(same, start=1):
        if equal:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    groups: list[list[int]] = []  # [r0, r1, made of lone blocks]
    for r0, r1 in runs:
        lone = int(r1 - r0 == 1)
        if lone and groups and groups[-1][2]:
            groups[-1][1] = r1
        else:
            groups.append([r0, r1, lone])
    return [(r0, r1) for r0, r1, _ in groups]


def band_plan(pattern, bs: int, lo: int, hi: int, scale: float, device: torch.device) -> BandPlan:
    """Sliding-window plan for a pattern allowed only where lo <= i - j <= hi."""
    n = pattern.seq_len
    nb = math.ceil(n / bs)
    span = bs + hi - lo
    rows = torch.arange(nb * bs).view(nb, bs, 1)
    cols = torch.arange(nb).view(nb, 1, 1) * bs - hi + torch.arange(span).view(1, 1, span)
    allowed = pattern.allowed(rows, cols) & (cols >= 0) & (cols < n) & (rows < n)  # (nb, bs, span)
    empty = ~allowed.any(dim=2)  # (nb, bs), the padding rows past N included
    allowed |= empty[:, :, None]
    pieces = [p for r0, r1 in _uniform_runs(allowed) for p in bias_pieces(allowed[r0:r1], r0, device)]
    empty_rows = empty.flatten()[:n]
    return BandPlan(n, bs, nb, span, hi, pieces, empty_rows.to(device) if bool(empty_rows.any()) else None,
                    scale, max(1, STEP_BYTES // (4 * bs * span)))


def _buckets(counts: list[int]) -> list[list[int]]:
    """Query blocks grouped by key-block count so that padding each group to its largest stays small."""
    order = sorted(range(len(counts)), key=lambda r: counts[r])
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for r in order:
        c = counts[r]
        if current and (len(current) + 1) * c - (total + c) > MAX_PADDING * (len(current) + 1) * c:
            groups.append(current)
            current, total = [], 0
        current.append(r)
        total += c
    if current:
        groups.append(current)
    return groups


def gather_plan(pattern, bs: int, heads: int, scale: float, device: torch.device) -> GatherPlan:
    """Block-gather plan from the pattern's block-sparse view (any pattern); `heads` = B*H."""
    n = pattern.seq_len
    sparse = pattern.block_sparse(bs)
    nb = sparse.num_blocks
    counts = sparse.kv_counts.tolist()
    col_valid = (torch.arange(nb * bs) < n).view(nb, bs)  # key columns past N are zero padding
    row_allowed = torch.zeros(nb, bs, dtype=torch.bool)
    steps: list[GatherStep] = []
    computed = 0
    for group in _buckets(counts):
        c = counts[group[-1]]  # the largest count in the bucket
        row_bytes = 4 * bs * max(1, c * bs)  # one query block's scores, one head
        rows_per_step = max(1, STEP_BYTES // (row_bytes * heads))
        for s in range(0, len(group), rows_per_step):
            rows = torch.tensor(group[s : s + rows_per_step], dtype=torch.int64)
            r = len(rows)
            computed += r * bs * c * bs
            heads_per_step = max(1, min(heads, STEP_BYTES // (row_bytes * r)))
            if c == 0:
                steps.append(GatherStep(rows.to(device), torch.zeros(r, 0, dtype=torch.int64, device=device), [],
                                        heads_per_step, 0))
                continue
            kv = sparse.kv_indices[rows, :c].to(torch.int64)  # (R, c), -1 padded
            slot_used = kv >= 0
            kv = kv.clamp(min=0)
            full = sparse.full[rows, :c] & slot_used
            # Forbidden alike for every row of a block: padding slots and key columns past N.
            allowed = (slot_used[:, :, None] & col_valid[kv]).reshape(r, 1, c * bs)
            partial = slot_used & ~full
            if bool(partial.any()):
                allowed = allowed.expand(r, bs, c * bs).clone().view(r, bs, c, bs)
                r_idx, t_idx = torch.nonzero(partial, as_tuple=True)
                inner = sparse.masks[sparse.mask_index[rows[r_idx], t_idx].to(torch.int64)]  # (P, bs, bs)
                allowed[r_idx, :, t_idx, :] &= inner
                allowed = allowed.view(r, bs, c * bs)
                empty = ~allowed.any(dim=2, keepdim=True)
                allowed |= empty
                row_allowed[rows] = ~empty[:, :, 0]
            else:
                row_allowed[rows] = True
            steps.append(GatherStep(rows.to(device), kv.to(device), bias_pieces(allowed, 0, device),
                                    heads_per_step, c * bs))
    empty_rows = ~row_allowed.flatten()[:n]
    return GatherPlan(n, bs, nb, steps, empty_rows.to(device) if bool(empty_rows.any()) else None, scale,
                      computed)


def make_plan(pattern, bs: int, heads: int, scale: float, device: torch.device) -> BandPlan | GatherPlan:
    """The band plan where the pattern is a band narrower than the sequence, else the gather plan."""
    band = pattern.band()
    global_tokens = pattern.global_tokens if "global_tokens" in pattern.fields else 0
    if band is not None and global_tokens == 0 and all(math.isfinite(x) for x in band):
        lo, hi = int(band[0]), int(band[1])
        if hi - lo < pattern.seq_len:
            return band_plan(pattern, bs, lo, hi, scale, device)
    return gather_plan(pattern, bs, heads, scale, device)
