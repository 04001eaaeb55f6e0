"""Maths shared by the distributed implementations (tp_heads, cp_ring, cp_allgather, cp_sparse, cp_ulysses,
cp_usp).

Masked attention over the keys a rank holds, the same with its log-sum-exp (for merging partial results
over key blocks, as ring attention does), the merge itself, the gradients of one key block from the final
log-sum-exp (FlashAttention-2's backward, for a ring's backward pass), ring attention itself with the next
K/V shift in flight while the current block computes (`ring_attention`, used by cp_ring and by cp_usp's ring
level), the Ulysses all-to-alls between sequence shards and head shards (`ulysses_scatter_heads`,
`ulysses_gather_heads`, used by cp_ulysses and cp_usp's Ulysses level), and the byte sizes the closed forms
use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bench.comm import P2P, Communicator, Pending, current
from bench.comm_autograd import all_to_all
from bench.registry import Case
from impls.common import accum_dtype, masked_softmax, masked_softmax_, softmax_scale


def elem_bytes(case: Case) -> int:
    return torch.empty((), dtype=case.torch_dtype).element_size()


def kv_row_bytes(case: Case) -> int:
    """Bytes of one sequence position of K and V together: 2 * B * Hkv * D * e (grouped-query attention
    moves only the KV heads)."""
    return 2 * case.batch * case.n_kv_heads * case.head_dim * elem_bytes(case)


def communicator_for(case: Case) -> Communicator:
    """The current communicator, which must span the case's world_size ranks."""
    comm = current()
    if comm.world_size != case.world_size:
        raise RuntimeError(f"the case has world_size {case.world_size} but this process belongs to a group of "
                           f"{comm.world_size} rank(s)")
    return comm


