"""The compute of `blocked`: batched dense products over a plan's key windows or gathered key blocks.

Inputs are grouped by KV head: q (B*Hkv, G, q_len, D), k and v (B*Hkv, N, D). The G query heads of one KV
head are stacked as the rows of one step, (G * rows, D) per query block, against that KV head's key window
or gathered key blocks (keys, D): each window or gathered block is read once per KV head, not once per
query head, and K and V are never repeated. The key gradients of the G heads sum inside the products.

Forward, per step (a batch of query blocks, of several KV heads at once where their scores fit in
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

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from impls.blocked.plan import BandPlan, BiasPiece, GatherPlan, GatherStep
from impls.common import InOrder, run_steps


def _pad_rows(x: Tensor, rows: int, dim: int = 1) -> Tensor:
    """x zero padded at the end of `dim` (a non-negative dim) to `rows`; x itself when long enough."""
    missing = rows - x.shape[dim]
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, missing]
    return F.pad(x, pad)


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x contiguous in `dtype`: x itself when it already is, else one copy (that also converts)."""
    if x.dtype == dtype and x.is_contiguous():
        return x
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    out.copy_(x)
    return out


def _query_blocks(x: Tensor, nb: int, rb: int) -> Tensor:
    """(BHkv, G, q_len, D) -> (BHkv, G, nb, rb, D); a view unless q_len is not a multiple of rb (zero rows)."""
    bk, g, _, d = x.shape
    return _pad_rows(x, nb * rb, dim=2).view(bk, g, nb, rb, d)


def _band_rows(x5: Tensor, h: int, r0: int, r1: int, dtype: torch.dtype) -> Tensor:
    """Query blocks r0..r1 of KV head h's G query heads as one batch of rows: (R, G * rb, D) in dtype.

    x5 (BHkv, G, nb, rb, D). A view when G == 1 (and the dtype is x5's), else a step-sized copy.
    """
    _, g, _, rb, d = x5.shape
    return _as(x5[h].transpose(0, 1)[r0:r1], dtype).view(r1 - r0, g * rb, d)


def _put_band_rows(x5: Tensor, h: int, r0: int, r1: int, rows: Tensor) -> None:
    """The inverse of `_band_rows`: x5's blocks r0..r1 of KV head h = rows (R, G * rb, D)."""
    _, g, _, rb, d = x5.shape
    x5[h].transpose(0, 1)[r0:r1].copy_(rows.view(r1 - r0, g, rb, d))


def _gather_rows(x5: Tensor, h0: int, h1: int, blocks: Tensor, dtype: torch.dtype) -> Tensor:
    """Query blocks `blocks` (R,) of KV heads h0..h1, each with its G query heads' rows: (hg*R, G*rb, D)."""
    _, g, _, rb, d = x5.shape
    return x5[h0:h1].transpose(1, 2)[:, blocks].to(dtype).view((h1 - h0) * len(blocks), g * rb, d)


