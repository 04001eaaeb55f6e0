"""`blocked`: dense matrix products over the pattern's block layout, pure PyTorch, the fast CPU path.

Queries are cut into blocks of `block_size` rows. Each query block gets the keys it needs in one batch and
its attention is three dense steps: scores = Q_blk K_blk^T (one batched matmul over all query blocks of a
head), -inf where the pattern forbids a pair (only where a block is partially allowed), a softmax over the
gathered keys, then P V_blk. Every key a query row may see is in its batch, so the softmax is exact in one
go (torch's fused softmax: a max pass, then exp and normalise): no online rescaling is needed.

Two ways to batch the keys, chosen from the pattern in prepare:
- band: for patterns allowed only within i - j in [lo, hi] (local, causal_local, dilated, longformer
  without global tokens), query block r needs the contiguous key span [r*bs - hi, r*bs + bs - 1 - lo].
  The spans are overlapping windows of K padded with zeros (Longformer's sliding chunks), taken as an
  `unfold` view: no copy of K or V, and only bs + hi - lo keys per query row instead of whole blocks.
- gather: any other pattern uses `block_sparse(bs)`: each query block's key blocks are gathered (one
  index per block) into a batch. Query blocks are grouped into buckets of similar key-block counts, so a
  batch is padded only a little; padding slots and partially allowed blocks are masked, full blocks not.

The working set is one head at a time, cut further so that one step's scores stay under STEP_BYTES: memory
grows with the number of allowed blocks, never N^2. Everything is differentiable (autograd through matmul,
masked_fill and softmax; unfold and gathers scatter their gradients back), which gives mode fwd_bwd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.registry import Impl, register
from impls.common import accum_dtype, fold_heads, softmax_scale, unfold_heads

# Bytes of float32 scores one step may hold: a few MiB keeps a step's scores in the last-level cache.
STEP_BYTES = 8 * 2**20
# A bucket of query blocks accepts a block with more keys while its padding stays under this fraction.
MAX_PADDING = 0.125


@dataclass
class Step:
    """Query blocks computed together: `rows` of the padded query blocks, with their keys and masks."""

    rows: slice | Tensor  # query block indices: a slice (band) or int64 (R,) (gather)
    kv: Tensor | None  # gather: int64 (R, c) key block indices (padding points at block 0); band: None
    bias: list[tuple[int, int, Tensor]]  # (c0, c1, float (R or 1, bs or 1, c1 - c0)): 0 or -inf, added
    keys: int  # keys per query row in this step


def bias_pieces(allowed: Tensor, max_runs: int = 4) -> list[tuple[int, int, Tensor]]:
    """Additive masks (0 allowed, -inf forbidden) for `allowed` (R, bs or 1, keys), on masked columns only.

    Adding a float bias is several times faster than masked_fill with a bool mask, and a band's masked
    pairs sit in a few column ranges (the triangles at both ends of the span): only those are touched.
    Rows that are all alike are stored once and broadcast.
    """
    forbidden = ~allowed
    if not bool(forbidden.any()):
        return []
    if forbidden.shape[0] > 1 and bool((forbidden == forbidden[:1]).all()):
        forbidden = forbidden[:1]
    cols = forbidden.any(dim=1).any(dim=0).tolist()  # (keys,) any forbidden pair in the column
    runs: list[tuple[int, int]] = []
    for c, masked in enumerate(cols):
        if masked and runs and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1)
        elif masked:
            runs.append((c, c + 1))
    if len(runs) > max_runs:
        runs = [(runs[0][0], runs[-1][1])]
    zeros = torch.zeros((), dtype=torch.float32)
    return [(c0, c1, torch.where(forbidden[:, :, c0:c1], -math.inf, zeros).contiguous()) for c0, c1 in runs]


@dataclass
class Plan:
    """How `blocked` computes one pattern at one block size (built once, in prepare)."""

    path: str  # "band" | "gather"
    block: int  # bs: query rows per block
    n: int
    n_blocks: int  # ceil(N / bs)
    steps: list[Step]
    empty_rows: Tensor | None  # bool (N,): rows with no allowed key, zeroed at the end; None if none
    computed_pairs: int  # (query, key) products the steps compute per head, padding included
    pad_front: int = 0  # band: zero keys before key 0
    pad_back: int = 0  # band: zero keys after key N-1
    inverse_order: Tensor | None = None  # gather: output block b is the inverse_order[b]-th one computed

    def __post_init__(self) -> None:
        if self.path == "gather" and self.steps:
            order = torch.cat([s.rows for s in self.steps])  # type: ignore[misc]
            self.inverse_order = torch.argsort(order).to(order.device)


def _rows_per_step(bs: int, keys: int) -> int:
    return max(1, STEP_BYTES // (4 * bs * max(1, keys)))


def _segments(allowed: Tensor) -> list[tuple[int, int]]:
    """Runs [r0, r1) of consecutive query blocks with identical masks; lone blocks next to each other merge.

    Interior blocks of a band share one mask (stored once, broadcast); edge blocks differ and go together.
    """
    same = (allowed[1:] == allowed[:-1]).flatten(1).all(dim=1).tolist()
    runs = [[0, 1]]
    for r, equal in enumerate(same, start=1):
        if equal:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    groups: list[list[int]] = []  # [r0, r1, lone]
    for r0, r1 in runs:
        lone = int(r1 - r0 == 1)
        if lone and groups and groups[-1][2]:
            groups[-1][1] = r1
        else:
            groups.append([r0, r1, lone])
    return [(r0, r1) for r0, r1, _ in groups]


def band_plan(pattern, bs: int, lo: int, hi: int, device: torch.device) -> Plan:
    """Sliding-window plan for a pattern allowed only where lo <= i - j <= hi."""
    n = pattern.seq_len
    nb = math.ceil(n / bs)
    span = bs + hi - lo  # keys per query block: [r*bs - hi, r*bs + bs - 1 - lo]
    pad_front = hi
    pad_back = max(0, (nb - 1) * bs + span - pad_front - n)
    rows = torch.arange(nb * bs).view(nb, bs, 1)
    cols = torch.arange(nb).view(nb, 1, 1) * bs - hi + torch.arange(span).view(1, 1, span)
    allowed = pattern.allowed(rows, cols) & (cols >= 0) & (cols < n) & (rows < n)  # (nb, bs, span)
    empty = ~allowed.any(dim=2)  # (nb, bs): includes the padding rows past N
    # An empty row would give 0/0 in softmax (NaN, also in backward): leave it unmasked, zero it at the end.
    allowed |= empty[:, :, None]
    empty_rows = empty.flatten()[:n]
    per_step = _rows_per_step(bs, span)
    steps = []
    for r0, r1 in _segments(allowed):
        for s0 in range(r0, r1, per_step):
            s1 = min(r1, s0 + per_step)
            bias = [(c0, c1, b.to(device)) for c0, c1, b in bias_pieces(allowed[s0:s1])]
            steps.append(Step(slice(s0, s1), None, bias, span))
    return Plan("band", bs, n, nb, steps, empty_rows.to(device) if bool(empty_rows.any()) else None,
                nb * bs * span, pad_front, pad_back)


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


def gather_plan(pattern, bs: int, device: torch.device) -> Plan:
    """Block-gather plan from the pattern's block-sparse view (any pattern)."""
    n = pattern.seq_len
    sparse = pattern.block_sparse(bs)
    nb = sparse.num_blocks
    counts = sparse.kv_counts.tolist()
    col_valid = (torch.arange(nb * bs) < n).view(nb, bs)  # key columns past N are zero padding
    steps: list[Step] = []
    computed = 0
    row_allowed = torch.zeros(nb, bs, dtype=torch.bool)
    for group in _buckets(counts):
        c = counts[group[-1]]  # the largest count of the group
        per_step = _rows_per_step(bs, c * bs)
        for s in range(0, len(group), per_step):
            rows = torch.tensor(group[s : s + per_step], dtype=torch.int64)
            r = len(rows)
            computed += r * bs * c * bs
            if c == 0:
                steps.append(Step(rows.to(device), torch.zeros(r, 0, dtype=torch.int64, device=device), [], 0))
                continue
            kv = sparse.kv_indices[rows, :c].to(torch.int64)  # (R, c), -1 padded
            slot_used = kv >= 0
            kv = kv.clamp(min=0)
            full = sparse.full[rows, :c] & slot_used
            # What is forbidden for every row of a block alike: padding slots and key columns past N.
            allowed = (slot_used[:, :, None] & col_valid[kv]).reshape(r, 1, c * bs)
            partial = slot_used & ~full
            if bool(partial.any()):
                allowed = allowed.expand(r, bs, c * bs).clone().view(r, bs, c, bs)
                r_idx, t_idx = torch.nonzero(partial, as_tuple=True)
                inner = sparse.masks[sparse.mask_index[rows[r_idx], t_idx].to(torch.int64)]  # (P, bs, bs)
                allowed[r_idx, :, t_idx, :] &= inner
                allowed = allowed.view(r, bs, c * bs)
                empty = ~allowed.any(dim=2, keepdim=True)
                allowed |= empty  # an empty row stays unmasked (no 0/0) and is zeroed at the end
                row_allowed[rows] = ~empty[:, :, 0]
            else:
                row_allowed[rows] = True
            bias = [(c0, c1, b.to(device)) for c0, c1, b in bias_pieces(allowed)]
            steps.append(Step(rows.to(device), kv.to(device), bias, c * bs))
    empty_rows = ~row_allowed.flatten()[:n]
    return Plan("gather", bs, n, nb, steps, empty_rows.to(device) if bool(empty_rows.any()) else None,
                computed)


