"""The compute of `blocked`: batched dense products over a plan's key windows or gathered key blocks.

Forward, per step (a batch of query blocks, of several heads at once where their scores fit in
STEP_BYTES): scores = scale * Q_blk K_blk^T in one GEMM (baddbmm, the scale inside it), the plan's bias
pieces added where blocks are partially allowed, softmax, then P V_blk in one GEMM. Each query row's batch
holds every key it may see, so the softmax is exact in one go (torch's fused kernel: a max pass, then
exp, sum and normalise); no online rescaling is needed.

Backward (`BlockedAttention`, an autograd.Function) walks the same steps with the saved probabilities:
dV_blk = P^T dO, dP = dO V_blk^T, dS = P * (dP - rowsum(dO * O)), dQ = scale dS K_blk, dK_blk = scale
dS^T Q. Key gradients of overlapping windows or shared blocks are summed with index_add_, step after
step in a fixed order (`InOrder`), so that identical runs give identical gradients. Left to
autograd, every step's slice of the shared windows would allocate a zero gradient of the full size:
quadratic in N (2.8 s at N=8192 against 0.74 s at N=4096).

Steps are independent, so on CPU they run side by side on threads (`impls.common.run_steps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from impls.blocked.plan import BandPlan, BiasPiece, GatherPlan, GatherStep
from impls.common import InOrder, run_steps


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


def _softmax_(scores: Tensor) -> Tensor:
    """Softmax over the last dim, in place on CPU (torch's CPU kernel reads each row whole before writing
    it, so the aliasing is safe; tests compare the result with the oracle)."""
    return torch.softmax(scores, dim=-1, out=scores if scores.device.type == "cpu" else None)


def _grads_of_step(p: Tensor, d_out: Tensor, out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """One step's (dQ_blk, dK_blk, dV_blk): p (G, bs, keys), d_out/out/q (G, bs, D), k/v (G, keys, D)."""
    d_v = torch.bmm(p.transpose(1, 2), d_out)  # (G, keys, D)
    d_p = torch.bmm(d_out, v.transpose(1, 2))  # (G, bs, keys)
    delta = (d_out * out).sum(dim=-1, keepdim=True)  # rowsum(P * dP) = rowsum(dO * O)
    d_s = d_p.sub_(delta).mul_(p)  # masked pairs have p = 0, so no gradient
    d_q = torch.baddbmm(q.new_empty(q.shape), d_s, k, beta=0.0, alpha=scale)
    d_k = torch.baddbmm(k.new_empty(k.shape), d_s.transpose(1, 2), q, beta=0.0, alpha=scale)
    return d_q, d_k, d_v


# --- band: sliding windows ------------------------------------------------------------------------------


@dataclass
class _Band:
    """A band plan's inputs laid out for its steps."""

    qb: Tensor  # (BH*nb, bs, D)
    k_buffer: Tensor  # (rows, D): all heads back to back, zero padded; windows are views of it
    v_buffer: Tensor
    kw: Tensor  # (BH*nb, span, D) window views
    vw: Tensor
    steps: list[tuple[int, int]]  # ranges [g0, g1) of windows


def _window_buffer(x: Tensor, plan: BandPlan) -> Tensor:
    """(BH, N, D) -> one buffer holding all heads back to back (each padded to nb*bs rows), zero padded.

    Window g = h*nb + r (head h's keys r*bs - hi .. + span - 1) starts at buffer row g*bs, so the windows
    of every head are one `unfold` view with a uniform batch stride. A window past its head's keys sees
    zeros or a neighbour head's keys; the plan masks those columns (j < 0, j >= N).
    """
    flat = _pad_rows(x, plan.n_blocks * plan.block).reshape(-1, x.shape[2])
    return F.pad(flat, (0, 0, plan.pad_front, max(0, plan.span - plan.block - plan.pad_front)))


