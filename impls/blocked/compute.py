"""The compute of `blocked`: batched dense products over a plan's key windows or gathered key blocks.

Every step is three dense operations over a batch of query blocks (of several heads at once where their
scores fit in STEP_BYTES): scores = scale * Q_blk K_blk^T in one GEMM (baddbmm, the scale inside it), the
plan's bias pieces added where blocks are partially allowed, softmax, then P V_blk in one GEMM. Each
query row's batch holds every key it may see, so the softmax is exact in one go (torch's fused kernel:
a max pass, then exp, sum and normalise); no online rescaling is needed.

Without autograd each step writes into one preallocated output; with it, steps' outputs are
concatenated, and gradients flow back through the window views and the gathers.

Steps are independent, so on CPU they run side by side on threads (`impls.common.run_steps`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from impls.blocked.plan import BandPlan, BiasPiece, GatherPlan, GatherStep
from impls.common import run_steps


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """(BH, N, D) zero padded to (BH, rows, D)."""
    return x if x.shape[1] == rows else F.pad(x, (0, 0, 0, rows - x.shape[1]))


def _scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """q (G, bs, D), k (G, keys, D) -> scale * q k^T (G, bs, keys); beta=0 never reads the empty input."""
    return torch.baddbmm(q.new_empty(q.shape[0], q.shape[1], k.shape[1]), q, k.transpose(1, 2),
                         beta=0.0, alpha=scale)


def _add_pieces(scores: Tensor, pieces: list[BiasPiece], s0: int, s1: int) -> None:
    """scores (heads, blocks s0..s1, bs, keys) += the pieces that cover any of those blocks."""
    for p in pieces:
        r0, r1 = max(p.r0, s0), min(p.r1, s1)
        if r0 < r1:
            bias = p.bias if p.bias.shape[0] == 1 else p.bias[r0 - p.r0 : r1 - p.r0]
            scores[:, r0 - s0 : r1 - s0, :, p.c0 : p.c1].add_(bias)


def _softmax_times(scores: Tensor, v: Tensor, out: Tensor | None) -> Tensor:
    """softmax(scores) @ v; without autograd (`out` given) the softmax overwrites the scores.

    In place halves a step's working set; torch's CPU softmax reads each row whole (max, then exp and
    sum) before it writes it, so the aliasing is safe there (tests compare both paths with the oracle).
    """
    if out is None:
        return torch.bmm(torch.softmax(scores, dim=-1), v)
    in_place = scores if scores.device.type == "cpu" else None
    return torch.bmm(torch.softmax(scores, dim=-1, out=in_place), v, out=out)


def _windows(x: Tensor, plan: BandPlan) -> Tensor:
    """(BH, N, D) -> (BH*nb, span, D): window g = h*nb + r holds head h's keys r*bs - hi .. + span - 1.

    One zero-padded buffer holds all heads back to back (each padded to nb*bs rows), so the windows of
    every head are one `unfold` view with a uniform batch stride: no copy. A window reaching past its
    head's keys sees zeros or a neighbour head's keys; the plan masks those columns (j < 0, j >= N).
    """
    bh, _, d = x.shape
    bs, nb, span = plan.block, plan.n_blocks, plan.span
    flat = _pad_rows(x, nb * bs).reshape(bh * nb * bs, d)
    buffer = F.pad(flat, (0, 0, plan.pad_front, max(0, span - bs - plan.pad_front)))
    return buffer.unfold(0, span, bs).transpose(1, 2)[: bh * nb]


def _band_steps(plan: BandPlan, bh: int) -> list[tuple[int, int]]:
    """Ranges [g0, g1) of windows per step: whole heads when one fits, else parts of one head.

    Steps are no larger than STEP_BYTES allows, and small enough to give each thread two of them.
    """
    nb = plan.n_blocks
    per = min(plan.blocks_per_step, max(1, math.ceil(bh * nb / (2 * torch.get_num_threads()))))
    if per >= nb:
        heads = per // nb
        return [(h * nb, min(bh, h + heads) * nb) for h in range(0, bh, heads)]
    return [(h * nb + r, h * nb + min(nb, r + per)) for h in range(bh) for r in range(0, nb, per)]


def band_attention(plan: BandPlan, q: Tensor, k: Tensor, v: Tensor, differentiable: bool) -> Tensor:
    """q, k, v (BH, N, D) -> (BH, N, D) by sliding windows."""
    bh, n, d = q.shape
    bs, nb, span = plan.block, plan.n_blocks, plan.span
    qb = _pad_rows(q, nb * bs).reshape(bh * nb, bs, d)
    kw, vw = _windows(k, plan), _windows(v, plan)
    out = None if differentiable else q.new_empty(bh * nb, bs, d)

    def step(g0: int, g1: int) -> Tensor:
        scores = _scores(qb[g0:g1], kw[g0:g1], plan.scale)  # (G, bs, span)
        if g1 - g0 >= nb:  # whole heads: the pieces broadcast over them
            _add_pieces(scores.view(-1, nb, bs, span), plan.pieces, 0, nb)
        else:
            r0 = g0 % nb
            _add_pieces(scores.view(1, g1 - g0, bs, span), plan.pieces, r0, r0 + g1 - g0)
        return _softmax_times(scores, vw[g0:g1], None if out is None else out[g0:g1])

    outs = run_steps([lambda g=g: step(*g) for g in _band_steps(plan, bh)], q.device)
    result = torch.cat(outs) if out is None else out  # type: ignore[arg-type]
    return result.view(bh, nb * bs, d)[:, :n]


def gather_attention(plan: GatherPlan, q: Tensor, k: Tensor, v: Tensor, differentiable: bool) -> Tensor:
    """q, k, v (BH, N, D) -> (BH, N, D) by gathered key blocks."""
    bh, n, d = q.shape
    bs, nb = plan.block, plan.n_blocks
    qb, kb, vb = (_pad_rows(t, nb * bs).view(bh, nb, bs, d) for t in (q, k, v))
    out = None if differentiable else q.new_empty(bh, nb, bs, d)

    def step(s: GatherStep, h0: int, h1: int) -> Tensor | None:
        r, hg = len(s.rows), h1 - h0
        if s.keys == 0:  # no allowed key: zeros, still attached to q so that autograd sees them
            block_out = qb[h0:h1, s.rows].mul(0.0)
        else:
            qs = qb[h0:h1, s.rows].reshape(hg * r, bs, d)
            ks = kb[h0:h1][:, s.kv].reshape(hg * r, s.keys, d)  # (hg, R, c, bs, D) gathered
            vs = vb[h0:h1][:, s.kv].reshape(hg * r, s.keys, d)
            scores = _scores(qs, ks, plan.scale)
            _add_pieces(scores.view(hg, r, bs, s.keys), s.pieces, 0, r)
            block_out = _softmax_times(scores, vs, None).view(hg, r, bs, d)
        if out is None:
            return block_out
        out[h0:h1].index_copy_(1, s.rows, block_out)  # disjoint (heads, blocks) per step
        return None

    units = [(s, h0, min(bh, h0 + s.heads_per_step)) for s in plan.steps for h0 in range(0, bh, s.heads_per_step)]
    results = run_steps([lambda u=u: step(*u) for u in units], q.device)
    if out is None:
        per_step: list[list[Tensor]] = [[] for _ in plan.steps]
        index = {id(s): i for i, s in enumerate(plan.steps)}
        for (s, _, _), result in zip(units, results, strict=True):
            per_step[index[id(s)]].append(result)  # type: ignore[arg-type]
        out = torch.cat([torch.cat(parts) for parts in per_step], dim=1)[:, plan.inverse_order]
    return out.view(bh, nb * bs, d)[:, :n]


def blocked_attention(plan: BandPlan | GatherPlan, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q, k, v (BH, N, D) float -> (BH, N, D); rows without an allowed key are zero."""
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if isinstance(plan, BandPlan):
        out = band_attention(plan, q, k, v, differentiable)
    else:
        out = gather_attention(plan, q, k, v, differentiable)
    if plan.empty_rows is not None:
        out = out.masked_fill(plan.empty_rows[:, None], 0.0)
    return out
