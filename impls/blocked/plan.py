"""Plans for `blocked`: which keys each query block multiplies against, and the masks, built once in prepare.

A plan covers the pattern's q_len x seq_len matrix (row r is position r + q_offset): query rows are cut into
blocks of `rows` = min(block_size, q_len) rows. The G query heads of one KV head are computed together, as
G * rows query rows against that KV head's keys (`compute`), so plans are per KV head and masks are alike for
the G heads. Two kinds, chosen from the pattern (`make_plan`):
- `BandPlan`, for patterns allowed only where lo <= i - j <= hi (local, causal_local, dilated, longformer
  without global tokens, ...): query block r (positions q_offset + r*rows ..) needs the contiguous key span
  starting at position q_offset + r*rows - hi, of `span = rows + hi - lo` keys, taken at compute time as
  overlapping windows of K (views, no copy).
- `GatherPlan`, for any pattern, from `pattern.block_sparse(bs)`: each query block's key blocks are
  gathered into one batch. Query blocks are bucketed by key-block count, so padding a bucket to its
  largest count wastes little.
A band that is wide but sparse inside (neighbourhood attention, packed documents cutting a window) would
make the band plan compute many forbidden pairs: it is used only while it computes at most
`BAND_OVERCOMPUTE` times the pairs of the gather plan.

Masks are additive biases (0 allowed, -inf forbidden), added only where a block is partially allowed and
only over the key columns that hold a forbidden pair, stored once where blocks share them. A query row
with no allowed key is left unmasked (softmax would give 0/0 = NaN, in backward too) and zeroed at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

# Bytes of float32 scores one step may hold: with the probabilities as large again, a step stays within a
# core's 2 MiB L2 and the shared L3 (2 MiB measured fastest; docs/performance.md, "Measured choices", P3).
STEP_BYTES = 2 * 2**20
# A bucket of query blocks takes a block with more key blocks while its padding stays under this fraction.
MAX_PADDING = 0.125
# Column ranges a bias piece may be split into before one range from the first to the last is used.
MAX_COLUMN_RUNS = 4
# The band plan is kept while it computes at most this many times the (query, key) pairs of the gather
# plan (the pattern's nonempty bs x bs blocks). Above 1 because a computed pair costs the band plan less:
# its windows are views of K and V, while the gather plan copies the key and value blocks of each query
# block (unless a step's query blocks share one run of key blocks) and scatters outputs and gradients
# back. Measured on this 2-core CPU (N=4096, H=8, D=64, bs=64, both plans forced, min of 7 runs), the
# gather plan's time per computed pair was 1.2-1.5x the band plan's (local, causal_local, dilated,
# neighborhood, causal_local and local over packed documents, forward and forward+backward), and the two
# plans broke even at a ratio of 1.25-1.35 (causal_local W=256 over 16 documents, ratio 1.33: gather
# 0.9-1.0x the band's time; W=512 over 4 documents, 1.26: 1.2x). Dense bands stay near 1; neighbourhoods
# (band about 2k-1 image rows for k rows of keys: 1.9) and windows cut by documents (W=1024 over 8
# documents: 2.2, gather 0.7x the band's time) go to the gather plan.
BAND_OVERCOMPUTE = 1.3
# Low-precision band windows are widened to a multiple of this many keys: oneDNN's bfloat16 products (AMX)
# run on whole tiles, and an odd span ran one step's Q K^T at 190 GF/s against 300 at the next multiple of 32
# (G*rows=256, D=128, 1087 against 1088 keys, one core; the extra keys are masked).
SPAN_MULTIPLE = 32
LOW_PRECISION = (torch.bfloat16, torch.float16)
# Pattern predicates make int64 temporaries of the broadcast shape: band masks are evaluated this many
# (row, key) pairs at a time.
MASK_CHUNK = 2**22


@dataclass(frozen=True)
class BiasPiece:
    """An additive mask over query blocks [r0, r1) and key columns [c0, c1) of a step's scores."""

    r0: int
    r1: int
    c0: int
    c1: int
    bias: Tensor  # the scores' dtype (1 or r1 - r0, rows, c1 - c0): 0 allowed, -inf forbidden; one row = all alike


@dataclass
class BandPlan:
    q_len: int  # query rows of the matrix
    n: int  # keys (seq_len)
    rows: int  # query rows per block: min(block_size, q_len)
    n_blocks: int  # ceil(q_len / rows)
    span: int  # keys per query block
    base: int  # key position of window 0's first key: q_offset - hi (negative: zero keys in front)
    pieces: list[BiasPiece]  # rows are query block indices
    empty_rows: Tensor | None  # bool (q_len,): rows with no allowed key; None when there are none
    scale: float
    blocks_per_step: int  # query blocks (of one KV head, its G query heads) whose scores fit in STEP_BYTES
    fused_masks: dict = field(default_factory=dict, repr=False, compare=False)  # `fused`'s, built on first use

    path = "band"

    @property
    def buffer_len(self) -> int:
        """Key positions base .. base + buffer_len - 1 hold every window."""
        return (self.n_blocks - 1) * self.rows + self.span

    @property
    def computed_pairs(self) -> int:
        """(query, key) products per query head, padding included."""
        return self.n_blocks * self.rows * self.span