def grouped_scores(q: Tensor, k: Tensor) -> Tensor:
    """q (B, H, M, D) @ k (B, Hkv, K, D)^T -> (B, H, M, K): query head h against KV head h // (H / Hkv).

    The query heads of one KV head are stacked as rows of one batched matmul, so K is not copied.
    """
    b, h, m, d = q.shape
    hkv = k.shape[1]
    return (q.reshape(b, hkv, (h // hkv) * m, d) @ k.transpose(-1, -2)).view(b, h, m, k.shape[2])


def grouped_values(probs: Tensor, v: Tensor) -> Tensor:
    """probs (B, H, M, K) @ v (B, Hkv, K, D) -> (B, H, M, D), grouped as in `grouped_scores`."""
    b, h, m, kk = probs.shape
    hkv = v.shape[1]
    return (probs.reshape(b, hkv, (h // hkv) * m, kk) @ v).view(b, h, m, v.shape[3])


def score_modifier(case, heads: Tensor, rows: Tensor, cols: Tensor, device: torch.device, dtype: torch.dtype
                   ) -> Callable[[Tensor], Tensor] | None:
    """The case's score modification of a rank's scaled scores (B, len(heads), M, K): `heads` the query heads it
    holds, `rows` and `cols` the absolute positions of its query rows and keys (int64); None without one."""
    mod = case.make_score_mod()
    if mod is None:
        return None
    mod = mod.for_device(device, dtype)
    h, i, j = heads.to(device)[:, None, None], rows.to(device)[:, None], cols.to(device)[None, :]
    return lambda scores: mod.apply(scores, h, i, j)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, modify: Callable[[Tensor], Tensor] | None = None
           ) -> Tensor:
    """Attention of q (B, H, M, D) over k, v (B, Hkv, K, D) where mask (M, K) allows; empty rows give zeros.

    Scores and softmax in float32 for low-precision inputs; the result has q's dtype. `modify`: a score
    modification of the scaled scores, before the mask (`score_modifier`).
    """
    scale = softmax_scale(q.shape[-1])
    scores = grouped_scores(q, k).to(accum_dtype(q.dtype))  # (B, H, M, K)
    if modify is not None:
        probs = masked_softmax(modify(scores * scale), mask)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        probs = masked_softmax(scores * scale, mask)
    else:  # inference: one score-sized buffer
        probs = masked_softmax_(scores.mul_(scale), mask)
    return grouped_values(probs.to(v.dtype), v).to(q.dtype)


def attend_with_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of q (B, H, M, D) over one key block k, v (B, Hkv, K, D) under mask (M, K).

    out (B, H, M, D) is normalised over this block, in the accumulation dtype; lse (B, H, M) is the log of
    the block's softmax denominator. A row with no allowed key in the block has out 0 and lse -inf.
    """
    acc = accum_dtype(q.dtype)
    if k.shape[-2] == 0:  # no keys at all
        return q.new_zeros(q.shape, dtype=acc), q.new_full(q.shape[:-1], -math.inf, dtype=acc)
    scores = grouped_scores(q, k).to(acc) * softmax_scale(q.shape[-1])
    scores = scores.masked_fill(~mask, -math.inf)
    peak = scores.amax(dim=-1, keepdim=True)
    # The max only keeps exp() in range; any finite shift gives the same result, so it carries no gradient.
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak)).detach()
    weights = torch.exp(scores - peak)  # masked keys: exp(-inf) = 0
    denom = weights.sum(dim=-1, keepdim=True)
    has_key = denom > 0
    safe = torch.where(has_key, denom, torch.ones_like(denom))
    out = grouped_values(weights / safe, v.to(acc))
    lse = torch.where(has_key, peak + torch.log(safe), torch.full_like(denom, -math.inf))
    return out, lse.squeeze(-1)


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine attention over two disjoint key sets from their normalised outputs and log-sum-exps.

    out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b); rows empty in both stay 0 with lse -inf.
    Written so that no NaN reaches the gradient of an empty row.
    """
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()  # a shift, as above
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)  # (B, H, M); exp(-inf) = 0
    total = wa + wb
    nonzero = total > 0
    safe = torch.where(nonzero, total, torch.ones_like(total))
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / safe[..., None]
    lse = torch.where(nonzero, top + torch.log(safe), torch.full_like(total, -math.inf))
    return out, lse


def grouped_key_products(x: Tensor, y: Tensor, kv_heads: int) -> Tensor:
    """x (B, H, M, K)^T @ y (B, H, M, D) summed over the query heads of each KV head -> (B, Hkv, K, D).

    The adjoint of `grouped_values` in v (dV = P^T dO) and of `grouped_scores` in k (dK = dS^T Q).
    """
    b, h, m, kk = x.shape
    g = h // kv_heads
    return x.reshape(b, kv_heads, g * m, kk).transpose(-1, -2) @ y.reshape(b, kv_heads, g * m, y.shape[-1])


def attend_block_grads(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dout: Tensor, lse: Tensor,
                       delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention through one key block, given the final log-sum-exp over all blocks.

    q (B, H, M, D), k, v (B, Hkv, K, D), mask (M, K); dout (B, H, M, D), lse (B, H, M) and delta = rowsum(dout *
    out) (B, H, M), all in the accumulation dtype. With P = exp(S - lse) (the final probabilities restricted
    to this block), dV = P^T dO, dS = P * (dO V^T - delta), dQ = dS K * scale, dK = dS^T Q * scale: the block's
    share of each gradient, to be summed over blocks. Returns (dq, dk, dv) in the accumulation dtype.
    """
    acc = dout.dtype
    scale = softmax_scale(q.shape[-1])
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    hkv = k.shape[1]
    scores = grouped_scores(qa, ka) * scale  # (B, H, M, K)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    probs = torch.where(mask & finite[..., None], torch.exp(scores - safe[..., None]), torch.zeros_like(scores))
    dv = grouped_key_products(probs, dout, hkv)
    dscores = probs * (grouped_scores(dout, va) - delta[..., None])
    dq = grouped_values(dscores, ka) * scale
    dk = grouped_key_products(dscores, qa, hkv) * scale
    return dq, dk, dv


# --- ring attention --------------------------------------------------------------------------------------

KV_TAG, DKV_TAG = 1, 2  # a ring's K/V shift and its dK/dV shift can be in flight between the same two ranks


@dataclass(frozen=True)
class Ring:
    """One rank's place in a ring of `size` ranks (ranks of `comm`): it sends to `next_rank` and receives from
    `prev_rank`. `masks[t]`: the (queries, keys) mask of the K/V block it holds at step t (the block of the
    ring member t places before it), None where no pair is allowed (not computed, still passed on).
    `level`: the label its shifts are counted under."""

    comm: Communicator
    size: int
    next_rank: int
    prev_rank: int
    masks: tuple[Tensor | None, ...]
    level: str | None = "ring"

    def start_shift(self, x: Tensor, tag: int) -> tuple[Tensor, Pending]:
        """Send x on to next_rank and receive the previous rank's into a new tensor; returns at once. A ring
        of one rank keeps x."""
        if self.size == 1:
            return x, Pending([])
        received = torch.empty_like(x)
        with self.comm.level(self.level):
            pending = self.comm.start_batch_isend_irecv([P2P("send", x, self.next_rank, tag),
                                                          P2P("recv", received, self.prev_rank, tag)])
        return received, pending


class _RingAttention(torch.autograd.Function):
    """Ring attention, forward and backward written out so that communication overlaps compute.

    Forward, step t = 0..R-1: start shifting the K/V block held on to the next rank, attend to it (merging with
    log-sum-exps), then wait for the block coming in. Backward (as ring-flash-attention and PyTorch's context
    parallel do it): K/V go round the ring again (R-1 shifts) while each block's gradients are computed from
    the saved output and log-sum-exp; the dK/dV of each block travel with it, accumulated by every rank that
    attended to it, and after R shifts reach the rank that owns it. dK/dV travel in the accumulation dtype.
    Nothing but the rank's own q, k, v, output and log-sum-exp is kept between forward and backward.
    """

    @staticmethod
    def forward(ctx: Any, ring: Ring, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv = torch.stack((k, v)).contiguous()  # (2, B, Hkv, C, D)
        out = lse = None
        for step in range(ring.size):
            incoming = ring.start_shift(kv, KV_TAG) if step + 1 < ring.size else None
            mask = ring.masks[step]
            if mask is not None:
                o, l = attend_with_lse(q, kv[0], kv[1], mask)
                out, lse = (o, l) if out is None else merge(out, lse, o, l)
            if incoming is not None:
                kv, pending = incoming
                pending.wait()
        acc = accum_dtype(q.dtype)
        if out is None or lse is None:  # no allowed pair for any of this rank's queries
            out = q.new_zeros(q.shape, dtype=acc)
            lse = q.new_full(q.shape[:-1], -math.inf, dtype=acc)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[None, Tensor, Tensor, Tensor]:
        ring: Ring = ctx.ring
        q, k, v, out, lse = ctx.saved_tensors
        acc = out.dtype
        dout = dout.to(acc)
        delta = (dout * out).sum(dim=-1)  # (B, H, C)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        dkv_in: tuple[Tensor, Pending] | None = None
        for step in range(ring.size):
            incoming = ring.start_shift(kv, KV_TAG) if step + 1 < ring.size else None
            mask = ring.masks[step]
            block = None
            if mask is not None:
                dq_b, dk_b, dv_b = attend_block_grads(q, kv[0], kv[1], mask, dout, lse, delta)
                dq += dq_b
                block = torch.stack((dk_b, dv_b))
            if dkv_in is None:  # the first block is this rank's own: its accumulator starts here
                dkv = block if block is not None else kv.new_zeros(kv.shape, dtype=acc)
            else:
                dkv, pending = dkv_in
                pending.wait()
                if block is not None:
                    dkv += block
            dkv_in = ring.start_shift(dkv.contiguous(), DKV_TAG)  # on to the next rank that holds this block
            if incoming is not None:
                kv, pending = incoming
                pending.wait()
        assert dkv_in is not None
        dkv, pending = dkv_in
        pending.wait()  # after R shifts: the accumulated dK/dV of this rank's own block
        return None, dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> Tensor:
    """Attention of q (B, H, C, D) over the K/V blocks of every ring member (k, v (B, Hkv, C', D) this rank's
    own), with `ring.masks`; differentiable in q, k and v. With a ring of one it is local attention."""
    return _RingAttention.apply(ring, q, k, v)


def ring_bytes(case: Case, ring_degree: int, kv_heads: int) -> int:
    """Bytes all ranks send in ring attention over rings of `ring_degree` ranks that together hold the whole
    sequence at `kv_heads` K/V heads: forward (R-1) * N rows of K/V; backward (R-1) * N rows again plus R * N
    rows of dK/dV in the accumulation dtype."""
    row = 2 * case.batch * kv_heads * case.head_dim
    forward = (ring_degree - 1) * case.seq_len * row * elem_bytes(case)
    if case.mode == "fwd" or ring_degree == 1:
        return forward
    acc = torch.empty((), dtype=accum_dtype(case.torch_dtype)).element_size()
    return 2 * forward + ring_degree * case.seq_len * row * acc


# --- Ulysses -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UlyssesGroup:
    """A rank's Ulysses group: `members` (ranks of the communicator, consecutive), `index` its place there,
    `world_size` the communicator's ranks (the all-to-all spans them, sending nothing outside the group)."""

    members: tuple[int, ...]
    index: int
    world_size: int
    level: str | None = "ulysses"

    @property
    def size(self) -> int:
        return len(self.members)

    def splits(self) -> list[int]:
        """One block of rows to (and from) each member, none to other ranks."""
        return [1 if r in self.members else 0 for r in range(self.world_size)]


def ulysses_kv_heads(heads: int, kv_heads: int, degree: int) -> int:
    """K/V heads after the all-to-all is prepared: kv_heads when the group's ranks can split them, else the KV
    heads repeated so that each rank gets one (degree % kv_heads == 0, as DeepSpeed-Ulysses does)."""
    return kv_heads if kv_heads % degree == 0 else degree


def ulysses_problem(name: str, heads: int, kv_heads: int, degree: int, what: str) -> str | None:
    """Why heads cannot be split over `degree` ranks after the all-to-all, or None."""
    if heads % degree:
        return (f"{name} splits the heads over {what} {degree} after the all-to-all: heads {heads} is not "
                f"divisible by {degree}")
    if kv_heads % degree and degree % kv_heads:
        return (f"{name} gives each of {what} {degree} ranks whole KV heads: kv_heads {kv_heads} must divide by "
                f"{degree} (each rank its KV heads) or divide {degree} (KV heads repeated {degree} // kv_heads "
                "times)")
    return None


def ulysses_scatter_heads(group: UlyssesGroup, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Sequence shards -> head shards, for several tensors in one all-to-all.

    Each t (B, Ht, C, D) holds this rank's C positions for all Ht heads (Ht % group.size == 0); the result
    (B, Ht / u, u * C, D) holds head group `group.index` for the positions of every member, in member order.
    Differentiable (the backward is the reverse all-to-all).
    """
    u = group.size
    b, _, c, d = tensors[0].shape
    per_group = [t.shape[1] // u for t in tensors]
    blocks = torch.cat([t.reshape(b, u, h, c, d) for t, h in zip(tensors, per_group, strict=True)], dim=2)
    send = blocks.transpose(0, 1)  # (u, B, sum Ht/u, C, D): row j goes to member j
    splits = group.splits()
    with current().level(group.level):
        got = all_to_all(send, splits, splits)  # row s came from member s: its positions
    parts = got.split(per_group, dim=2)
    return [p.permute(1, 2, 0, 3, 4).reshape(b, h, u * c, d) for p, h in zip(parts, per_group, strict=True)]


def ulysses_gather_heads(group: UlyssesGroup, x: Tensor) -> Tensor:
    """Head shards -> sequence shards: x (B, H / u, u * C, D) -> (B, H, C, D), the reverse of
    `ulysses_scatter_heads` (member j gets back its positions, every member's heads in order)."""
    u = group.size
    b, h, uc, d = x.shape
    c = uc // u
    send = x.reshape(b, h, u, c, d).permute(2, 0, 1, 3, 4)  # (u, B, H/u, C, D): row j -> member j
    splits = group.splits()
    with current().level(group.level):
        got = all_to_all(send, splits, splits)  # row s: head group s of this rank's positions
    return got.transpose(0, 1).reshape(b, u * h, c, d)


def ulysses_bytes(case: Case, degree: int) -> int:
    """Bytes all ranks send in the Ulysses all-to-alls over groups of `degree` ranks: forward, each rank sends
    (u-1)/u of its q, k, v and of the output, (u-1)/u * B*N*(2H + 2Hkv')*D*e in all (Hkv': `ulysses_kv_heads`);
    fwd_bwd twice that (the gradients go back the same way)."""
    kv = ulysses_kv_heads(case.heads, case.n_kv_heads, degree)
    per_rank_positions = case.seq_len // case.world_size
    per_rank = (degree - 1) * case.batch * per_rank_positions * case.head_dim * (2 * case.heads + 2 * kv) // degree
    forward = case.world_size * per_rank * elem_bytes(case)
    return forward if case.mode == "fwd" else 2 * forward


# --- traffic matrices: sent[src][dst], the closed forms per link (DistributedImpl.expected_comm_matrix) ------

def empty_matrix(p: int) -> list[list[int]]:
    return [[0] * p for _ in range(p)]


def ring_matrix(p: int, per_rank: int, step: int = 1) -> list[list[int]]:
    """Every rank sends `per_rank` bytes to rank (r + step) % P (a ring, or rings of stride `step`)."""
    sent = empty_matrix(p)
    if p > 1:
        for r in range(p):
            sent[r][(r + step) % p] += per_rank
    return sent


def ulysses_peer_bytes(case: Case, degree: int) -> int:
    """Bytes one rank sends each other member of its Ulysses group of `degree` ranks in the all-to-alls:
    1/u of its q, k, v (C = N/P positions, H + 2 Hkv' heads) and of its output (H heads), B*C*D*(2H + 2Hkv')/u
    elements; fwd_bwd twice that. Summed over the P ranks and u-1 peers this is `ulysses_bytes`."""
    kv = ulysses_kv_heads(case.heads, case.n_kv_heads, degree)
    positions = case.seq_len // case.world_size
    forward = case.batch * positions * case.head_dim * (2 * case.heads + 2 * kv) // degree * elem_bytes(case)
    return forward if case.mode == "fwd" else 2 * forward


def add_matrix(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    return [[x + y for x, y in zip(ra, rb, strict=True)] for ra, rb in zip(a, b, strict=True)]