class _Scratch:
    """Buffers that the steps of one inference call reuse, one set per thread.

    A step's scores are dead once its output is written, so without autograd each thread keeps one buffer
    for all its steps instead of allocating a fresh one per step: fewer page faults, and a peak that does not
    depend on which freed heap chunk the allocator hands the next step (a fresh 2 MiB per step moved the
    measured peak by 2 MiB steps from run to run). With autograd the probabilities are kept, so each step
    gets its own (`keep`). Buffers that no step keeps (a step's output before it is copied into place)
    are reused either way.
    """

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self._local = threading.local()

    def get(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised tensor of `shape`, with like's dtype and device."""
        if self.keep:
            return like.new_empty(shape)
        numel = math.prod(shape)
        buffer = getattr(self._local, name, None)
        if buffer is None or buffer.numel() < numel:
            buffer = like.new_empty(numel)
            setattr(self._local, name, buffer)
        return buffer[:numel].view(shape)


def _scores(q: Tensor, k: Tensor, scale: float, out: Tensor | None = None) -> Tensor:
    """q (X, rows, D), k (X, keys, D) -> scale * q k^T (X, rows, keys); beta=0 never reads the input."""
    buffer = q.new_empty(q.shape[0], q.shape[1], k.shape[1]) if out is None else out
    return torch.baddbmm(buffer, q, k.transpose(1, 2), beta=0.0, alpha=scale, out=buffer)


def _add_pieces(scores: Tensor, pieces: list[BiasPiece], s0: int, s1: int) -> None:
    """scores (heads, blocks s0..s1, G, rows, keys) += the pieces that cover any of those blocks."""
    for p in pieces:
        r0, r1 = max(p.r0, s0), min(p.r1, s1)
        if r0 < r1:
            bias = p.bias if p.bias.shape[0] == 1 else p.bias[r0 - p.r0 : r1 - p.r0]
            scores[:, r0 - s0 : r1 - s0, :, :, p.c0 : p.c1].add_(bias[:, None])  # the same for the G heads


def _softmax_(scores: Tensor) -> Tensor:
    """Softmax over the last dim, in place on CPU (torch's CPU kernel reads each row whole before writing
    it, so the aliasing is safe; tests compare the result with the oracle)."""
    return torch.softmax(scores, dim=-1, out=scores if scores.device.type == "cpu" else None)


def _grads_of_step(p: Tensor, d_out: Tensor, out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """One step's (dQ_blk, dK_blk, dV_blk): p (X, rows, keys), d_out/out/q (X, rows, D), k/v (X, keys, D)."""
    d_v = torch.bmm(p.transpose(1, 2), d_out)  # (X, keys, D)
    d_p = torch.bmm(d_out, v.transpose(1, 2))  # (X, rows, keys)
    delta = (d_out * out).sum(dim=-1, keepdim=True)  # rowsum(P * dP) = rowsum(dO * O)
    d_s = d_p.sub_(delta).mul_(p)  # masked pairs have p = 0, so no gradient
    d_q = torch.baddbmm(q.new_empty(q.shape), d_s, k, beta=0.0, alpha=scale)
    d_k = torch.baddbmm(k.new_empty(k.shape), d_s.transpose(1, 2), q, beta=0.0, alpha=scale)
    return d_q, d_k, d_v


# --- band: sliding windows ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    """Query blocks [r0, r1) of a band plan and their key windows (BHkv, r1 - r0, span, D)."""

    r0: int
    r1: int
    windows: Tensor


def _window_segments(x: Tensor, plan: BandPlan) -> list[_Segment]:
    """Window r of every KV head: key positions base + r*rb .. + span - 1, as views of x (BHkv, N, D).

    Windows inside the sequence are one `unfold` view of x (no copy); the few at its ends that reach
    before position 0 or past N - 1 (zeros there, masked by the plan) are views of a small zero-padded
    copy of those keys.
    """
    base, rb, span, nb, n = plan.base, plan.rows, plan.span, plan.n_blocks, plan.n
    first_inside = 0 if base >= 0 else -(base // rb)  # first window starting at position >= 0: ceil(-base / rb)
    end_inside = (n - span - base) // rb + 1 if n - span - base >= 0 else 0  # first window ending past N
    first_inside, end_inside = min(first_inside, nb), max(0, min(end_inside, nb))
    if first_inside < end_inside:
        ranges = [(0, first_inside), (first_inside, end_inside), (end_inside, nb)]
    else:
        ranges = [(0, nb)]
    segments = []
    for r0, r1 in ranges:
        if r0 == r1:
            continue
        p0, p1 = base + r0 * rb, base + (r1 - 1) * rb + span  # key positions [p0, p1)
        if p0 >= 0 and p1 <= n:
            keys = x[:, p0:p1]
        else:
            keys = x.new_zeros(x.shape[0], p1 - p0, x.shape[2])
            c0, c1 = min(max(p0, 0), n), max(min(p1, n), 0)
            if c0 < c1:
                keys[:, c0 - p0 : c1 - p0] = x[:, c0:c1]
        segments.append(_Segment(r0, r1, keys.unfold(1, span, rb).transpose(2, 3)))
    return segments


def _band_steps(plan: BandPlan, bk: int) -> list[tuple[int, int, int, int]]:
    """(h0, h1, r0, r1): whole KV heads per step when one fits in STEP_BYTES, else parts of one head; at
    least two steps per thread."""
    nb = plan.n_blocks
    per = min(plan.blocks_per_step, max(1, -(-bk * nb // (2 * torch.get_num_threads()))))
    if per >= nb:
        heads = per // nb
        return [(h, min(bk, h + heads), 0, nb) for h in range(0, bk, heads)]
    return [(h, h + 1, r, min(nb, r + per)) for h in range(bk) for r in range(0, nb, per)]


def _pieces_of(segments: list[_Segment], r0: int, r1: int):
    """(segment, a, b) for the blocks [a, b) of [r0, r1) in each segment."""
    for seg in segments:
        a, b = max(r0, seg.r0), min(r1, seg.r1)
        if a < b:
            yield seg, a, b


def band_forward(plan: BandPlan, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> tuple[Tensor, list]:
    """q (BHkv, G, q_len, D) in any float dtype, k, v (BHkv, N, D) float -> (out (BHkv, G, nb*rb, D) in k's
    dtype, each step's probabilities when `keep`)."""
    bk, g, _, d = q.shape
    rb, nb, span, acc = plan.rows, plan.n_blocks, plan.span, k.dtype
    q5 = _query_blocks(q, nb, rb)
    ks, vs = _window_segments(k, plan), _window_segments(v, plan)
    out = k.new_empty(bk, g, nb * rb, d)
    out5 = out.view(bk, g, nb, rb, d)
    direct = g == 1  # each query block's output is a contiguous slice of `out`
    scratch, transient = _Scratch(keep), _Scratch(False)

    def step(h0: int, h1: int, r0: int, r1: int) -> Tensor | None:
        scores = scratch.get("scores", (h1 - h0, r1 - r0, g * rb, span), k)
        for i, h in enumerate(range(h0, h1)):
            rows = _band_rows(q5, h, r0, r1, acc)
            for seg, a, b in _pieces_of(ks, r0, r1):  # windows have one stride within a segment
                _scores(rows[a - r0 : b - r0], seg.windows[h, a - seg.r0 : b - seg.r0], plan.scale,
                        out=scores[i, a - r0 : b - r0])
        _add_pieces(scores.view(h1 - h0, r1 - r0, g, rb, span), plan.pieces, r0, r1)
        probs = _softmax_(scores)
        for i, h in enumerate(range(h0, h1)):
            result = out5[h, 0, r0:r1] if direct else transient.get("result", (r1 - r0, g * rb, d), k)
            for seg, a, b in _pieces_of(vs, r0, r1):
                torch.bmm(probs[i, a - r0 : b - r0], seg.windows[h, a - seg.r0 : b - seg.r0],
                          out=result[a - r0 : b - r0])
            if not direct:
                _put_band_rows(out5, h, r0, r1, result)
        return probs if keep else None

    steps = _band_steps(plan, bk)
    return out, run_steps([lambda s=s: step(*s) for s in steps], q.device)


def band_backward(plan: BandPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, probs: list[Tensor],
                  d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of band_forward's output `out` (BHkv, G, nb*rb, D) given d_out (BHkv, G, q_len, D)."""
    bk, g, nq, d = q.shape
    rb, nb, span, n, acc = plan.rows, plan.n_blocks, plan.span, plan.n, k.dtype
    q5, d_o5 = _query_blocks(q, nb, rb), _query_blocks(d_out, nb, rb)
    out5 = out.view(bk, g, nb, rb, d)
    ks, vs = _window_segments(k, plan), _window_segments(v, plan)
    d_q = q.new_empty(bk, g, nb * rb, d)
    d_q5 = d_q.view(bk, g, nb, rb, d)
    d_k = torch.zeros(bk * n, d, dtype=acc, device=k.device)
    d_v = torch.zeros_like(d_k)
    offsets = torch.arange(span, device=q.device)
    in_order = InOrder()

    def step(i: int, h0: int, h1: int, r0: int, r1: int) -> None:
        adds = []  # (h, a, dK, dV) of blocks a .. of KV head h
        try:
            for j, h in enumerate(range(h0, h1)):
                d_o, o, qq = (_band_rows(x5, h, r0, r1, acc) for x5 in (d_o5, out5, q5))
                for (seg, a, b), (v_seg, _, _) in zip(_pieces_of(ks, r0, r1), _pieces_of(vs, r0, r1), strict=True):
                    x, y = a - r0, b - r0
                    dq, dk, dv = _grads_of_step(probs[i][j, x:y], d_o[x:y], o[x:y], qq[x:y],
                                                seg.windows[h, a - seg.r0 : b - seg.r0],
                                                v_seg.windows[h, a - seg.r0 : b - seg.r0], plan.scale)
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
                d_k.index_add_(0, rows, dk.reshape(-1, d))
                d_v.index_add_(0, rows, dv.reshape(-1, d))

    steps = _band_steps(plan, bk)
    run_steps([lambda i=i, s=s: step(i, *s) for i, s in enumerate(steps)], q.device)
    return d_q[:, :, :nq], d_k.view(bk, n, d), d_v.view(bk, n, d)


# --- gather: key blocks ---------------------------------------------------------------------------------


def _gather_units(plan: GatherPlan, bk: int) -> list[tuple[GatherStep, int, int]]:
    """(step, first KV head, last KV head + 1) for every step and head group."""
    return [(s, h0, min(bk, h0 + s.heads_per_step)) for s in plan.steps for h0 in range(0, bk, s.heads_per_step)]


def _gathered(blocks: Tensor, s: GatherStep, h0: int, h1: int) -> Tensor:
    """blocks (BHkv, nkb, bs, D) -> the step's key blocks of KV heads h0..h1: (hg*R, c*bs, D), a copy; or, for
    a step whose query blocks share one run of key blocks, (hg, c*bs, D), a view."""
    if s.run_start is not None:
        c = s.kv.shape[1]
        return blocks[h0:h1, s.run_start : s.run_start + c].reshape(h1 - h0, s.keys, blocks.shape[-1])
    return blocks[h0:h1][:, s.kv].reshape((h1 - h0) * len(s.rows), s.keys, blocks.shape[-1])


def _batched(x: Tensor, s: GatherStep, hg: int) -> Tensor:
    """A step's rows (hg*R, G*rb, ...) as the batches of its products: (hg, R*G*rb, ...) when its query
    blocks share their keys (`GatherStep.run_start`), else as they are (a view either way)."""
    return x.view(hg, -1, x.shape[-1]) if s.run_start is not None else x


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


def _key_blocks(x: Tensor, plan: GatherPlan) -> Tensor:
    """(BHkv, N, D) -> (BHkv, nkb, bs, D), zero padded (a view when bs divides N)."""
    return _pad_rows(x, plan.n_key_blocks * plan.block).view(x.shape[0], plan.n_key_blocks, plan.block, x.shape[2])


def gather_forward(plan: GatherPlan, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> tuple[Tensor, list]:
    """q (BHkv, G, q_len, D) in any float dtype, k, v (BHkv, N, D) float -> (out (BHkv, G, nqb*rb, D) in k's
    dtype, each unit's probabilities when `keep`)."""
    bk, g, _, d = q.shape
    rb, nqb, acc = plan.rows, plan.n_blocks, k.dtype
    q5 = _query_blocks(q, nqb, rb)
    kb, vb = _key_blocks(k, plan), _key_blocks(v, plan)
    out = k.new_empty(bk, g, nqb * rb, d)
    out5 = out.view(bk, g, nqb, rb, d)
    scratch = _Scratch(keep)

    def unit(s: GatherStep, h0: int, h1: int) -> Tensor | None:
        r, hg = len(s.rows), h1 - h0
        if s.keys == 0:  # no allowed key: zeros
            out5[h0:h1].index_fill_(2, s.rows, 0.0)
            return None
        rows = _batched(_gather_rows(q5, h0, h1, s.rows, acc), s, hg)
        scores = _scores(rows, _gathered(kb, s, h0, h1), plan.scale,
                         out=scratch.get("scores", (rows.shape[0], rows.shape[1], s.keys), k))
        _add_pieces(scores.view(hg, r, g, rb, s.keys), s.pieces, 0, r)
        probs = _softmax_(scores)
        result = torch.bmm(probs, _gathered(vb, s, h0, h1)).view(hg, r, g, rb, d)
        out5[h0:h1].index_copy_(2, s.rows, result.transpose(1, 2))
        return probs if keep else None  # (KV heads, blocks) are disjoint between units

    return out, run_steps([lambda u=u: unit(*u) for u in _gather_units(plan, bk)], q.device)


def gather_backward(plan: GatherPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, probs: list,
                    d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of gather_forward's output `out` (BHkv, G, nqb*rb, D) given d_out (BHkv, G, q_len, D)."""
    bk, g, nq, d = q.shape
    bs, rb, nqb, n, acc = plan.block, plan.rows, plan.n_blocks, plan.n, k.dtype
    q5, d_o5 = _query_blocks(q, nqb, rb), _query_blocks(d_out, nqb, rb)
    out5 = out.view(bk, g, nqb, rb, d)
    kb, vb = _key_blocks(k, plan), _key_blocks(v, plan)
    d_q = q.new_zeros(bk, g, nqb * rb, d)
    d_q5 = d_q.view(bk, g, nqb, rb, d)
    d_k = torch.zeros(bk * n, d, dtype=acc, device=k.device)
    d_v = torch.zeros_like(d_k)
    in_order = InOrder()

    def unit(i: int, s: GatherStep, h0: int, h1: int) -> None:
        if s.keys == 0:
            with in_order.turn(i):  # nothing to add: pass the turn on
                return
        r, hg = len(s.rows), h1 - h0
        try:
            d_o, o, qq = (_batched(_gather_rows(x5, h0, h1, s.rows, acc), s, hg) for x5 in (d_o5, out5, q5))
            dq, dk, dv = _grads_of_step(probs[i], d_o, o, qq, _gathered(kb, s, h0, h1), _gathered(vb, s, h0, h1),
                                        plan.scale)
        except BaseException:
            with in_order.turn(i):  # pass the turn on, then fail
                raise
        d_q5[h0:h1].index_copy_(2, s.rows, dq.view(hg, r, g, rb, d).transpose(1, 2).to(d_q.dtype))
        key_rows = _key_rows(s, h0, h1, n, bs)
        with in_order.turn(i):  # key blocks are shared between query blocks
            d_k.index_add_(0, key_rows, dk.reshape(-1, d))
            d_v.index_add_(0, key_rows, dv.reshape(-1, d))

    run_steps([lambda i=i, u=u: unit(i, *u) for i, u in enumerate(_gather_units(plan, bk))], q.device)
    return d_q[:, :, :nq], d_k.view(bk, n, d), d_v.view(bk, n, d)


# --- entry points ---------------------------------------------------------------------------------------


def _forward(plan: BandPlan | GatherPlan, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> tuple[Tensor, list]:
    if isinstance(plan, BandPlan):
        return band_forward(plan, q, k, v, keep)
    return gather_forward(plan, q, k, v, keep)


class BlockedAttention(torch.autograd.Function):
    """Differentiable blocked attention over grouped inputs; saves each step's probabilities (O(nnz))."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: BandPlan | GatherPlan) -> Tensor:
        out, probs = _forward(plan, q, k, v, keep=True)
        ctx.save_for_backward(q, k, v, out)
        ctx.probs, ctx.plan = probs, plan
        return out[:, :, : q.shape[2]]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor):
        q, k, v, out = ctx.saved_tensors
        backward = band_backward if isinstance(ctx.plan, BandPlan) else gather_backward
        grads = backward(ctx.plan, q, k, v, out, ctx.probs, d_out.contiguous())
        ctx.probs = None
        return (*grads, None)


def blocked_attention(plan: BandPlan | GatherPlan, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q (B*Hkv, G, q_len, D), k, v (B*Hkv, N, D) -> (B*Hkv, G, q_len, D) in k's dtype: query head g of KV
    head h reads h's keys. k and v are float32 or float64 (the accumulation dtype); q may be of lower
    precision (its rows are converted step by step, and so are its gradient's). Rows without an allowed
    key are zero."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = BlockedAttention.apply(q, k, v, plan)
    else:
        out = _forward(plan, q, k, v, keep=False)[0][:, :, : q.shape[2]]
    if plan.empty_rows is not None:
        out = out.masked_fill(plan.empty_rows[:, None], 0.0)
    return out