def _band_layout(plan: BandPlan, q: Tensor, k: Tensor, v: Tensor) -> _Band:
    bh, _, d = q.shape
    bs, nb, span = plan.block, plan.n_blocks, plan.span
    k_buffer, v_buffer = _window_buffer(k, plan), _window_buffer(v, plan)
    kw, vw = (b.unfold(0, span, bs).transpose(1, 2)[: bh * nb] for b in (k_buffer, v_buffer))
    # Steps: whole heads when one fits in STEP_BYTES, else parts of one head; at least two per thread.
    per = min(plan.blocks_per_step, max(1, -(-bh * nb // (2 * torch.get_num_threads()))))
    if per >= nb:
        heads = per // nb
        steps = [(h * nb, min(bh, h + heads) * nb) for h in range(0, bh, heads)]
    else:
        steps = [(h * nb + r, h * nb + min(nb, r + per)) for h in range(bh) for r in range(0, nb, per)]
    return _Band(_pad_rows(q, nb * bs).reshape(bh * nb, bs, d), k_buffer, v_buffer, kw, vw, steps)


def band_forward(plan: BandPlan, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> tuple[Tensor, list]:
    """q, k, v (BH, N, D) -> (out (BH*nb, bs, D), each step's probabilities when `keep`)."""
    bs, nb, span = plan.block, plan.n_blocks, plan.span
    lay = _band_layout(plan, q, k, v)
    out = q.new_empty(lay.qb.shape)

    def step(g0: int, g1: int) -> Tensor | None:
        scores = _scores(lay.qb[g0:g1], lay.kw[g0:g1], plan.scale)  # (G, bs, span)
        if g1 - g0 >= nb:  # whole heads: the pieces broadcast over them
            _add_pieces(scores.view(-1, nb, bs, span), plan.pieces, 0, nb)
        else:
            r0 = g0 % nb
            _add_pieces(scores.view(1, g1 - g0, bs, span), plan.pieces, r0, r0 + g1 - g0)
        probs = _softmax_(scores)
        torch.bmm(probs, lay.vw[g0:g1], out=out[g0:g1])
        return probs if keep else None

    return out, run_steps([lambda g=g: step(*g) for g in lay.steps], q.device)


def band_backward(plan: BandPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, probs: list[Tensor],
                  d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (BH, N, D) of band_forward's output `out` (BH*nb, bs, D) given d_out (BH, N, D)."""
    bh, n, d = q.shape
    bs, nb, span = plan.block, plan.n_blocks, plan.span
    lay = _band_layout(plan, q, k, v)
    d_ob = _pad_rows(d_out, nb * bs).reshape(bh * nb, bs, d)
    d_q = torch.empty_like(lay.qb)
    d_kb, d_vb = torch.zeros_like(lay.k_buffer), torch.zeros_like(lay.v_buffer)
    offsets = torch.arange(span, device=q.device)
    in_order = InOrder()

    def step(i: int, g0: int, g1: int) -> None:
        try:
            dq, dk, dv = _grads_of_step(probs[i], d_ob[g0:g1], out[g0:g1], lay.qb[g0:g1], lay.kw[g0:g1],
                                        lay.vw[g0:g1], plan.scale)
        except BaseException:
            with in_order.turn(i):  # pass the turn on, then fail
                raise
        d_q[g0:g1] = dq
        rows = (torch.arange(g0, g1, device=q.device)[:, None] * bs + offsets).flatten()  # window rows
        with in_order.turn(i):  # windows overlap, within and across steps
            d_kb.index_add_(0, rows, dk.reshape(-1, d))
            d_vb.index_add_(0, rows, dv.reshape(-1, d))

    run_steps([lambda i=i, g=g: step(i, *g) for i, g in enumerate(lay.steps)], q.device)
    first = plan.pad_front

    def unpad(buffer: Tensor) -> Tensor:
        return buffer[first : first + bh * nb * bs].view(bh, nb * bs, d)[:, :n]

    return d_q.view(bh, nb * bs, d)[:, :n], unpad(d_kb), unpad(d_vb)


# --- gather: key blocks ---------------------------------------------------------------------------------


def _gather_units(plan: GatherPlan, bh: int) -> list[tuple[GatherStep, int, int]]:
    """(step, first head, last head + 1) for every step and head group."""
    return [(s, h0, min(bh, h0 + s.heads_per_step)) for s in plan.steps for h0 in range(0, bh, s.heads_per_step)]


def _gathered(blocks: Tensor, s: GatherStep, h0: int, h1: int) -> Tensor:
    """blocks (BH, nb, bs, D) -> the step's key blocks of heads h0..h1, (hg*R, c*bs, D) (a copy)."""
    return blocks[h0:h1][:, s.kv].reshape((h1 - h0) * len(s.rows), s.keys, blocks.shape[-1])


def gather_forward(plan: GatherPlan, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> tuple[Tensor, list]:
    """q, k, v (BH, N, D) -> (out (BH, nb, bs, D), each unit's probabilities when `keep`)."""
    bh, _, d = q.shape
    bs, nb = plan.block, plan.n_blocks
    qb, kb, vb = (_pad_rows(t, nb * bs).view(bh, nb, bs, d) for t in (q, k, v))
    out = q.new_empty(bh, nb, bs, d)

    def unit(s: GatherStep, h0: int, h1: int) -> Tensor | None:
        r, hg = len(s.rows), h1 - h0
        if s.keys == 0:  # no allowed key: zeros
            out[h0:h1].index_fill_(1, s.rows, 0.0)
            return None
        scores = _scores(qb[h0:h1, s.rows].reshape(hg * r, bs, d), _gathered(kb, s, h0, h1), plan.scale)
        _add_pieces(scores.view(hg, r, bs, s.keys), s.pieces, 0, r)
        probs = _softmax_(scores)
        out[h0:h1].index_copy_(1, s.rows, torch.bmm(probs, _gathered(vb, s, h0, h1)).view(hg, r, bs, d))
        return probs if keep else None  # (heads, blocks) are disjoint between units

    return out, run_steps([lambda u=u: unit(*u) for u in _gather_units(plan, bh)], q.device)


def gather_backward(plan: GatherPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, probs: list,
                    d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (BH, N, D) of gather_forward's output `out` (BH, nb, bs, D) given d_out (BH, N, D)."""
    bh, n, d = q.shape
    bs, nb = plan.block, plan.n_blocks
    qb, kb, vb, d_ob = (_pad_rows(t, nb * bs).view(bh, nb, bs, d) for t in (q, k, v, d_out))
    d_q = torch.zeros_like(qb)
    d_k, d_v = torch.zeros(bh * nb * bs, d, dtype=q.dtype, device=q.device), torch.zeros_like(qb).view(-1, d)
    in_block = torch.arange(bs, device=q.device)
    in_order = InOrder()

    def unit(i: int, s: GatherStep, h0: int, h1: int) -> None:
        if s.keys == 0:
            with in_order.turn(i):  # nothing to add: pass the turn on
                return
        r, hg = len(s.rows), h1 - h0
        rows_of = lambda t: t[h0:h1, s.rows].reshape(hg * r, bs, d)  # noqa: E731
        try:
            dq, dk, dv = _grads_of_step(probs[i], rows_of(d_ob), rows_of(out), rows_of(qb),
                                        _gathered(kb, s, h0, h1), _gathered(vb, s, h0, h1), plan.scale)
        except BaseException:
            with in_order.turn(i):  # pass the turn on, then fail
                raise
        d_q[h0:h1].index_copy_(1, s.rows, dq.view(hg, r, bs, d))
        heads = torch.arange(h0, h1, device=q.device).view(hg, 1, 1, 1)
        key_rows = ((heads * nb + s.kv.view(1, r, -1, 1)) * bs + in_block).flatten()  # (hg*R*c*bs,)
        with in_order.turn(i):  # key blocks are shared between query blocks
            d_k.index_add_(0, key_rows, dk.reshape(-1, d))
            d_v.index_add_(0, key_rows, dv.reshape(-1, d))

    run_steps([lambda i=i, u=u: unit(i, *u) for i, u in enumerate(_gather_units(plan, bh))], q.device)
    return tuple(t.view(bh, nb * bs, d)[:, :n] for t in (d_q, d_k, d_v))  # type: ignore[return-value]


# --- entry points ---------------------------------------------------------------------------------------


def _forward(plan: BandPlan | GatherPlan, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> tuple[Tensor, list]:
    if isinstance(plan, BandPlan):
        return band_forward(plan, q, k, v, keep)
    return gather_forward(plan, q, k, v, keep)


class BlockedAttention(torch.autograd.Function):
    """Differentiable blocked attention over (BH, N, D); saves each step's probabilities (O(nnz))."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: BandPlan | GatherPlan) -> Tensor:
        out, probs = _forward(plan, q, k, v, keep=True)
        ctx.save_for_backward(q, k, v, out)
        ctx.probs, ctx.plan = probs, plan
        return out.view(q.shape[0], -1, q.shape[2])[:, : q.shape[1]]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor):
        q, k, v, out = ctx.saved_tensors
        backward = band_backward if isinstance(ctx.plan, BandPlan) else gather_backward
        grads = backward(ctx.plan, q, k, v, out, ctx.probs, d_out.contiguous())
        ctx.probs = None
        return (*grads, None)


def blocked_attention(plan: BandPlan | GatherPlan, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q, k, v (BH, N, D) float -> (BH, N, D); rows without an allowed key are zero."""
    bh, n, d = q.shape
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = BlockedAttention.apply(q, k, v, plan)
    else:
        out = _forward(plan, q, k, v, keep=False)[0].view(bh, -1, d)[:, :n]
    if plan.empty_rows is not None:
        out = out.masked_fill(plan.empty_rows[:, None], 0.0)
    return out
