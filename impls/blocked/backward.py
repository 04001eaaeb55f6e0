"""The backward of `blocked`: the forward's steps walked again with their saved probabilities.

Per step: dV_blk = P^T dO, dP = dO V_blk^T, dS = P * (dP - rowsum(dO * O)), dQ = scale dS K_blk, dK_blk =
scale dS^T Q. Products run in the inputs' dtype (low-precision GEMMs accumulate in float32 inside);
rowsum(dO * O) is taken in float32, and key gradients of overlapping windows or shared blocks are summed
in float32 (bfloat16 sums of many windows would lose the small ones) with index_add_, step after step in a
fixed order (`InOrder`), so that identical runs give identical gradients. Left to autograd, every step's
slice of the shared windows would allocate a zero gradient of the full size: quadratic in N (2.8 s at
N=8192 against 0.74 s at N=4096).
"""

from __future__ import annotations

import torch
from torch import Tensor

from impls.blocked.compute import (
    Scratch,
    _band_rows,
    _band_steps,
    _batched,
    _gather_rows,
    _gather_units,
    _gathered,
    _key_blocks,
    _pieces_of,
    _put_band_rows,
    _put_gathered_rows,
    _query_blocks,
    _window_segments,
    packed,
)
from impls.blocked.plan import BandPlan, GatherPlan, GatherStep
from impls.common import InOrder, accum_dtype, run_steps


def _grads_of_step(p: Tensor, d_out: Tensor, out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float,
                   scratch: Scratch) -> tuple[Tensor, Tensor, Tensor]:
    """One step's (dQ_blk, dK_blk, dV_blk): p (X, rows, keys), d_out/out/q (X, rows, D), k/v (X, keys, D)."""
    d_v = torch.bmm(p.transpose(1, 2), d_out)  # (X, keys, D)
    d_p = torch.bmm(d_out, packed(v, scratch, "values").transpose(1, 2))  # (X, rows, keys)
    if accum_dtype(d_p.dtype) == d_p.dtype:
        delta = (d_out * out).sum(dim=-1, keepdim=True)  # rowsum(P * dP) = rowsum(dO * O)
    else:  # from the rounded dP itself, summed in float32: each row of dS then sums to 0 as it should (a row
        # with one allowed key has dS = 0 exactly; against rowsum(dO * O) its dP's rounding would be all of dS)
        delta = torch.sum(p * d_p, dim=-1, keepdim=True, dtype=torch.float32)
    d_s = d_p.sub_(delta).mul_(p)  # masked pairs have p = 0, so no gradient
    d_q = torch.baddbmm(q.new_empty(q.shape), d_s, k, beta=0.0, alpha=scale)
    d_k = torch.baddbmm(k.new_empty(k.shape), d_s.transpose(1, 2), q, beta=0.0, alpha=scale)
    return d_q, d_k, d_v


