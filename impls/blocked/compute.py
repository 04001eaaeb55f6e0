"""The forward of `blocked`: batched dense products over a plan's key windows or gathered key blocks.

Inputs are grouped by KV head: q (B*Hkv, G, q_len, D), k and v (B*Hkv, N, D). The G query heads of one KV
head are stacked as the rows of one step, (G * rows, D) per query block, against that KV head's key window
or gathered key blocks (keys, D): each window or gathered block is read once per KV head, not once per
query head, and K and V are never repeated. The key gradients of the G heads sum inside the products.

Per step (a batch of query blocks, of several KV heads at once where their scores fit in STEP_BYTES):
scores = scale * Q_blk K_blk^T in one GEMM (baddbmm, the scale inside it), the plan's bias pieces added
where blocks are partially allowed, softmax, then P V_blk in one GEMM. Each query row's batch holds every
key it may see, so the softmax is exact in one go (torch's fused kernel: a max pass, then exp, sum and
normalise); no online rescaling is needed.

Products run in the inputs' dtype: bfloat16 and float16 inputs use the low-precision GEMMs (on a CPU with
AMX, bfloat16 runs about 6x float32's rate), which accumulate in float32 inside and round their result
once; the softmax of low-precision scores computes its maximum, exponentials and sum in float32 (torch's
CPU kernel converts each row) and rounds the probabilities once, to the dtype of the P V product. The
backward (`backward`) accumulates the key gradients in float32. In bfloat16 the products stop being the
cost: per score element the softmax pass took 1.2-1.6 ns on one core (thread time, on a loaded 2-core Xeon),
as long as both products at D=64 (256 flops per element at about 250 GF/s); the bias and copy passes add to
it. Inference in low precision on a band plan therefore goes through a fused kernel instead (`fused`).

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
from impls.common import run_steps


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


def _block_index(x5: Tensor, h0: int, h1: int, blocks: Tensor) -> Tensor:
    """Rows of x5 (BHkv, G, nb, rb, D) seen as (BHkv*G*nb, rb*D) holding query blocks `blocks` (R,) of KV heads
    h0..h1, in (KV head, block, query head) order: the layout of a step's rows."""
    _, g, nb, _, _ = x5.shape
    heads = torch.arange(h0, h1, device=blocks.device).view(-1, 1, 1) * g
    return ((heads + torch.arange(g, device=blocks.device).view(1, 1, -1)) * nb + blocks.view(1, -1, 1)).flatten()


def _gather_rows(x5: Tensor, h0: int, h1: int, blocks: Tensor, dtype: torch.dtype) -> Tensor:
    """Query blocks `blocks` (R,) of KV heads h0..h1, each with its G query heads' rows: (hg*R, G*rb, D).

    One index_select of whole blocks (a row copy each): advanced indexing of the 5-d view copied element by
    element, 4-6x slower (float32 and bfloat16, one core)."""
    _, g, _, rb, d = x5.shape
    if not x5.is_contiguous():  # a strided view of the caller's q: a reshape would copy all of it, every step
        return x5[h0:h1].transpose(1, 2)[:, blocks].to(dtype).reshape((h1 - h0) * len(blocks), g * rb, d)
    rows = torch.index_select(x5.view(-1, rb * d), 0, _block_index(x5, h0, h1, blocks))
    return rows.to(dtype).view((h1 - h0) * len(blocks), g * rb, d)


def _put_gathered_rows(x5: Tensor, h0: int, h1: int, blocks: Tensor, rows: Tensor) -> None:
    """The inverse of `_gather_rows`: x5's blocks `blocks` of KV heads h0..h1 = rows (hg*R or hg, ..., D), laid
    out as `_gather_rows` returns them. x5 must be contiguous (the output and gradient buffers are)."""
    _, _, _, rb, d = x5.shape
    x5.view(-1, rb * d).index_copy_(0, _block_index(x5, h0, h1, blocks), rows.reshape(-1, rb * d).to(x5.dtype))


class Scratch:
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