def make_plan(pattern, bs: int, device: torch.device) -> Plan:
    band = pattern.band()
    globals_ = pattern.global_tokens if "global_tokens" in pattern.fields else 0
    if band is not None and globals_ == 0 and all(math.isfinite(x) for x in band):
        lo, hi = int(band[0]), int(band[1])
        if hi - lo < pattern.seq_len:  # a span narrower than the sequence: sliding windows pay off
            return band_plan(pattern, bs, lo, hi, device)
    return gather_plan(pattern, bs, device)


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: list[tuple[int, int, Tensor]],
            out: Tensor | None = None) -> Tensor:
    """q (R, bs, D), k and v (R, keys, D), bias pieces (see `bias_pieces`) -> (R, bs, D), into `out`."""
    scores = torch.matmul(q, k.transpose(1, 2))  # (R, bs, keys); q is pre-scaled
    for c0, c1, piece in bias:
        scores[:, :, c0:c1].add_(piece)
    probs = torch.softmax(scores, dim=-1)
    del scores
    return torch.matmul(probs, v) if out is None else torch.matmul(probs, v, out=out)


def _head_band(plan: Plan, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None) -> Tensor:
    """One head by sliding windows -> (nb, bs, D), written into `out` when given.

    q (nb*bs, D) padded at the end; k, v (pad_front + N + pad_back, D) padded at both ends.
    """
    bs, nb, d = plan.block, plan.n_blocks, q.shape[1]
    span = plan.steps[0].keys
    qb = q.view(nb, bs, d)
    # (nb, span, D) overlapping views: window r starts at key r*bs - pad_front
    kw = k.unfold(0, span, bs).transpose(1, 2)
    vw = v.unfold(0, span, bs).transpose(1, 2)
    if out is not None:
        for s in plan.steps:
            _attend(qb[s.rows], kw[s.rows], vw[s.rows], s.bias, out[s.rows])
        return out
    return torch.cat([_attend(qb[s.rows], kw[s.rows], vw[s.rows], s.bias) for s in plan.steps])