@dataclass
class GatherStep:
    rows: Tensor  # int64 (R,) query block indices
    kv: Tensor  # int64 (R, c) key block indices; padding slots are masked
    pieces: list[BiasPiece]  # rows relative to this step's R rows
    heads_per_step: int  # KV heads computed together so that their scores fit in STEP_BYTES
    keys: int  # keys per query row: c * bs
    # Key block kv[r, 0] when every row's key blocks are the same run of c blocks from it (causal, prefix,
    # decode, dense): the step's query blocks then share one view of K and V, in one product, and nothing
    # is gathered. None otherwise.
    run_start: int | None = None


@dataclass
class GatherPlan:
    q_len: int
    n: int
    block: int  # bs: keys per key block
    rows: int  # query rows per query block: min(bs, q_len)
    n_blocks: int  # query blocks: ceil(q_len / rows)
    n_key_blocks: int  # ceil(n / bs)
    steps: list[GatherStep]
    empty_rows: Tensor | None
    scale: float
    computed_pairs: int  # per query head

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


def bias_pieces(allowed: Tensor, r0: int, device: torch.device, dtype: torch.dtype = torch.float32
                ) -> list[BiasPiece]:
    """Pieces masking `allowed` (R, rows or 1, keys), for blocks r0 .. r0 + R; only the masked columns, in the
    scores' dtype (0 and -inf are exact in every float dtype)."""
    forbidden = ~allowed
    if not bool(forbidden.any()):
        return []
    if forbidden.shape[0] > 1 and bool((forbidden == forbidden[:1]).all()):
        forbidden = forbidden[:1]  # every block alike: stored once, broadcast
    zero = torch.zeros((), dtype=torch.float32)
    return [BiasPiece(r0, r0 + allowed.shape[0], c0, c1,
                      torch.where(forbidden[:, :, c0:c1], -math.inf, zero).to(device=device, dtype=dtype).contiguous())
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


def _band_allowed(pattern, rb: int, nb: int, span: int, base: int) -> Tensor:
    """Bool (nb, rb, span): may row r*rb + t attend to key position base + r*rb + s (in range, allowed)."""
    q_len, n = pattern.q_len, pattern.seq_len
    per = max(1, MASK_CHUNK // (rb * span))
    parts = []
    for r0 in range(0, nb, per):
        r1 = min(nb, r0 + per)
        rows = (torch.arange(r0, r1) * rb).view(-1, 1, 1) + torch.arange(rb).view(1, rb, 1)
        cols = (torch.arange(r0, r1) * rb + base).view(-1, 1, 1) + torch.arange(span).view(1, 1, span)
        valid = (rows < q_len) & (cols >= 0) & (cols < n)
        parts.append(pattern.mask(rows.clamp(max=q_len - 1), cols.clamp(0, n - 1)) & valid)
    return torch.cat(parts)


def band_plan(pattern, bs: int, lo: int, hi: int, group: int, scale: float, device: torch.device,
              dtype: torch.dtype = torch.float32) -> BandPlan:
    """Sliding-window plan for a pattern allowed only where lo <= i - j <= hi; `group` query heads per KV head."""
    q_len, n = pattern.q_len, pattern.seq_len
    rb = min(bs, q_len)
    nb = math.ceil(q_len / rb)
    span = rb + hi - lo
    if dtype in LOW_PRECISION:  # keys past the band's last are forbidden by the pattern: masked like the rest
        span = -(-span // SPAN_MULTIPLE) * SPAN_MULTIPLE
    base = pattern.q_offset - hi
    allowed = _band_allowed(pattern, rb, nb, span, base)  # (nb, rb, span)
    empty = ~allowed.any(dim=2)  # (nb, rb), the padding rows past q_len included
    allowed |= empty[:, :, None]
    pieces = [p for r0, r1 in _uniform_runs(allowed) for p in bias_pieces(allowed[r0:r1], r0, device, dtype)]
    empty_rows = empty.flatten()[:q_len]
    return BandPlan(q_len, n, rb, nb, span, base, pieces,
                    empty_rows.to(device) if bool(empty_rows.any()) else None, scale,
                    max(1, STEP_BYTES // (4 * group * rb * span)))


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


def gather_plan(pattern, bs: int, kv_heads: int, group: int, scale: float, device: torch.device,
                dtype: torch.dtype = torch.float32) -> GatherPlan:
    """Block-gather plan from the pattern's block-sparse view (any pattern); `kv_heads` = B*Hkv, `group` = G."""
    q_len, n = pattern.q_len, pattern.seq_len
    sparse = pattern.block_sparse(bs)
    rb = min(bs, q_len)  # one query block when q_len < bs: only its q_len rows are computed
    nqb, nkb = sparse.num_blocks, math.ceil(n / bs)
    counts = sparse.kv_counts.tolist()
    col_valid = (torch.arange(nkb * bs) < n).view(nkb, bs)  # key columns past N are zero padding
    row_allowed = torch.zeros(nqb, rb, dtype=torch.bool)
    steps: list[GatherStep] = []
    computed = 0
    for bucket in _buckets(counts):
        c = counts[bucket[-1]]  # the largest count in the bucket
        row_bytes = 4 * group * rb * max(1, c * bs)  # one query block's scores, the G heads of one KV head
        rows_per_step = max(1, STEP_BYTES // (row_bytes * kv_heads))
        for s in range(0, len(bucket), rows_per_step):
            rows = torch.tensor(bucket[s : s + rows_per_step], dtype=torch.int64)
            r = len(rows)
            computed += r * rb * c * bs
            heads_per_step = max(1, min(kv_heads, STEP_BYTES // (row_bytes * r)))
            if c == 0:
                steps.append(GatherStep(rows.to(device), torch.zeros(r, 0, dtype=torch.int64, device=device), [],
                                        heads_per_step, 0))
                continue
            kv = sparse.kv_indices[rows, :c].to(torch.int64)  # (R, c), -1 padded
            slot_used = kv >= 0
            run = kv[:, :1] + torch.arange(c)  # each row's blocks as a run from its first, padding included
            shared = bool(((kv == run) | ~slot_used).all()) and bool((kv[:, 0] == kv[0, 0]).all()) \
                and int(kv[0, 0]) + c <= nkb
            kv = run if shared else kv.clamp(min=0)  # padding slots: the run's next blocks, or block 0
            full = sparse.full[rows, :c] & slot_used
            # Forbidden alike for every row of a block: padding slots and key columns past N.
            allowed = (slot_used[:, :, None] & col_valid[kv]).reshape(r, 1, c * bs)
            partial = slot_used & ~full
            if bool(partial.any()):
                allowed = allowed.expand(r, rb, c * bs).clone().view(r, rb, c, bs)
                r_idx, t_idx = torch.nonzero(partial, as_tuple=True)
                inner = sparse.masks[sparse.mask_index[rows[r_idx], t_idx].to(torch.int64)][:, :rb]  # (P, rb, bs)
                allowed[r_idx, :, t_idx, :] &= inner
                allowed = allowed.view(r, rb, c * bs)
                empty = ~allowed.any(dim=2, keepdim=True)  # rows past q_len are empty in the masks
                allowed |= empty
                row_allowed[rows] = ~empty[:, :, 0]
            else:
                row_allowed[rows] = True
            steps.append(GatherStep(rows.to(device), kv.to(device), bias_pieces(allowed, 0, device, dtype),
                                    heads_per_step, c * bs, int(kv[0, 0]) if shared else None))
    empty_rows = ~row_allowed.flatten()[:q_len]
    return GatherPlan(q_len, n, bs, rb, nqb, nkb, steps, empty_rows.to(device) if bool(empty_rows.any()) else None,
                      scale, computed)


def _band_of(pattern) -> tuple[int, int] | None:
    """(lo, hi) when every allowed pair has lo <= i - j <= hi, both finite; else None."""
    band = pattern.band()
    if band is None or pattern.has_global_tokens() or not all(math.isfinite(x) for x in band):
        return None
    return int(band[0]), int(band[1])


def make_plan(pattern, bs: int, kv_heads: int, group: int, scale: float, device: torch.device,
              dtype: torch.dtype = torch.float32) -> BandPlan | GatherPlan:
    """The band plan where the pattern is a band that is not much sparser inside than its blocks, else the
    gather plan. `kv_heads` = B * Hkv, `group` = G query heads per KV head, `dtype` the scores' (the inputs')."""
    band = _band_of(pattern)
    if band is not None:
        lo, hi = band
        rb = min(bs, pattern.q_len)
        band_pairs = math.ceil(pattern.q_len / rb) * rb * (rb + hi - lo)
        gather_pairs = int(pattern.block_layout(bs).sum()) * rb * bs
        if band_pairs <= BAND_OVERCOMPUTE * gather_pairs:
            return band_plan(pattern, bs, lo, hi, group, scale, device, dtype)
    return gather_plan(pattern, bs, kv_heads, group, scale, device, dtype)