def packed(x: Tensor, scratch: Scratch, name: str) -> Tensor:
    """x as the transposed operand of a product: as it is in float32 and float64 (MKL reads overlapping key
    windows in place), else a contiguous copy in one of scratch's buffers. oneDNN's bfloat16 and float16 bmm
    copy an overlapping, transposed operand slowly: one step's Q K^T over 16 windows of 320 keys took 0.4-0.7 ms
    on the windows in place and 0.15-0.18 ms with them copied first (the copy included; thread time, one core).
    """
    if x.dtype in (torch.float32, torch.float64) or x.is_contiguous():
        return x
    return scratch.get(name, tuple(x.shape), x).copy_(x)


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
    """q (BHkv, G, q_len, D), k, v (BHkv, N, D) -> (out (BHkv, G, nb*rb, D) in k's dtype, each step's
    probabilities when `keep`)."""
    bk, g, _, d = q.shape
    rb, nb, span, cd = plan.rows, plan.n_blocks, plan.span, k.dtype
    q5 = _query_blocks(q, nb, rb)
    ks, vs = _window_segments(k, plan), _window_segments(v, plan)
    out = k.new_empty(bk, g, nb * rb, d)
    out5 = out.view(bk, g, nb, rb, d)
    direct = g == 1  # each query block's output is a contiguous slice of `out`
    scratch, transient = Scratch(keep), Scratch(False)

    def step(h0: int, h1: int, r0: int, r1: int) -> Tensor | None:
        scores = scratch.get("scores", (h1 - h0, r1 - r0, g * rb, span), k)
        for i, h in enumerate(range(h0, h1)):
            rows = _band_rows(q5, h, r0, r1, cd)
            for seg, a, b in _pieces_of(ks, r0, r1):  # windows have one stride within a segment
                keys = packed(seg.windows[h, a - seg.r0 : b - seg.r0], transient, "keys")
                _scores(rows[a - r0 : b - r0], keys, plan.scale, out=scores[i, a - r0 : b - r0])
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
    nkb, bs, d = blocks.shape[1:]
    if not blocks.is_contiguous():  # a strided view of the caller's K or V (see `_gather_rows`)
        return blocks[h0:h1][:, s.kv].reshape((h1 - h0) * len(s.rows), s.keys, d)
    index = (torch.arange(h0, h1, device=s.kv.device).view(-1, 1) * nkb + s.kv.view(1, -1)).flatten()
    return torch.index_select(blocks.view(-1, bs * d), 0, index).view((h1 - h0) * len(s.rows), s.keys, d)


def _batched(x: Tensor, s: GatherStep, hg: int) -> Tensor:
    """A step's rows (hg*R, G*rb, ...) as the batches of its products: (hg, R*G*rb, ...) when its query
    blocks share their keys (`GatherStep.run_start`), else as they are (a view either way)."""
    return x.view(hg, -1, x.shape[-1]) if s.run_start is not None else x


def _key_blocks(x: Tensor, plan: GatherPlan) -> Tensor:
    """(BHkv, N, D) -> (BHkv, nkb, bs, D), zero padded (a view when bs divides N)."""
    return _pad_rows(x, plan.n_key_blocks * plan.block).view(x.shape[0], plan.n_key_blocks, plan.block, x.shape[2])


def gather_forward(plan: GatherPlan, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> tuple[Tensor, list]:
    """q (BHkv, G, q_len, D), k, v (BHkv, N, D) -> (out (BHkv, G, nqb*rb, D) in k's dtype, each unit's
    probabilities when `keep`)."""
    bk, g, _, d = q.shape
    rb, nqb, cd = plan.rows, plan.n_blocks, k.dtype
    q5 = _query_blocks(q, nqb, rb)
    kb, vb = _key_blocks(k, plan), _key_blocks(v, plan)
    out = k.new_empty(bk, g, nqb * rb, d)
    out5 = out.view(bk, g, nqb, rb, d)
    scratch = Scratch(keep)

    def unit(s: GatherStep, h0: int, h1: int) -> Tensor | None:
        r, hg = len(s.rows), h1 - h0
        if s.keys == 0:  # no allowed key: zeros
            out5[h0:h1].index_fill_(2, s.rows, 0.0)
            return None
        rows = _batched(_gather_rows(q5, h0, h1, s.rows, cd), s, hg)
        scores = _scores(rows, _gathered(kb, s, h0, h1), plan.scale,
                         out=scratch.get("scores", (rows.shape[0], rows.shape[1], s.keys), k))
        _add_pieces(scores.view(hg, r, g, rb, s.keys), s.pieces, 0, r)
        probs = _softmax_(scores)
        result = torch.bmm(probs, _gathered(vb, s, h0, h1))
        _put_gathered_rows(out5, h0, h1, s.rows, result)
        return probs if keep else None  # (KV heads, blocks) are disjoint between units

    return out, run_steps([lambda u=u: unit(*u) for u in _gather_units(plan, bk)], q.device)