def _head_gather(plan: Plan, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None) -> Tensor:
    """One head by gathered key blocks -> (nb, bs, D), written into `out` when given.

    q, k, v (nb*bs, D), zero padded at the end.
    """
    bs, nb, d = plan.block, plan.n_blocks, q.shape[1]
    qb, kb, vb = (t.view(nb, bs, d) for t in (q, k, v))
    outs = []
    for s in plan.steps:
        r = len(s.rows)  # type: ignore[arg-type]
        if s.keys == 0:  # no allowed key: zeros, still attached to q so that autograd sees the output
            block_out = qb[s.rows].mul(0.0)
        else:
            keys = kb[s.kv].view(r, s.keys, d)  # (R, c*bs, D) gathered copies
            values = vb[s.kv].view(r, s.keys, d)
            block_out = _attend(qb[s.rows], keys, values, s.bias)
        if out is None:
            outs.append(block_out)
        else:
            out.index_copy_(0, s.rows, block_out)  # type: ignore[arg-type]
    if out is not None:
        return out
    return torch.cat(outs)[plan.inverse_order]


def blocked_attention(plan: Plan, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q, k, v (BH, N, D) float -> (BH, N, D)."""
    head = _head_band if plan.path == "band" else _head_gather
    bh, n, d = q.shape
    # Zero padding once for all heads: queries to whole blocks, keys and values as the plan needs.
    q = F.pad(q * scale, (0, 0, 0, plan.n_blocks * plan.block - n))
    if plan.path == "band":
        k, v = (F.pad(t, (0, 0, plan.pad_front, plan.pad_back)) for t in (k, v))
    else:
        k, v = (F.pad(t, (0, 0, 0, plan.n_blocks * plan.block - n)) for t in (k, v))
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if differentiable:
        out = torch.stack([head(plan, qh, kh, vh, None).view(-1, d)[:n]
                           for qh, kh, vh in zip(q.unbind(0), k.unbind(0), v.unbind(0), strict=True)])
    else:
        buffer = q.new_empty(bh, plan.n_blocks, plan.block, d)
        for h in range(bh):
            head(plan, q[h], k[h], v[h], buffer[h])
        out = buffer.view(bh, -1, d)[:, :n]
    if plan.empty_rows is not None:
        out = out.masked_fill(plan.empty_rows[:, None], 0.0)
    return out


@register
class Blocked(Impl):
    name = "blocked"
    description = "dense matmuls over the block layout: sliding windows for bands, gathered blocks otherwise"
    fwd_bwd = True

    def prepare(self, case, pattern, q, k, v):
        plan = make_plan(pattern, case.block_size, q.device)
        scale = softmax_scale(case.head_dim)
        acc = accum_dtype(q.dtype)
        self._extras = {"path": plan.path, "block_size": plan.block, "steps_per_head": len(plan.steps),
                        "computed_pairs_per_head": plan.computed_pairs,
                        "computed_over_allowed": plan.computed_pairs / max(1, pattern.nnz)}

        def call():
            folded = [fold_heads(t).to(acc) for t in (q, k, v)]  # (BH, N, D)
            return unfold_heads(blocked_attention(plan, *folded, scale), q.shape).to(q.dtype)

        return call

    def record_extras(self) -> dict[str, object]:
        return dict(self._extras)