def band_backward(plan: BandPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, probs: list[Tensor],
                  d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of band_forward's output `out` (BHkv, G, nb*rb, D) given d_out (BHkv, G, q_len, D)."""
    bk, g, nq, d = q.shape
    rb, nb, span, n, cd, acc = plan.rows, plan.n_blocks, plan.span, plan.n, k.dtype, accum_dtype(k.dtype)
    q5, d_o5 = _query_blocks(q, nb, rb), _query_blocks(d_out, nb, rb)
    out5 = out.view(bk, g, nb, rb, d)
    ks, vs = _window_segments(k, plan), _window_segments(v, plan)
    d_q = q.new_empty(bk, g, nb * rb, d)
    d_q5 = d_q.view(bk, g, nb, rb, d)
    d_k = torch.zeros(bk * n, d, dtype=acc, device=k.device)
    d_v = torch.zeros_like(d_k)
    offsets = torch.arange(span, device=q.device)
    in_order, scratch = InOrder(), Scratch(False)

    def step(i: int, h0: int, h1: int, r0: int, r1: int) -> None:
        adds = []  # (h, a, dK, dV) of blocks a .. of KV head h
        try:
            for j, h in enumerate(range(h0, h1)):
                d_o, o, qq = (_band_rows(x5, h, r0, r1, cd) for x5 in (d_o5, out5, q5))
                for (seg, a, b), (v_seg, _, _) in zip(_pieces_of(ks, r0, r1), _pieces_of(vs, r0, r1), strict=True):
                    x, y = a - r0, b - r0
                    dq, dk, dv = _grads_of_step(probs[i][j, x:y], d_o[x:y], o[x:y], qq[x:y],
                                                seg.windows[h, a - seg.r0 : b - seg.r0],
                                                v_seg.windows[h, a - seg.r0 : b - seg.r0], plan.scale,
                                                scratch)
                    _put_band_rows(d_q5, h, a, b, dq)
                    adds.append((h, a, dk, dv))
        except BaseException:
            with in_order.turn(i):  # pass the turn on, then fail
                raise
        with in_order.turn(i):  # windows overlap, within and across steps
            for h, a, dk, dv in adds:
                # Window keys outside the sequence have zero gradient (their probabilities are 0): clamped
                # onto the first or last key they add nothing.
                blocks = torch.arange(a, a + dk.shape[0], device=q.device)[:, None]
                rows = ((plan.base + blocks * rb + offsets).clamp_(0, n - 1) + h * n).flatten()
                d_k.index_add_(0, rows, dk.reshape(-1, d).to(acc))
                d_v.index_add_(0, rows, dv.reshape(-1, d).to(acc))

    steps = _band_steps(plan, bk)
    run_steps([lambda i=i, s=s: step(i, *s) for i, s in enumerate(steps)], q.device)
    return d_q[:, :, :nq], d_k.view(bk, n, d).to(cd), d_v.view(bk, n, d).to(cd)


def _key_rows(s: GatherStep, h0: int, h1: int, n: int, bs: int) -> Tensor:
    """Rows of the (BHkv*N, D) key gradient that the step's keys (as `_gathered` lays them out) add into.

    Key columns past N (padding of the last key block) have zero gradient: clamped onto the last key, they
    add nothing."""
    in_block = torch.arange(bs, device=s.kv.device)
    heads = torch.arange(h0, h1, device=s.kv.device)
    if s.run_start is not None:
        cols = torch.arange(s.run_start * bs, s.run_start * bs + s.keys, device=s.kv.device).clamp_(max=n - 1)
        return (heads[:, None] * n + cols).flatten()  # (hg*c*bs,)
    cols = (s.kv[:, :, None] * bs + in_block).clamp_(max=n - 1)  # (R, c, bs)
    return (heads.view(-1, 1, 1, 1) * n + cols).flatten()  # (hg*R*c*bs,)


def gather_backward(plan: GatherPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, probs: list,
                    d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of gather_forward's output `out` (BHkv, G, nqb*rb, D) given d_out (BHkv, G, q_len, D)."""
    bk, g, nq, d = q.shape
    bs, rb, nqb, n, cd, acc = plan.block, plan.rows, plan.n_blocks, plan.n, k.dtype, accum_dtype(k.dtype)
    q5, d_o5 = _query_blocks(q, nqb, rb), _query_blocks(d_out, nqb, rb)
    out5 = out.view(bk, g, nqb, rb, d)
    kb, vb = _key_blocks(k, plan), _key_blocks(v, plan)
    d_q = q.new_zeros(bk, g, nqb * rb, d)
    d_q5 = d_q.view(bk, g, nqb, rb, d)
    d_k = torch.zeros(bk * n, d, dtype=acc, device=k.device)
    d_v = torch.zeros_like(d_k)
    in_order, scratch = InOrder(), Scratch(False)

    def unit(i: int, s: GatherStep, h0: int, h1: int) -> None:
        if s.keys == 0:
            with in_order.turn(i):  # nothing to add: pass the turn on
                return
        hg = h1 - h0
        try:
            d_o, o, qq = (_batched(_gather_rows(x5, h0, h1, s.rows, cd), s, hg) for x5 in (d_o5, out5, q5))
            dq, dk, dv = _grads_of_step(probs[i], d_o, o, qq, _gathered(kb, s, h0, h1), _gathered(vb, s, h0, h1),
                                        plan.scale, scratch)
        except BaseException:
            with in_order.turn(i):  # pass the turn on, then fail
                raise
        _put_gathered_rows(d_q5, h0, h1, s.rows, dq)
        key_rows = _key_rows(s, h0, h1, n, bs)
        with in_order.turn(i):  # key blocks are shared between query blocks
            d_k.index_add_(0, key_rows, dk.reshape(-1, d).to(acc))
            d_v.index_add_(0, key_rows, dv.reshape(-1, d).to(acc))

    run_steps([lambda i=i, u=u: unit(i, *u) for i, u in enumerate(_gather_units(plan, bk))], q.device)
    return d_q[:, :, :nq], d_k.view(bk, n, d).to(cd), d_v.view(bk, n, d).to(cd)
